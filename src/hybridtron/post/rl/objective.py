"""What the learner of every on-policy RL objective shares: the log-probs of the sampled tokens under the
distribution the rollout engine sampled from (`sampled_logprobs`), and `RolloutObjective`, the base of GRPO's and
MOPD's objectives: the forward with routing replay, the step's global token counts every micro-batch's loss is
normalised by, and what the stages read under pipeline parallelism. Each objective keeps only its own loss."""

from __future__ import annotations

import math

import torch

from hybridtron.dist.pipeline import MicroBatchInputs
from hybridtron.infer.sampling import probs_from_logits
from hybridtron.ops.cross_entropy import IGNORE_INDEX
from hybridtron.post.rl.batches import rollout_router_counts

LOGP_FLOOR = -50.0  # a sampled token the learner's top-k / top-p would have filtered out: log-prob floored here


def sampled_logprobs(logits_BTV, tokens_BT, temperature: float, top_k: int = 0, top_p: float = 1.0):
    """log p(token) [B, T] under the distribution the rollout engine sampled from: the logits divided by the
    temperature, then top-k and top-p filtered and renormalised (`hybridtron.infer.sampling.probs_from_logits`,
    whose kept set is used here as a constant mask), in fp32, differentiable. Positions whose token is negative
    (IGNORE_INDEX) get a finite value that callers mask out. With a filter, a token outside the learner's own kept
    set (the two engines' logits differ slightly) would be -inf: it is floored at LOGP_FLOOR, where its IS weight
    w ~ 0 drops it, and gets no gradient."""
    scaled = logits_BTV.float() / temperature
    filtered = top_k > 0 or top_p < 1.0
    if filtered:
        with torch.no_grad():
            kept = probs_from_logits(logits_BTV.detach(), temperature, top_k, top_p) > 0
        scaled = scaled.masked_fill(~kept, -math.inf)
    logp = torch.log_softmax(scaled, dim=-1).gather(-1, tokens_BT.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return logp.clamp(min=LOGP_FLOOR) if filtered else logp



class RolloutObjective:
    """What the objectives on rollouts (GRPO's, MOPD's) share: their config (`loss_config()`, `mtp_loss_weight`), the
    MTP depths trained (none with the MTP loss off), and the step's global counts that every micro-batch's loss is
    normalised by (`begin_step`: `row_counts(mb)` of each micro-batch, then each MTP depth's targets, summed over the
    step and, under torchrun, over the data-parallel ranks). `data_ranks`: the metrics every rank holds whole are
    divided by it, since the trainer sums the ranks' metrics. A micro-batch's loss is `loss_from_outputs` of the
    learner's forward with routing replay (`__call__`), or under PP of the last stage's outputs (`stage_inputs`:
    what the stages read)."""

    def __init__(self, config, mtp_depths: int, parallel=None):
        self.config, self.loss_config = config, config.loss_config()
        self.mtp_depths = mtp_depths if config.mtp_loss_weight > 0 else 0
        self.data_sum = parallel.sum_over_data if parallel is not None else None
        self.data_ranks = parallel.layout.dp * parallel.layout.cp if parallel is not None else 1  # sum_over_data's
        self.counts: list[float] = []  # row_counts' values, then the MTP targets of each depth
        self.micro_batches = 1

    def row_counts(self, mb) -> list:
        raise NotImplementedError

    def begin_step(self, micro_batches) -> None:
        rows = [self.row_counts(mb) + [(mb.mtp_targets(d) != IGNORE_INDEX).sum()
                                       for d in range(1, self.mtp_depths + 1)] for mb in micro_batches]
        device = micro_batches[0].labels.device  # a collective's tensor lives on the run's device (NCCL: CUDA)
        counts = torch.tensor([[float(x) for x in row] for row in rows], dtype=torch.float64, device=device).sum(dim=0)
        if self.data_sum is not None:
            counts = self.data_sum(counts)
        self.counts = counts.tolist()
        self.micro_batches = len(micro_batches)

    def stage_inputs(self, mb):
        """Under PP: what the stages read of a micro-batch of rollouts: its ids (and under CP the ids after the
        share), the rollout's experts to replay, its real tokens (the positions whose routing counts)."""
        following = [] if mb.following_ids is None else [mb.following_ids]
        return MicroBatchInputs(torch.cat([mb.input_ids, *following], dim=1), tokens=int(mb.valid.sum()),
                                lookahead=following[0].shape[1] if following else 0,
                                expert_ids=mb.expert_ids if self.config.routing_replay else None,
                                counted=mb.counted)

    def forward(self, model, mb):
        """The learner's forward on a micro-batch of rollouts, with routing replay: (logits, *MTP logits), counts."""
        replay = mb.expert_ids if self.config.routing_replay else None
        out = model(mb.input_ids, expert_ids=replay, mtp=self.mtp_depths > 0, following_ids=mb.following_ids,
                    counted=mb.counted)
        return (out.logits, *out.mtp_logits), rollout_router_counts(model, out)

    def __call__(self, model, mb):
        outputs, counts = self.forward(model, mb)
        return self.loss_from_outputs(model, outputs, mb, counts)
