"""The held-out evaluation of an RL run: greedy pass@1 of the learner's policy on fixed test-split tasks, at step 0,
every `eval_every` steps and at the end (`hybridtron.eval.tasks.evaluate_env`; an environment with tools through its
turn loop). `PolicySnapshot` gives the decoder one unsharded copy of the policy, whatever the learner's layout."""

from __future__ import annotations

from hybridtron.distributed.step import full_state_dict
from hybridtron.eval.tasks import evaluate_env
from hybridtron.infer.engine import HybridEngine
from hybridtron.infer.sampling import SamplingParams
from hybridtron.model.lm import HybridLM
from hybridtron.post.agentic import engine_generate, run_episodes
from hybridtron.train.evaluate import Evaluator


class PolicySnapshot:
    """The learner's policy as one unsharded model that the decoder can run: the trainer's model itself in one
    process; under torchrun a full copy on global rank 0 (None on the other ranks), refreshed from the shards by a
    gathering every rank joins."""

    def __init__(self):
        self.copy = None

    def __call__(self, trainer):
        if not trainer.parallel.distributed:  # whole weights: the model itself, no copy
            return trainer.model
        state = full_state_dict(trainer.model, trainer.parallel)
        if state is None:
            return None
        if self.copy is None:  # on the run's device (the gathered tensors arrive on the CPU)
            self.copy = HybridLM(trainer.model.config, init=False).to(trainer.parallel.device)
        self.copy.load_state_dict(state)
        return self.copy


def evaluate_on_main(trainer, snapshot: PolicySnapshot, evaluate) -> dict[str, float]:
    """`evaluate(model)` on the policy (`snapshot`), on global rank 0 under torchrun, its values on every rank."""
    model = snapshot(trainer)
    was_training = model.training if model is not None else False
    values = evaluate(model) if model is not None else None
    if model is not None:
        model.train(was_training)
    return trainer.parallel.broadcast_object(values)


class HeldOutAccuracy(Evaluator):
    """Greedy pass@1 of the learner on fixed test-split tasks of one environment, overall and per difficulty
    level, plus the mean reward and completion length. Its history is the run's pass@1 curve. An environment with
    tools is measured through its turn loop (`hybridtron.post.agentic.run_episodes`, on hybridtron's engine over a
    copy of the policy; each turn `max_tokens`, each trajectory the policy's context), the length counting the
    model's tokens."""

    key = "pass_at_1"

    def __init__(self, env, tasks, tokenizer, every: int, *, max_tokens: int, batch_size: int,
                 enable_thinking: bool | None):
        super().__init__()
        self.env, self.tasks, self.tokenizer, self.every = env, tasks, tokenizer, every
        self.max_tokens, self.batch_size, self.enable_thinking = max_tokens, batch_size, enable_thinking
        self.snapshot = PolicySnapshot()

    def measure(self, model) -> dict[str, float]:
        """The metrics of one unsharded `model` (put in eval mode)."""
        if self.env.tools:
            return self.measure_episodes(model)
        result = evaluate_env(model, self.tokenizer, self.env, self.tasks, max_tokens=self.max_tokens,
                              batch_size=self.batch_size, enable_thinking=self.enable_thinking)
        return {self.key: result.pass_at_1, "eval_mean_reward": result.mean_reward,
                "eval_response_length": result.mean_completion_tokens,
                **{f"pass_at_1/L{level}": value for level, value in result.by_difficulty.items()}}

    def measure_episodes(self, model) -> dict[str, float]:
        """`measure` of a tool environment: greedy trajectories, `batch_size` at a time."""
        model.eval()
        generate = engine_generate(HybridEngine.from_model(model, self.tokenizer, speculative=False))
        params = SamplingParams(temperature=0.0, max_tokens=self.max_tokens)
        trajectories = []
        for start in range(0, len(self.tasks), self.batch_size):
            trajectories += run_episodes(generate, self.tokenizer, self.env, self.tasks[start:start + self.batch_size],
                                         params, token_budget=model.config.max_position_embeddings,
                                         enable_thinking=self.enable_thinking)
        levels: dict[int, list[bool]] = {}
        for trajectory in trajectories:
            levels.setdefault(trajectory.task.difficulty, []).append(trajectory.reward == 1.0)
        n = len(trajectories)
        return {self.key: sum(t.reward == 1.0 for t in trajectories) / n,
                "eval_mean_reward": sum(t.reward for t in trajectories) / n,
                "eval_response_length": sum(t.model_tokens for t in trajectories) / n,
                **{f"pass_at_1/L{level}": sum(v) / len(v) for level, v in sorted(levels.items())}}

    def evaluate(self, trainer) -> dict[str, float]:
        values = evaluate_on_main(trainer, self.snapshot, self.measure)
        self.history.append((trainer.step, values[self.key]))
        return values


class DomainAccuracy(Evaluator):
    """`HeldOutAccuracy` for each environment of a mixture (MOPD's domains): `pass_at_1/<domain>` and the like,
    and their mean as `pass_at_1`."""

    key = "pass_at_1"

    def __init__(self, mixture, tokenizer, config):
        super().__init__()
        self.every = config.eval_every
        self.by_domain = {env.domain: HeldOutAccuracy(env, env.tasks("test", config.eval_tasks, config.seed),
                                                      tokenizer, config.eval_every, max_tokens=config.eval_max_tokens,
                                                      batch_size=config.eval_batch_size,
                                                      enable_thinking=config.enable_thinking)
                          for env in mixture.members}
        self.snapshot = PolicySnapshot()

    def measure(self, model) -> dict[str, float]:
        values = {}
        for domain, evaluator in self.by_domain.items():
            result = evaluator.measure(model)
            values[f"pass_at_1/{domain}"] = result["pass_at_1"]
            values[f"eval_mean_reward/{domain}"] = result["eval_mean_reward"]
            values[f"eval_response_length/{domain}"] = result["eval_response_length"]
        return {self.key: sum(values[f"pass_at_1/{d}"] for d in self.by_domain) / len(self.by_domain), **values}

    def evaluate(self, trainer) -> dict[str, float]:
        values = evaluate_on_main(trainer, self.snapshot, self.measure)
        for domain, evaluator in self.by_domain.items():
            evaluator.history.append((trainer.step, values[f"pass_at_1/{domain}"]))
        self.history.append((trainer.step, values[self.key]))
        return values

    def state_dict(self):
        return {"history": list(self.history), "domains": {d: e.state_dict() for d, e in self.by_domain.items()}}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        for domain, evaluator in self.by_domain.items():
            evaluator.load_state_dict(state["domains"][domain])
