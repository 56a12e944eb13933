"""The "hybridtron" rollout engine: hybridtron's own inference engine (hybridtron.infer.engine.HybridEngine) in the
rollout role's process, on its own copy of the policy, MTP speculative drafts by default. The weights are copied
into it in place between generations, so the version it holds is the last one loaded."""

from __future__ import annotations

from hybridtron.infer.engine import HybridEngine
from hybridtron.model.lm import HybridLM
from hybridtron.post.rl.engines.base import RolloutEngine


class HybridtronRollouts(RolloutEngine):
    def __init__(self, config, *, model_config, tokenizer):
        model = HybridLM(model_config, init=False)  # the weights come from the learner
        self.engine = HybridEngine.from_model(model, tokenizer, model_name="policy", speculative=config.speculative,
                                              draft_length=config.draft_length)
        self.version: int | None = None

    @property
    def last_stats(self):
        return self.engine.last_stats

    def load_weights(self, version, state_dict) -> None:
        self.engine.load_weights(state_dict)
        self.version = version

    def generate(self, prompts, params, n, *, version, expert_ids=False, first_prompt=0):
        if version != self.version:
            raise ValueError(f"rollout of weight version {version} asked, but the engine holds version "
                             f"{self.version}")
        return self.engine.generate(prompts, params, n=n, logprobs=True, expert_ids=expert_ids,
                                    first_prompt=first_prompt)
