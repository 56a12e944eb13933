"""The rollout engines' names and interface (hybridtron.post.rl.engines, whose docstring describes them)."""

from __future__ import annotations

from typing import Mapping

import torch

ENGINES = ("hybridtron", "vllm")
WEIGHT_SYNCS = ("reload", "nccl")  # vllm: reload_weights from a directory, or the NCCL weight-transfer engine


class RolloutEngine:
    """The interface of a rollout engine (see hybridtron.post.rl.engines)."""

    last_stats = None  # hybridtron.infer.engine.AcceptanceStats of the last generation (None: it drafted nothing)

    def generate(self, prompts: list[list[int]], params, n: int, *, version: int, expert_ids: bool = False,
                 first_prompt: int = 0) -> list:
        """`n` completions of each prompt, `result[prompt][sample]` (`Completion`s with log-probs), sampled with the
        weights of `version` (else an error), reproducible from `params.seed`: sample j of prompt i depends on the
        seed and on `first_prompt + i` alone, so that engines sharing one list of prompts sample it as one would.
        `expert_ids`: each sample's routed experts for routing replay ({backbone router name: [tokens, K]})."""
        raise NotImplementedError

    def load_weights(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        """The learner's weights after optimizer step `version` (`HybridLM.state_dict()` names)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the engine holds (processes, files)."""
