"""GRPO's frozen reference as a scoring role: the log-prob of every sampled completion token under the initial
policy, computed once per rollout between rollout and learner (as verl's and miles' reference workers do), so the
learner holds no copy of the reference under any layout.

`ReferenceScoringRole` (a `hybridtron.post.rl.rollout.ScoringRole`) loads the --model checkpoint GRPO starts from and adds
`Rollout.scores["reference"]` [C]: log pi_ref(y_t | s_t) at the rollout's temperature with its top-k / top-p
filter (`hybridtron.post.rl.objective.token_scores`, as the learner scores the policy: `grpo.logprob_chunk` rows at a
time through lm_head, never the [tokens, vocab] logits), with the rollout's experts replayed in every backbone MoE
layer under routing replay (the learner's forward replays them too, so the k3 KL compares the two models on the
same routes). `hybridtron.post.grpo.GRPOObjective` reads the scores for its KL (`grpo.kl_coef` > 0, or logged with
`grpo.reference_kl`).
"""

from __future__ import annotations

import torch

from hybridtron.checkpoint import load_pretrained
from hybridtron.post.rl.batches import rollout_rows
from hybridtron.post.rl.config import LOGPROB_CHUNK
from hybridtron.post.rl.objective import head_forward, token_scores
from hybridtron.post.rl.rollout import Rollout, ScoringRole, completion_scores

REFERENCE_SCORE = "reference"  # the name of the reference's per-token log-probs in Rollout.scores
REFERENCE_ROLE = "reference"


def score_reference(model, rollouts: list[Rollout], *, temperature: float, top_k: int = 0, top_p: float = 1.0,
                    routing_replay: bool = True, chunk: int = LOGPROB_CHUNK) -> None:
    """`scores["reference"]` of `rollouts` under `model` (one forward, no gradient; `chunk` rows per block)."""
    rows = rollout_rows(rollouts, model.config.pad_token_id or 0)
    with torch.no_grad():
        head, _ = head_forward(model, rows.input_ids, expert_ids=rows.expert_ids if routing_replay else None,
                               mtp=False)
        logp = token_scores(head, rows.labels, temperature, top_k, top_p, chunk=chunk).logp
    completion_scores(rollouts, REFERENCE_SCORE, logp)


class ReferenceScoringRole(ScoringRole):
    """The frozen initial policy (`model_dir`, of architecture `model_config`), scoring every rollout of a batch (see
    the module docstring); `config` is the run's [grpo] section (temperature, top_k, top_p, routing_replay, reference_batch_size rows per forward);
    `share`: see `hybridtron.post.rl.rollout.ScoringRole`."""

    name = REFERENCE_ROLE
    seconds_key = "reference_seconds"

    def __init__(self, *, model_dir: str, model_config, config, threads: int = 0, share=None):
        super().__init__(batch_size=config.reference_batch_size, share=share)
        if threads:
            torch.set_num_threads(threads)
        self.config = config
        self.model = load_pretrained(model_dir, config=model_config, dtype=torch.float32).eval().requires_grad_(False)

    def models_for(self, rollouts: list[Rollout]):
        return [(self.model, rollouts)]

    def score(self, model, rollouts: list[Rollout]) -> None:
        cfg = self.config
        score_reference(model, rollouts, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                        routing_replay=cfg.routing_replay, chunk=cfg.logprob_chunk)
