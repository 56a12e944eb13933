"""Rollout engines: what generates the rollouts of GRPO and MOPD (`[grpo] engine`, `[mopd] engine`), behind one
interface the rollout role (hybridtron.post.rl.rollout.RolloutRole) calls, one module per engine:

- "hybridtron" (hybridtron.post.rl.engines.hybridtron, the default): hybridtron's own inference engine in the role's
  process (`HybridEngine`), weights copied in place after every optimizer step.
- "vllm" (hybridtron.post.rl.engines.vllm): vLLM in a process of its own, started with the vLLM environment's
  Python (`.venv-vllm`, scripts/setup_vllm.sh), weights pushed through vLLM's weight-update path.

An engine (`RolloutEngine`) samples `n` completions of each prompt with the rollout's sampling parameters (the
temperature, top-k, top-p, max tokens, seed, stop strings and stop token ids of a `SamplingParams`; the end tokens of
the chat template always stop), each a `hybridtron.infer.scheduler.Completion` with its token ids and the log-probs
of the distribution each token was drawn from (temperature-scaled, top-k / top-p filtered and renormalised: what
`hybridtron.post.rl.objective.sampled_logprobs` recomputes in the learner); holds one weight version at a time
(`load_weights(version, state_dict)`) and refuses to sample with another (`generate(..., version=)`); and says what
its last generation drafted (`last_stats`, MTP speculative decoding).
"""

from __future__ import annotations

# the engines' names (which the RL sections' settings are checked against) and interface, re-exported
from hybridtron.post.rl.engines.base import ENGINES, WEIGHT_SYNCS, RolloutEngine  # noqa: F401
from hybridtron.post.rl.engines.hybridtron import HybridtronRollouts
from hybridtron.post.rl.engines.vllm import VLLMRollouts


def rollout_engine(config, *, model_dir: str, model_config, tokenizer) -> RolloutEngine:
    """The engine `config.engine` names (`config`: an RL section, hybridtron.post.rl.config.RolloutConfig) for the
    policy of `model_config`, whose tokenizer and chat template are `model_dir`'s."""
    if config.engine == "vllm":
        return VLLMRollouts(config, model_dir=model_dir, model_config=model_config, tokenizer=tokenizer)
    return HybridtronRollouts(config, model_config=model_config, tokenizer=tokenizer)
