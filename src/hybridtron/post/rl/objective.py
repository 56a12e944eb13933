"""What the learner of every on-policy RL objective shares: the log-probs of the sampled tokens under the
distribution the rollout engine sampled from (`sampled_logprobs`, and `token_scores`, which computes them with the
entropy and a teacher's top-K tokens a block of rows at a time), and `RolloutObjective`, the base of GRPO's and
MOPD's objectives: the forward with routing replay, the step's global token counts every micro-batch's loss is
normalised by, and what the stages read under pipeline parallelism. Each objective keeps only its own loss.

Every RL log-prob pass (the learner here, the reference and the teachers' scoring) stops the model before lm_head
(`head_forward`) and applies it itself with `ops.linear_logprobs`, `logprob_chunk` rows at a time, recomputing a
block's logits in the backward: no [tokens, vocab] tensor exists beyond one block, and only the labelled positions
(the completions) are scored. The learner's MTP losses go through pretraining's fused lm_head + CE the same way.
Under torchrun too: the op runs as a call of the lm_head module (`distributed.head.apply_head`), so FSDP2 gathers
the weight and reduce-scatters its gradient as for the head's own forward, a TP head is applied vocabulary-parallel
(each block's logits gathered over the TP ranks, one block at a time), and a converted head (`MainGradLinear`)
accumulates its gradient in its main_grad (in `train.grad_accum_dtype`); under PP the last stage hands the loss
lm_head's inputs too, and the loss applies that stage's head the same way (`as_head_outputs`). Only where lm_head
is not a plain linear layer (a quantized head: `distributed.head.blockwise_head`) are the model's [tokens, vocab]
logits taken as they come, and the same per-row function runs on blocks of them: beside the logits and their
gradient, no other such tensor.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from hybridtron.distributed.head import apply_head, blockwise_head
from hybridtron.distributed.mesh import Parallel
from hybridtron.distributed.pipeline import MicroBatchInputs
from hybridtron.infer.sampling import probs_from_logits
from hybridtron.ops.cross_entropy import IGNORE_INDEX
from hybridtron.ops.linear_cross_entropy import linear_cross_entropy
from hybridtron.ops.linear_logprobs import linear_logprobs
from hybridtron.post.losses import token_entropy
from hybridtron.post.rl.batches import rollout_router_counts
from hybridtron.post.rl.config import LOGPROB_CHUNK
from hybridtron.post.sft import sft_loss
from hybridtron.train.objectives import ObjectiveOutput, token_mean_shares

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


@dataclass
class HeadOutputs:
    """What a forward hands the log-prob passes: lm_head's inputs (the backbone's, then each MTP depth's) with the
    lm_head module they apply (`lm_head`, a `distributed.head.blockwise_head`), or, `lm_head` None, their logits
    (a quantized lm_head)."""

    states: tuple[torch.Tensor, ...]
    lm_head: torch.nn.Module | None = None


def as_head_outputs(model, outputs) -> HeadOutputs:
    """`HeadOutputs` as they are, or of a pipeline's last stage's outputs, lm_head's inputs (the final hidden, then
    each MTP depth's): with `model`'s (the stage's) lm_head where the passes can apply it (`blockwise_head`), else
    their logits through it."""
    if isinstance(outputs, HeadOutputs):
        return outputs
    head = blockwise_head(model)
    return HeadOutputs(tuple(outputs), head) if head is not None else \
        HeadOutputs(tuple(model.lm_head(state) for state in outputs))


def head_forward(model, input_ids, **inputs):
    """`model(input_ids, **inputs)` stopped before lm_head where the passes can apply it themselves
    (`blockwise_head`; `logits=False`), and the (`HeadOutputs`, the model's output) of it."""
    head = blockwise_head(model)
    out = model(input_ids, logits=head is None, **inputs)
    states = (out.hidden, *out.mtp_hidden) if head is not None else (out.logits, *out.mtp_logits)
    return HeadOutputs(states, head), out


@dataclass
class TokenScores:
    """Per-position scores of the next-token distribution; [B, T] unless said (where the label is ignored: 0
    through lm_head's weight, a finite value to mask out through the logits)."""

    logp: torch.Tensor  # log p of the label under the sampling distribution (`sampled_logprobs`)
    entropy: torch.Tensor | None = None  # of the temperature-scaled distribution, unfiltered (`token_entropy`)
    given_logp: torch.Tensor | None = None  # [B, T, K]: log p (scaled, unfiltered) of the given ids
    top_logp: torch.Tensor | None = None  # [B, T, K]: the K largest log-probs (scaled, unfiltered) ...
    top_ids: torch.Tensor | None = None  # ... and their ids (int64)


def row_scores(logits_RV, tokens_R, *given_ids_RK, temperature, top_k, top_p, entropy, top):
    """`TokenScores`' fields of a block of rows (or of [B, T] positions) from their logits, in that order."""
    outputs = [sampled_logprobs(logits_RV, tokens_R, temperature, top_k, top_p)]
    scaled = logits_RV.float() / temperature if entropy or given_ids_RK or top else None
    if entropy:
        outputs.append(token_entropy(scaled))
    if given_ids_RK:
        outputs.append(scaled.gather(-1, given_ids_RK[0].long()) - scaled.logsumexp(-1, keepdim=True))
    if top:
        outputs.extend(torch.log_softmax(scaled, dim=-1).topk(min(top, scaled.shape[-1]), dim=-1))
    return tuple(outputs)


def token_scores(head: HeadOutputs, tokens_BT, temperature: float, top_k: int = 0, top_p: float = 1.0, *,
                 entropy: bool = False, given_ids=None, top: int = 0, chunk: int = LOGPROB_CHUNK) -> TokenScores:
    """`TokenScores` of the labels `tokens_BT` from the first of `head`'s states, `chunk` rows at a time
    (`ops.linear_logprobs`): the labelled rows through lm_head where the module is given (`apply_head`), else every
    position's logits. `given_ids` [B, T, K]: ids whose log-probs to return (MOPD's teacher top K); `top`: return
    the K = `top` most likely tokens."""
    fn = functools.partial(row_scores, temperature=temperature, top_k=top_k, top_p=top_p, entropy=entropy, top=top)
    extra = () if given_ids is None else (given_ids,)
    B, T = tokens_BT.shape
    if head.lm_head is None:  # every position of the logits (selecting rows would copy them)
        scored = linear_logprobs(head.states[0].flatten(0, 1), None, fn, tokens_BT.flatten(),
                                 *(x.flatten(0, 1) for x in extra), chunk=chunk)
        outputs = [out.view(B, T, *out.shape[1:]) for out in scored]
    else:
        rows = (tokens_BT.flatten() != IGNORE_INDEX).nonzero().squeeze(1)

        def labelled_rows(hidden_BTD, weight_VD, vocab_group):
            return linear_logprobs(hidden_BTD.flatten(0, 1).index_select(0, rows), weight_VD, fn,
                                   tokens_BT.flatten()[rows], *(x.flatten(0, 1)[rows] for x in extra), chunk=chunk,
                                   vocab_group=vocab_group)

        outputs = [out.new_zeros(B * T, *out.shape[1:]).index_copy(0, rows, out).view(B, T, *out.shape[1:])
                   for out in apply_head(head.lm_head, labelled_rows, head.states[0])]
    outputs = iter(outputs)
    return TokenScores(next(outputs), next(outputs) if entropy else None, next(outputs) if extra else None,
                       *((next(outputs), next(outputs)) if top else ()))


def head_cross_entropy(hidden_BTD, weight_VD, vocab_group, targets_BT, chunk: int = LOGPROB_CHUNK):
    """The mean CE of `targets_BT` through lm_head (an `apply_head` op): pretraining's fused lm_head + CE
    (`linear_cross_entropy`), or on a vocabulary split over `vocab_group` (TP) the targets' log-probs by blocks of
    `chunk` rows (`linear_logprobs`, which the fused loss does not take). No target: a zero that still reaches the
    hidden states and the weight (their gradients zeros, as a sharded head's backward expects on every rank)."""
    if not (targets_BT != IGNORE_INDEX).any():
        return hidden_BTD.sum() * 0.0 + weight_VD.sum() * 0.0
    if vocab_group is None:
        return linear_cross_entropy(hidden_BTD.flatten(0, 1), weight_VD, targets_BT.flatten())
    rows = (targets_BT.flatten() != IGNORE_INDEX).nonzero().squeeze(1)
    logp, = linear_logprobs(hidden_BTD.flatten(0, 1).index_select(0, rows), weight_VD,
                            functools.partial(row_scores, temperature=1.0, top_k=0, top_p=1.0, entropy=False, top=0),
                            targets_BT.flatten()[rows], chunk=chunk, vocab_group=vocab_group)
    return -logp.mean()


class RolloutObjective:
    """What the objectives on rollouts (GRPO's, MOPD's) share: their config (`loss_config()`, `mtp_loss_weight`), the
    MTP depths trained (none with the MTP loss off), and the step's global counts that every micro-batch's loss is
    normalised by (`begin_step`: `row_counts(mb)` of each micro-batch, then each MTP depth's targets, summed over the
    step and, under torchrun, over the data-parallel ranks). `data_ranks`: the metrics every rank holds whole are
    divided by it, since the trainer sums the ranks' metrics. A micro-batch's loss is `loss_from_outputs` of the
    learner's forward with routing replay (`__call__`), or under PP of the last stage's outputs, lm_head's inputs
    (`as_head_outputs`; `stage_inputs`: what the stages read)."""

    def __init__(self, config, mtp_depths: int, parallel: Parallel | None = None):
        self.config, self.loss_config = config, config.loss_config()
        self.mtp_depths = mtp_depths if config.mtp_loss_weight > 0 else 0
        parallel = Parallel.single_process() if parallel is None else parallel  # built alone (tests): one process
        self.data_sum = parallel.sum_over_data
        self.data_ranks = parallel.layout.dp * parallel.layout.cp  # sum_over_data's
        self.counts: list[float] = []  # row_counts' values, then the MTP targets of each depth
        self.micro_batches = 1

    def row_counts(self, mb) -> list:
        raise NotImplementedError

    def begin_step(self, micro_batches) -> None:
        rows = [self.row_counts(mb) + [(mb.mtp_targets(d) != IGNORE_INDEX).sum()
                                       for d in range(1, self.mtp_depths + 1)] for mb in micro_batches]
        device = micro_batches[0].labels.device  # a collective's tensor lives on the run's device (NCCL: CUDA)
        counts = torch.tensor([[float(x) for x in row] for row in rows], dtype=torch.float64, device=device).sum(dim=0)
        self.counts = self.data_sum(counts).tolist()
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
        """The learner's forward on a micro-batch of rollouts, with routing replay: `HeadOutputs` (lm_head's inputs
        and weight, or the logits: `head_forward`), counts."""
        replay = mb.expert_ids if self.config.routing_replay else None
        head, out = head_forward(model, mb.input_ids, expert_ids=replay, mtp=self.mtp_depths > 0,
                                 following_ids=mb.following_ids, counted=mb.counted)
        return head, rollout_router_counts(model, out)

    def scores(self, head: HeadOutputs, mb, **wanted) -> TokenScores:
        """`token_scores` of the labels of `mb` from the learner's `HeadOutputs` (`forward`'s, `as_head_outputs`'s)
        at the rollouts' temperature and filter; `wanted`: entropy, given_ids."""
        cfg = self.config
        return token_scores(head, mb.labels, cfg.temperature, cfg.top_k, cfg.top_p,
                            chunk=cfg.logprob_chunk, **wanted)

    def mtp_losses(self, head: HeadOutputs, mb, depth_counts) -> list[torch.Tensor]:
        """Each trained MTP depth's masked CE on the completions, its share of the step's token mean over
        `depth_counts` (depth d's targets in the step, at index d - 1; `post.sft.sft_loss`): through lm_head a block
        of rows at a time where the module is given (`head_cross_entropy`), else on the depth's logits."""
        losses = []
        for depth, (state, count) in enumerate(zip(head.states[1:1 + self.mtp_depths], depth_counts), start=1):
            targets = mb.mtp_targets(depth)
            if head.lm_head is None:
                losses.append(sft_loss(state, targets, count))
                continue
            trained = int((targets != IGNORE_INDEX).sum())
            # applied even without a target here: every data rank must call an FSDP-sharded head as often as the
            # others, each call's backward reduce-scattering its weight's gradient
            losses.append(apply_head(head.lm_head, functools.partial(head_cross_entropy, targets_BT=targets,
                                                                  chunk=self.config.logprob_chunk), state)
                          * (trained / count if trained else 0.0))
        return losses

    def old_logprobs(self, model, mb):
        """The log-probs [B, L] of a micro-batch's labels under `model` as it stands, without a gradient: the old
        policy of the ratio when a rollout batch trains over several optimizer steps (`RolloutBatches`). The same
        forward as the learner's (routing replay, the rollout's temperature and filters), without the MTP depths."""
        with torch.no_grad():
            replay = mb.expert_ids if self.config.routing_replay else None
            head, _ = head_forward(model, mb.input_ids, expert_ids=replay, mtp=False,
                                   following_ids=mb.following_ids, counted=mb.counted)
            return self.scores(head, mb).logp

    def __call__(self, model, mb):
        outputs, counts = self.forward(model, mb)
        return self.loss_from_outputs(model, outputs, mb, counts)

    def objective_output(self, head: HeadOutputs, mb, policy_loss, metrics: dict, ranges: dict, depth_counts,
                         expert_counts=None) -> ObjectiveOutput:
        """A micro-batch's `ObjectiveOutput` from its policy loss: the loss adds the mean of the MTP depths' losses
        (`mtp_losses` over `depth_counts`) weighted by `mtp_loss_weight`; the metrics are the loss's and the policy
        loss's, then `metrics` (each already the micro-batch's share of the step's value), then the batch's rollout
        statistics; `ranges`: the step's extremes (`ObjectiveOutput.ranges`)."""
        mtp_losses = self.mtp_losses(head, mb, depth_counts)
        loss = policy_loss
        if mtp_losses:
            loss = loss + self.config.mtp_loss_weight * torch.stack(mtp_losses).mean()
        scale = self.micro_batches  # the trainer logs the mean over micro-batches of each metric
        metrics = {"loss": loss.detach() * scale, "policy_loss": policy_loss.detach() * scale, **metrics}
        metrics.update({key: torch.tensor(float(value) / self.data_ranks) for key, value in mb.stats.items()})
        return ObjectiveOutput(loss, metrics, int(mb.valid.sum()), expert_counts or {},
                               [m.detach() * scale for m in mtp_losses],
                               token_mean_shares([mb.mtp_targets(d) for d in range(1, len(mtp_losses) + 1)],
                                                 depth_counts, scale), ranges)
