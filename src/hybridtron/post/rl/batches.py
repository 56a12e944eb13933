"""The learner's end of the rollouts (hybridtron.post.rl.rollout): each rollout batch (`RolloutBatch`) as the
trainer's micro-batches, one optimizer step's or, cut into mini-batches, several steps', and the batch source that
keeps the role pipeline fed.

`RolloutBatches` keeps the pipeline `staleness + 1` rollout batches ahead and hands the learner's weights to the
rollout role after the last optimizer step of each rollout batch (`sync_weights`, which the trainer calls after
every step: hybridtron.train.loop), each time followed by the next request (hybridtron.post.rl.roles): batch n is
generated with the weights after the last step of batch max(0, n - 1 - staleness). Staleness 0 is synchronous RL:
batch n + 1 is sampled after batch n's updates. Staleness 1 is Ultra's one-step off-policy mode: batch n + 1 is
sampled (in the rollout process) while batch n trains, with the weights batch n started from. With one step a
rollout batch (the default) a batch is a step.

Micro-batches (`RolloutMicroBatch`): rows of prompt + completion, right-padded, with the labels, the engine's
log-probs, the advantages, the experts to replay and the scoring roles' per-token scores laid out beside them;
under torchrun each rank's rows (and under context parallelism its chunks of their positions).

Shapes: B rows (rollouts), L positions (prompt + completion - 1), C completion tokens, K experts per token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from hybridtron.distributed.context_parallel import chunk_rows, chunk_rows_ahead, shard_sequence
from hybridtron.distributed.mesh import Parallel
from hybridtron.distributed.step import full_state_dict
from hybridtron.ops.cross_entropy import IGNORE_INDEX
from hybridtron.post.rl.roles import RolePipeline
from hybridtron.post.rl.rollout import ROLLOUT_ROLE, Rollout, RolloutBatch, RolloutRequest
from hybridtron.train.objectives import BatchSource, router_counts, window_targets

# ------------------------------------------------------------------------------------------- packing
@dataclass
class RolloutMicroBatch:
    """Rows of prompt + completion for the learner's forward, right-padded to the longest row.

    input_ids [B, L]: prompt + completion[:-1]; labels [B, L]: the completion token each position predicts,
    IGNORE_INDEX on the prompt, the padding and a trajectory's tokens not sampled by the model
    (`Rollout.completion_mask`: tool responses); rollout_logprobs [B, L] beside them (0 elsewhere); advantages [B];
    trained [B]: False for rows of groups whose rewards all agree (they carry no signal and are kept out of the
    policy loss); valid [B, L]: not padding; expert_ids {router: [B, L, K]} (padding: experts 0..K-1); scores
    {name: [B, L, ...]}; stats: the batch's rollout statistics (the same for every micro-batch of the step); domains:
    each row's task domain (per-domain metrics: MOPD's reverse KL to each domain's teacher). Under context
    parallelism a micro-batch is one share of the rows' positions (`share`): following_ids, following_labels and
    following_valid [B, <= D] are the ids, labels and validity after it, which the MTP depths at its last positions
    read and are scored against (None for whole rows). old_logprobs: with several optimizer steps a rollout batch,
    the log-probs of the labels under the learner before the batch's first update (`RolloutBatches`), the old
    policy of the PPO ratio; None: the learner's own at this step (one step a batch: old = current)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    trained: torch.Tensor
    valid: torch.Tensor
    expert_ids: dict[str, torch.Tensor] | None
    scores: dict[str, torch.Tensor]
    stats: dict[str, float]
    domains: list[str] = field(default_factory=list)
    following_ids: torch.Tensor | None = None
    following_labels: torch.Tensor | None = None
    following_valid: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None  # [B, L]: the learner's before its rollout batch's first update

    @property
    def completion_mask(self) -> torch.Tensor:
        return self.labels != IGNORE_INDEX

    @property
    def counted(self) -> torch.Tensor:
        """The real positions, and under CP those after the share: the learner's expert counts leave out the
        padding, whose amount depends on how rows were batched and sharded (`HybridLM.forward(counted=...)`)."""
        return self.valid if self.following_valid is None else torch.cat([self.valid, self.following_valid], dim=1)

    def mtp_targets(self, depth: int) -> torch.Tensor:
        """MTP depth `depth`'s targets [B, L] (`hybridtron.model.lm.mtp_targets`), a share's last ones completed by
        the labels after it."""
        labels = self.labels if self.following_labels is None else torch.cat([self.labels, self.following_labels], 1)
        return window_targets(labels, depth, self.labels.shape[1])

    @property
    def policy_mask(self) -> torch.Tensor:
        """The tokens of the policy loss: completion tokens of informative groups."""
        return self.completion_mask & self.trained.unsqueeze(1)

    def padded(self, rows: int, length: int, pad_id: int = 0) -> "RolloutMicroBatch":
        """This micro-batch with padding rows and positions appended up to [rows, length]: padding is no
        completion token and not valid, so it adds nothing to any loss, count or metric."""
        B, L = self.input_ids.shape
        if (rows, length) == (B, L):
            return self

        def grown(tensor, fill):
            out = torch.full((rows, length, *tensor.shape[2:]), fill, dtype=tensor.dtype)
            out[:B, :L] = tensor
            return out

        expert_ids = None
        if self.expert_ids is not None:  # padding routes to experts 0..K-1, as rollout_rows pads
            expert_ids = {}
            for name, ids in self.expert_ids.items():
                full = torch.arange(ids.shape[-1]).expand(rows, length, ids.shape[-1]).clone()
                full[:B, :L] = ids
                expert_ids[name] = full
        advantages, trained = torch.zeros(rows), torch.zeros(rows, dtype=torch.bool)
        advantages[:B], trained[:B] = self.advantages, self.trained
        return RolloutMicroBatch(
            input_ids=grown(self.input_ids, pad_id), labels=grown(self.labels, IGNORE_INDEX),
            rollout_logprobs=grown(self.rollout_logprobs, 0.0), advantages=advantages, trained=trained,
            valid=grown(self.valid, False), expert_ids=expert_ids,
            scores={name: grown(value, 0.0) for name, value in self.scores.items()}, stats=self.stats,
            domains=self.domains + [""] * (rows - B))

    def rows(self, start: int, stop: int, device=None) -> "RolloutMicroBatch":
        """Rows [start, stop) (a data-parallel rank's share), on `device`."""
        def take(tensor):
            return tensor[start:stop].to(device)

        return RolloutMicroBatch(
            input_ids=take(self.input_ids), labels=take(self.labels), rollout_logprobs=take(self.rollout_logprobs),
            advantages=take(self.advantages), trained=take(self.trained), valid=take(self.valid),
            expert_ids=None if self.expert_ids is None else {k: take(v) for k, v in self.expert_ids.items()},
            scores={k: take(v) for k, v in self.scores.items()}, stats=self.stats, domains=self.domains[start:stop])


    def share(self, rank: int, size: int, lookahead: int) -> "RolloutMicroBatch":
        """Cp rank `rank` of `size`'s part of every row (context parallelism: its head and tail chunks of the row's
        positions as two rows, `hybridtron.distributed.context_parallel.shard_sequence`), with the `lookahead` ids and
        labels after each chunk. A row's own values (advantage, trained, domain) go with both its chunks."""
        input_ids, labels_ahead, following_ids = shard_sequence(self.input_ids, self.labels, rank, size, lookahead)
        length = input_ids.shape[1]
        valid_ahead = chunk_rows_ahead(self.valid, rank, size, lookahead, False)

        def cut(tensor):
            return chunk_rows(tensor, rank, size)

        return RolloutMicroBatch(
            input_ids=input_ids, labels=labels_ahead[:, :length], rollout_logprobs=cut(self.rollout_logprobs),
            advantages=self.advantages.repeat_interleave(2), trained=self.trained.repeat_interleave(2),
            valid=valid_ahead[:, :length], expert_ids=None if self.expert_ids is None else
            {k: cut(v) for k, v in self.expert_ids.items()},
            scores={k: cut(v) for k, v in self.scores.items()}, stats=self.stats,
            domains=[domain for domain in self.domains for _ in range(2)],
            following_ids=following_ids, following_labels=labels_ahead[:, length:],
            following_valid=valid_ahead[:, length:])


def sharded_length(length: int, cp: int, tp: int, min_chunk: int) -> int:
    """The positions a micro-batch of `length` is padded to so that it splits over tp, and under CP into the 2 x cp
    head-and-tail chunks of `dist.context_parallel` (each cut into tp sequence shards), each chunk at least
    `min_chunk` long (the Mamba conv reads the previous chunk's last inputs)."""
    if cp == 1:
        return -(-length // tp) * tp
    split = 2 * cp * tp
    return -(-max(length, 2 * cp * min_chunk) // split) * split


def shard_micro_batch(mb: RolloutMicroBatch, parallel, pad_id: int = 0, *, lookahead: int = 0,
                      min_chunk: int = 1) -> RolloutMicroBatch:
    """This rank's part of a micro-batch: padded to whole rows per data-parallel rank and to `sharded_length`
    positions (the layout check's rules for cp and tp; each CP chunk at least `min_chunk` long), then this
    data-parallel rank's rows, and under CP its chunks of their positions with the `lookahead` (the
    model's MTP depths) ids and labels after it. Padding at the end of a row changes nothing before it."""
    ranks, tp, cp = parallel.layout.dp, parallel.layout.tp, parallel.layout.cp
    B, L = mb.input_ids.shape
    per_rank = -(-B // ranks)
    mb = mb.padded(per_rank * ranks, sharded_length(L, cp, tp, min_chunk), pad_id)
    start = parallel.data_rank * per_rank
    mb = mb.rows(start, start + per_rank, parallel.device)
    return mb.share(parallel.coordinate("cp"), cp, lookahead) if cp > 1 else mb


def pack_micro_batches(batch: RolloutBatch, micro_batches: int, pad_id: int = 0,
                       rows: tuple[int, int] | None = None) -> list[RolloutMicroBatch]:
    """Split a step's rollouts (those of `rows` [start, stop), a mini-batch; default: all) into `micro_batches`
    micro-batches of (nearly) equal row counts (fewer if there are fewer rows), rows sorted by length so that each
    micro-batch pads little; the losses are sums over tokens, so the order changes nothing but the padding. A group
    is informative (its rows `trained`) when its rewards do not all agree, whichever mini-batch holds them."""
    rollouts = batch.rollouts
    if not rollouts:
        raise ValueError(f"rollout batch {batch.index} holds no rollouts")
    G = batch.group_size
    trained = []
    for start in range(0, len(rollouts), G):
        group = rollouts[start:start + G]
        trained += [len({r.reward for r in group}) > 1] * len(group)
    if rows is not None:
        rollouts, trained = rollouts[rows[0]:rows[1]], trained[rows[0]:rows[1]]
    order = sorted(range(len(rollouts)), key=lambda i: len(rollouts[i].prompt_ids) + len(rollouts[i].completion_ids))
    rollouts, trained = [rollouts[i] for i in order], [trained[i] for i in order]
    count = min(micro_batches, len(rollouts))
    bounds = [round(i * len(rollouts) / count) for i in range(count + 1)]
    return [rollout_rows(rollouts[a:b], pad_id, trained[a:b], batch.stats) for a, b in zip(bounds, bounds[1:])]


def uniform_micro_batches(micro_batches: list[RolloutMicroBatch], count: int, pad_id: int = 0
                          ) -> list[RolloutMicroBatch]:
    """`count` micro-batches of one shape, for a pipeline schedule (its stages exchange fixed-shape activations, and
    it runs a fixed number of micro-batches): each padded to the most rows and positions of any, and empty ones (all
    padding) appended. Padding adds nothing to any loss, count or metric, so the step is the same."""
    rows = max(mb.input_ids.shape[0] for mb in micro_batches)
    length = max(mb.input_ids.shape[1] for mb in micro_batches)
    empty = micro_batches[0].rows(0, 0)
    return [mb.padded(rows, length, pad_id) for mb in micro_batches] + \
        [empty.padded(rows, length, pad_id) for _ in range(count - len(micro_batches))]


def rollout_rows(rollouts: list[Rollout], pad_id: int = 0, trained: list[bool] | None = None,
                 stats: dict | None = None) -> RolloutMicroBatch:
    """One micro-batch of `rollouts` (see RolloutMicroBatch; `trained` default: every row)."""
    lengths = [len(r.prompt_ids) + len(r.completion_ids) - 1 for r in rollouts]
    B, L = len(rollouts), max(lengths)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    labels = torch.full((B, L), IGNORE_INDEX, dtype=torch.long)
    rollout_logprobs = torch.zeros(B, L, dtype=torch.float32)
    valid = torch.zeros(B, L, dtype=torch.bool)
    first = rollouts[0].scores
    names = sorted(first)
    scores = {name: torch.zeros(B, L, *first[name].shape[1:], dtype=first[name].dtype) for name in names}
    replay = rollouts[0].expert_ids is not None
    expert_ids = None
    if replay:
        k = next(iter(rollouts[0].expert_ids.values())).shape[-1]
        expert_ids = {name: torch.arange(k).expand(B, L, k).clone() for name in rollouts[0].expert_ids}
    for b, r in enumerate(rollouts):
        P, C = len(r.prompt_ids), len(r.completion_ids)
        if C == 0:
            raise ValueError(f"rollout of task {r.task_id} has an empty completion (max_new_tokens must be >= 1)")
        full = torch.tensor(r.prompt_ids + r.completion_ids, dtype=torch.long)
        input_ids[b, :P + C - 1] = full[:-1]
        labels[b, P - 1:P + C - 1] = full[P:] if r.completion_mask is None else \
            full[P:].masked_fill(~r.completion_mask, IGNORE_INDEX)  # a trajectory's tool responses: not trained
        rollout_logprobs[b, P - 1:P + C - 1] = r.logprobs
        valid[b, :P + C - 1] = True
        for name in names:
            scores[name][b, P - 1:P + C - 1] = r.scores[name]
        if replay:
            for name, ids in r.expert_ids.items():
                expert_ids[name][b, :P + C - 1] = ids.long()
    return RolloutMicroBatch(
        input_ids=input_ids, labels=labels, rollout_logprobs=rollout_logprobs,
        advantages=torch.tensor([r.advantage for r in rollouts], dtype=torch.float32),
        trained=torch.tensor([True] * B if trained is None else trained, dtype=torch.bool), valid=valid,
        expert_ids=expert_ids, scores=scores, stats=dict(stats or {}), domains=[r.domain for r in rollouts])


def rollout_router_counts(model, out) -> dict[str, torch.Tensor]:
    """The expert counts of a learner forward on rollouts (`ObjectiveOutput.counts`; the forward counted the real
    tokens only, `HybridLM.forward(counted=valid)`); the MTP block's routers, when the MTP loss did not run them,
    count none."""
    counts = router_counts(model, out)
    for name, moe in model.routers().items():
        counts.setdefault(name, torch.zeros(moe.gate.num_experts, dtype=torch.long))
    return counts


# ------------------------------------------------------------------------------------ the learner's end
class RolloutBatches(BatchSource):
    """The learner's end of the rollout pipeline: the trainer's batch source (hybridtron.train.objectives), each
    optimizer step's rollouts split into `grad_accum` micro-batches (fewer if the step has fewer rows).

    `pipeline`: builds a `RolePipeline` whose first role is the rollout role (more roles may follow it: scoring
    roles that add `Rollout.scores`). The trainer hands over the learner's weights after every optimizer step
    (`sync_weights`, step 9 of hybridtron.train.loop): at the end of a rollout batch they go to the rollout role,
    followed by the next requests (none past the run's last step). `mtp_depths` and `min_chunk` (the model's MTP
    depths and its causal conv width - 1): how a sharded learner's rows are cut under context parallelism.

    Mini-batches (`mini_batches` x `epochs` > 1 optimizer steps a rollout batch: the RL section's `global_batch`
    and `epochs`): a rollout batch is cut in order into `mini_batches` mini-batches of (nearly) equal rows, one
    optimizer step each, and trained `epochs` times over in the same order. Before the first of those steps,
    `old_logprobs` (a no-grad forward of the learner: `RolloutObjective.old_logprobs`) gives every micro-batch its
    log-probs under the learner as it stands, and they stay fixed for all of the batch's steps: the old policy of
    the PPO ratio, which the first step matches and from which every later step has moved. The weights go to the
    rollout role once a rollout batch, after its last step (as miles and verl update the rollout engine once per
    rollout batch), so the staleness bound counts rollout batches.

    `parallel` (a sharded learner under torchrun, hybridtron.distributed): each rank trains on its data-parallel rows of
    every micro-batch (`shard_micro_batch`), so the step is the one a single process takes. With `shared` (inline
    roles, built with a `WorkShare`) every rank runs the pipeline on the full weights, which every rank gathers
    (`dist.step.full_state_dict`), each generating and scoring its share of the step's rollouts, and every rank
    ends with the whole batch. Otherwise (roles in processes or Ray actors) the pipeline runs on global rank 0
    alone, with the full weights gathered there, and rank 0 broadcasts the step's batch.

    The protocol (see the module docstring): after the last step of rollout batch n - 1 (before batch n is taken)
    the weights go to the rollout role, followed by the request for batch n + staleness; so batch m is always
    sampled with the weights after the last step of batch max(0, m - 1 - staleness), whatever the speed of either
    side. With one step a batch that is step max(0, m - 1 - staleness).

    State (`state_dict`, at a step boundary): the batches consumed, the next `staleness` batches (waited for:
    they were sampled with weights the checkpoint does not hold), the role states after the last of them, and, in
    the middle of a rollout batch, that batch, the steps taken of it and every rank's old log-probs (the weights
    that computed them are gone), so a resumed run consumes exactly the batches the uninterrupted run would have,
    against the same old policy. After a rollback (the monitor restoring an older checkpoint) the run reads on with
    those prefetched batches (and the rest of the current one), sampled by the abandoned policy; the IS correction
    weights them as it does any stale batch."""

    def __init__(self, pipeline: Callable[[], RolePipeline], *, staleness: int, grad_accum: int, pad_id: int = 0,
                 parallel=None, shared: bool = False, mtp_depths: int = 0, min_chunk: int = 1,
                 mini_batches: int = 1, epochs: int = 1,
                 old_logprobs: Callable[[list[RolloutMicroBatch]], list[torch.Tensor]] | None = None):
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        if mini_batches < 1 or epochs < 1:
            raise ValueError(f"mini_batches and epochs must be >= 1, got {mini_batches} and {epochs}")
        # built without a learner's context (tests): the learner is one process, a world of one
        self.parallel = Parallel.single_process() if parallel is None else parallel
        self.make_pipeline = pipeline
        self.mtp_depths, self.min_chunk = mtp_depths, min_chunk  # how a sharded learner's rows are cut (lookahead)
        self.shared = shared
        self.drives_pipeline = self.parallel.is_main or self.shared
        self.staleness, self.grad_accum, self.pad_id = staleness, grad_accum, pad_id
        self.mini_batches, self.epochs = mini_batches, epochs
        self.steps_per_rollout = mini_batches * epochs
        if self.steps_per_rollout > 1 and old_logprobs is None:
            raise ValueError("several optimizer steps a rollout batch need old_logprobs (the learner's log-probs "
                             "before the batch's first update)")
        self.old_logprobs = old_logprobs
        self.pipeline: RolePipeline | None = None
        self.consumed = 0  # rollout batches the learner has taken (= its step / steps_per_rollout, barring rollbacks)
        self.requested = 0  # the highest batch index requested from the pipeline
        self.prefetched: list[RolloutBatch] = []  # received, not yet consumed
        self.role_states: dict[str, dict] | None = None  # after the last batch received
        self.last_wait_s = 0.0
        # the rollout batch being trained: the steps taken of it, its micro-batches per mini-batch (this rank's)
        # and their old log-probs (None with one step a batch)
        self.current: RolloutBatch | None = None
        self.taken = 0
        self.steps: list[list[RolloutMicroBatch]] = []
        self.current_old: list[list[torch.Tensor]] | None = None

    # ------------------------------------------------------------------------------------------ protocol
    def _start(self) -> None:
        self.pipeline = self.make_pipeline().start()
        if self.role_states:
            for role, state in self.role_states.items():
                if state:
                    self.pipeline.send_state(role, state)
        self.requested = self.consumed + len(self.prefetched)

    @property
    def mid_batch(self) -> bool:
        """Whether steps of the current rollout batch remain."""
        return self.current is not None and self.taken < self.steps_per_rollout

    def sync_weights(self, model, version: int, total_steps: int) -> None:
        """The trainer's call after optimizer step `version` (and at the start): at the end of a rollout batch, the
        weights go to the rollout role, followed by the requests up to batch `version / steps_per_rollout + 1 +
        staleness` (none past the run's last step). Every rank joins the gathering of a sharded model. In the middle
        of a rollout batch it does nothing: the rollout role keeps the weights it was given at the batch's start."""
        if self.mid_batch:
            return
        # every rank gathers; rank 0 holds the result, or every rank when each samples its share (in one process:
        # the model's own tensors)
        weights = full_state_dict(model, self.parallel, everywhere=self.shared)
        if not self.drives_pipeline:
            return
        if self.pipeline is None:
            self._start()
        self.pipeline.send_weights(ROLLOUT_ROLE, version, weights)
        batches, total_batches = version // self.steps_per_rollout, -(-total_steps // self.steps_per_rollout)
        last = min(batches + 1 + self.staleness, max(total_batches, batches + 1))
        while self.requested < last:
            self.requested += 1
            self.pipeline.submit(RolloutRequest(self.requested))

    def next_step(self) -> list[RolloutMicroBatch]:
        if not self.mid_batch:
            self._begin(self._take())
        micro_batches = self.steps[self.taken % self.mini_batches]
        if self.steps_per_rollout > 1:  # the batch's later steps waited for nothing
            for mb in micro_batches:
                mb.stats.update(rollout_wait_s=self.last_wait_s if self.taken == 0 else 0.0,
                                rollout_step=float(self.taken))
        self.taken += 1
        return micro_batches

    def _take(self) -> RolloutBatch:
        """The next rollout batch, with its wait and staleness (in rollout batches) in its stats."""
        started = time.perf_counter()
        batch = None
        if self.drives_pipeline:
            batch = self.prefetched.pop(0) if self.prefetched else self._receive()
        if not self.shared:
            batch = self.parallel.broadcast_object(batch)
        self.last_wait_s = time.perf_counter() - started
        assert batch.index == self.consumed + 1, f"batch {batch.index} arrived for rollout batch {self.consumed + 1}"
        self.consumed += 1
        batch.stats = {**batch.stats, "rollout_wait_s": self.last_wait_s,
                       "policy_staleness": float(batch.index - 1 - batch.policy_version / self.steps_per_rollout)}
        return batch

    def _begin(self, batch: RolloutBatch, old: list[list[torch.Tensor]] | None = None) -> None:
        """Make `batch` the current rollout batch: its micro-batches per mini-batch and, with several steps a batch,
        their old log-probs (`old`, from a checkpoint, or now from the learner, every rank joining the forward)."""
        self.current, self.taken = batch, 0
        rows, count = len(batch.rollouts), self.mini_batches
        if rows < count:
            raise ValueError(f"rollout batch {batch.index} holds {rows} rollouts, fewer than its {count} "
                             "mini-batches (global_batch)")
        bounds = [round(i * rows / count) for i in range(count + 1)]
        self.steps = [self._micro_batches(batch, span) for span in zip(bounds, bounds[1:])]
        if self.steps_per_rollout > 1:
            if old is None:
                old = [[logp.detach() for logp in self.old_logprobs(mbs)] for mbs in self.steps]
            for mbs, values in zip(self.steps, old):
                for mb, logp in zip(mbs, values):
                    mb.old_logprobs = logp.to(mb.labels.device)
        self.current_old = old

    def _micro_batches(self, batch: RolloutBatch, rows: tuple[int, int]) -> list[RolloutMicroBatch]:
        micro_batches = pack_micro_batches(batch, self.grad_accum, self.pad_id, rows)
        if self.parallel.layout.pp > 1:
            micro_batches = uniform_micro_batches(micro_batches, self.grad_accum, self.pad_id)
        return [shard_micro_batch(mb, self.parallel, self.pad_id, lookahead=self.mtp_depths,
                                  min_chunk=self.min_chunk) for mb in micro_batches]

    def _receive(self) -> RolloutBatch:
        delivery = self.pipeline.receive()
        self.role_states = delivery.states
        return delivery.item

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()
            self.pipeline = None

    # --------------------------------------------------------------------------------------------- state
    def _ranks(self) -> str:
        """Who holds which old log-probs: the layout of the learner's ranks."""
        return "one process" if self.parallel.world == 1 else f"{self.parallel.world} processes, layout " \
                                                                f"{self.parallel.layout}"

    def state_dict(self) -> dict:
        """(Under torchrun the checkpoint keeps global rank 0's, which drives the pipeline; with `shared`, every
        rank's is the same. In the middle of a rollout batch every rank joins: its old log-probs are gathered.)"""
        if self.pipeline is not None:  # wait for the batches sampled with weights older than the checkpoint's
            wanted = min(self.consumed + self.staleness, self.requested)
            while self.consumed + len(self.prefetched) < wanted:
                self.prefetched.append(self._receive())
        state = {"consumed": self.consumed, "prefetched": list(self.prefetched), "role_states": self.role_states}
        if self.mid_batch:
            old = None
            if self.current_old is not None:
                old = self.parallel.gather_objects([[logp.cpu() for logp in mbs] for mbs in self.current_old])
            state["current"] = {"batch": self.current, "taken": self.taken, "old_logprobs": old,
                                "ranks": self._ranks()}
        return state

    def load_state_dict(self, state: dict) -> None:
        self.close()  # a resume or a rollback: the roles restart from the state's point
        self.consumed = state["consumed"]
        if self.drives_pipeline:
            self.prefetched = list(state["prefetched"])
            self.role_states = state["role_states"]
        self.current, self.taken, self.steps, self.current_old = None, 0, [], None
        current = state.get("current")
        if current is not None:
            old = current["old_logprobs"]
            if old is not None:
                if current["ranks"] != self._ranks():
                    raise ValueError(f"the checkpoint was saved between two optimizer steps of rollout batch "
                                     f"{current['batch'].index} by {current['ranks']}, which hold its old log-probs; "
                                     f"resume it the same way ({self._ranks()} now), or from a checkpoint at the "
                                     f"end of a rollout batch")
                old = old[self.parallel.rank]
            self._begin(current["batch"], old)
            self.taken = current["taken"]


def rollout_pipeline_factory(specs: Sequence, backend: str, staleness: int, timeout_s: float = 3600.0
                             ) -> Callable[[], RolePipeline]:
    """A function building the pipeline of `specs` (rollout role first) on `backend`, its queues sized for
    `staleness + 1` batches in flight plus the weights sent before each."""
    capacity = 2 * (staleness + 2)

    def build() -> RolePipeline:
        return RolePipeline(list(specs), backend, capacity=capacity, timeout_s=timeout_s)

    return build
