"""MTP boosting's training pieces (the recipe: `hybridtron.post.mtp_boost`): the self-conditioned chain through the
model's own MTP block, the forward-KL loss, the on-policy pool and the acceptance measurement, and what the one
`Trainer` (hybridtron.train.loop) runs them as: `BoostObjective`, `PoolBatches` and `AcceptanceLength`."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from hybridtron.config import ATTENTION, MOE
from hybridtron.infer.cache import HybridCache
from hybridtron.infer.engine import generate_tokens
from hybridtron.infer.sampling import SamplingParams
from hybridtron.infer.speculative import SpeculativeDecoder
from hybridtron.model.block import run_mixer
from hybridtron.model.state import KVCache
from hybridtron.train.evaluate import Evaluator
from hybridtron.train.objectives import BatchSource, ObjectiveOutput, router_counts


# --------------------------------------------------------------------------------------------- the chain
def chain_attention(q_BHTD, real_k_BHTD, real_v_BHTD, chain_kv: list[tuple[torch.Tensor, torch.Tensor]]):
    """Attention of each anchor's depth-j query over the depth-1 entries at positions <= anchor and over its own
    chain's entries (one key per depth 2..j, per anchor). Keys and values have Hkv heads (grouped queries)."""
    heads, kv_heads, length, head_dim = q_BHTD.shape[1], real_k_BHTD.shape[1], q_BHTD.shape[2], q_BHTD.shape[3]
    repeat = heads // kv_heads
    expand = lambda t: t.repeat_interleave(repeat, dim=1)  # noqa: E731
    scale = head_dim ** -0.5
    real_scores = (q_BHTD @ expand(real_k_BHTD).transpose(-1, -2)).float() * scale  # [B, Hq, T, T]
    causal = torch.ones(length, length, dtype=torch.bool, device=q_BHTD.device).tril()
    real_scores = real_scores.masked_fill(~causal, float("-inf"))
    chain_scores = torch.stack([(q_BHTD * expand(k)).sum(-1).float() * scale for k, _ in chain_kv], -1)  # [.., J]
    weights = torch.softmax(torch.cat([real_scores, chain_scores], -1), -1).to(q_BHTD.dtype)
    out = weights[..., :length] @ expand(real_v_BHTD)
    for j, (_, v) in enumerate(chain_kv):
        out = out + weights[..., length + j, None] * expand(v)
    return out


class ChainAttention:
    """The MTP block's mixers for one depth of `mtp_chain` (a `mixer_fn` of `MTPBlock.forward`): attention layers
    attend as the drafter's cache lets them, every other mixer runs as it always does.

    Depth 1 is the training forward's causal attention; its keys and values are kept as the real entries. At depth
    j > 1 each layer's keys and values join the anchor's chain, and `chain_attention` reads the real entries up to
    the anchor and the chain's. The MoE layers' routing is counted over every depth (`routed`), as the training
    forward counts the MTP block's: the shared block routes once per depth."""

    def __init__(self):
        self.depth = 1
        self.real_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # by attention module
        self.chain_kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.routed: dict[int, torch.Tensor] = {}  # by MoE module: tokens per expert, summed over the depths

    def __call__(self, kind, mixer, normed_BTH, layer_cache=None, lengths=None, expert_ids=None, seq_idx=None):
        """`run_mixer`'s signature; the boosting pool's prompts are one document per row (`seq_idx` None)."""
        if kind != ATTENTION:
            out = run_mixer(kind, mixer, normed_BTH)
            if kind == MOE:
                counts = mixer.last_expert_counts
                self.routed[id(mixer)] = counts + self.routed[id(mixer)] if id(mixer) in self.routed else counts
            return out
        q, k, v = mixer.project(normed_BTH)
        if self.depth == 1:
            self.real_kv[id(mixer)] = (k, v)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            chain = self.chain_kv.setdefault(id(mixer), [])
            chain.append((k, v))
            out = chain_attention(q, *self.real_kv[id(mixer)], chain)
        return mixer.o_proj(out.transpose(1, 2).flatten(-2))

    def expert_counts(self, model) -> dict[str, torch.Tensor]:
        """The MTP block's routing over the chain, keyed by router name (`HybridLM.routers()`)."""
        return {name: self.routed[id(moe)] for name, moe in model.routers().items() if id(moe) in self.routed}


def mtp_chain(model, input_ids_BT: torch.Tensor, hidden0_BTH: torch.Tensor, depths: int,
              mixers: ChainAttention | None = None) -> list[torch.Tensor]:
    """The MTP block unrolled `depths` times over every anchor at once: [B, T, H] outputs per depth. `mixers`: the
    chain's mixers, to read their routing counts afterwards (default: fresh ones).

    Entry a of depth j reads token x_{a+j} (zero embedding past the end: those entries are never scored) and
    predicts x_{a+j+1}.
    """
    embeddings = model.backbone.embeddings(input_ids_BT)
    mixers = ChainAttention() if mixers is None else mixers
    previous, outputs = hidden0_BTH, []
    for depth in range(1, depths + 1):
        mixers.depth = depth
        next_embedding = F.pad(embeddings[:, depth:], (0, 0, 0, depth))
        previous = model.mtp(previous, next_embedding, mixer_fn=mixers)
        outputs.append(previous)
    return outputs


def mtp_chain_ref(model, input_ids_BT: torch.Tensor, hidden0_BTH: torch.Tensor, depths: int) -> list[torch.Tensor]:
    """The drafter's code path: every anchor is a row of one batch whose MTP cache holds the depth-1 entries of the
    positions before it; the block then runs one token per depth with that cache (`MTPBlock.forward`)."""
    batch, length = input_ids_BT.shape
    config = model.config
    outputs = [torch.zeros_like(hidden0_BTH) for _ in range(depths)]
    padded_ids = F.pad(input_ids_BT, (0, depths))  # tokens past the end: never scored
    anchors = torch.arange(length, device=input_ids_BT.device)
    for b in range(batch):
        mtp_config = config.replace(max_position_embeddings=max(config.max_position_embeddings, length + depths))
        cache = HybridCache.allocate(mtp_config, length, length + depths, dtype=hidden0_BTH.dtype,
                                     device=hidden0_BTH.device, kinds=config.mtp_layers_block_type)
        # depth-1 entries of all positions in every row (rows are identical), then each row cut at its anchor
        ids = padded_ids[b]
        real_next = model.backbone.embeddings(ids[1:length + 1])[None].expand(length, -1, -1)
        model.mtp(hidden0_BTH[b][None].expand(length, -1, -1), real_next, caches=cache.layers,
                  lengths=cache.lengths)
        cache.lengths.copy_(anchors)
        previous = hidden0_BTH[b][:, None]  # [T anchors, 1, H]
        for depth in range(1, depths + 1):
            # a fresh copy of the KV cache per forward: autograd needs the keys an earlier depth read unchanged
            for layer in cache.layers:
                if isinstance(layer, KVCache):
                    layer.k_BHTD, layer.v_BHTD = layer.k_BHTD.clone(), layer.v_BHTD.clone()
            next_embedding = model.backbone.embeddings(ids[anchors + depth])[:, None]
            previous = model.mtp(previous, next_embedding, caches=cache.layers, lengths=cache.lengths)
            cache.lengths += 1
            outputs[depth - 1][b] = previous[:, 0]
    return outputs


def boost_loss(model, input_ids_BT: torch.Tensor, hidden0_BTH: torch.Tensor, target_logits_BTV: torch.Tensor,
               depths: int, temperature: float = 2.0, mixers: ChainAttention | None = None
               ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Mean over depths of T^2 * KL(backbone_T || mtp_T) over the anchors whose target exists; each depth's value
    (detached). A depth past the rows' end (depth >= T) has no anchor: a zero with a zero gradient that keeps the
    divisor, as `model.lm`'s MTP loss does. `mixers`: as for `mtp_chain`."""
    length = input_ids_BT.shape[1]
    per_depth = []
    for depth, hidden in enumerate(mtp_chain(model, input_ids_BT, hidden0_BTH, depths, mixers), start=1):
        if depth >= length:
            per_depth.append(hidden.sum() * 0.0 + 0.0)
            continue
        student = model.lm_head(hidden[:, :length - depth]).float() / temperature
        teacher = target_logits_BTV[:, depth:].float() / temperature
        kl = F.kl_div(F.log_softmax(student, -1), F.log_softmax(teacher, -1), log_target=True,
                      reduction="none").sum(-1).mean()
        per_depth.append(kl * temperature ** 2)
    loss = torch.stack(per_depth).mean()
    return loss, [value.detach() for value in per_depth]


# ------------------------------------------------------------------------------------------ data and eval
def on_policy_samples(model, prompts: Sequence[Sequence[int]], count: int, length: int, temperature: float,
                      seed: int) -> torch.Tensor:
    """`count` sequences sampled from the model, `length` tokens after each prompt (prompts cycled), as one tensor:
    with prompts of different lengths every row keeps its last (shortest prompt + length) tokens, so the pool holds
    all of every completion and as much of each prompt as the shortest has."""
    chosen = [list(prompts[i % len(prompts)]) for i in range(count)]
    params = SamplingParams(temperature=temperature, max_tokens=length, seed=seed)
    rows = [p + g for p, g in zip(chosen, generate_tokens(model, chosen, params))]
    width = min(len(row) for row in rows)
    return torch.tensor([row[len(row) - width:] for row in rows], device=model.lm_head.weight.device)


def acceptance_length(model, prompts: Sequence[Sequence[int]], draft_length: int, max_tokens: int) -> float:
    """Mean acceptance length of greedy self-speculative decoding over `prompts` (accepted drafts + 1 per step)."""
    decoder = SpeculativeDecoder(model, prompts, SamplingParams(temperature=0, max_tokens=max_tokens),
                                 draft_length=draft_length)
    for _ in decoder:
        pass
    return decoder.stats.mean_acceptance_length


# --------------------------------------------------------------------------------------- on the Trainer
class BoostObjective:
    """The boosting loss of a micro-batch of pool rows: the backbone's forward (without gradients: it is frozen)
    gives the hidden states the chain starts from and the target distributions, `boost_loss` the KL of the chain.
    Each depth's KL is an MTP depth loss (`mtp_loss_<d>` in metrics.jsonl). The expert counts are the backbone's
    routing of the rows and the MTP block's over the chain (MaxVio; the run keeps every router's bias fixed). Every
    micro-batch weighs the same: the step's loss is their mean."""

    headline = ("loss", "kl")

    def __init__(self, depths: int, temperature: float):
        self.depths, self.temperature = depths, temperature
        self.micro_batches = 1

    def begin_step(self, micro_batches):
        self.micro_batches = len(micro_batches)

    def __call__(self, model, input_ids_BT):
        with torch.no_grad():
            target = model(input_ids_BT, mtp=False)
        mixers = ChainAttention()
        loss, per_depth = boost_loss(model, input_ids_BT, target.hidden, target.logits, self.depths,
                                     self.temperature, mixers)
        shares = [loss.new_tensor(float(depth < input_ids_BT.shape[1])) for depth in range(1, self.depths + 1)]
        return ObjectiveOutput(loss / self.micro_batches, {"loss": loss.detach()}, input_ids_BT.numel(),
                               {**router_counts(model, target), **mixers.expert_counts(model)}, per_depth, shares)


class PoolBatches(BatchSource):
    """Each step `micro_batches` micro-batches of `batch_size` rows of the pool, drawn with replacement by a
    generator seeded with `seed`. Its state is its position, the steps drawn so far: a resumed run seeds the
    generator again and draws as many, so it reads the rows the uninterrupted run would have read."""

    def __init__(self, pool_NL: torch.Tensor, batch_size: int, micro_batches: int, seed: int):
        self.pool, self.batch_size, self.micro_batches, self.seed = pool_NL, batch_size, micro_batches, seed
        self.generator = torch.Generator().manual_seed(seed)
        self.steps_drawn = 0

    def draw_rows(self) -> list[torch.Tensor]:
        self.steps_drawn += 1
        return [torch.randint(0, len(self.pool), (self.batch_size,), generator=self.generator)
                for _ in range(self.micro_batches)]

    def next_step(self):
        return [self.pool[rows.to(self.pool.device)] for rows in self.draw_rows()]

    def state_dict(self):
        return {"steps_drawn": self.steps_drawn}

    def load_state_dict(self, state):
        self.generator.manual_seed(self.seed)
        self.steps_drawn = 0
        while self.steps_drawn < state["steps_drawn"]:
            self.draw_rows()


class AcceptanceLength(Evaluator):
    """`acceptance_length`: the mean acceptance length of greedy self-speculative decoding with the model's MTP
    block drafting `draft_length` tokens, `max_tokens` generated for each of fixed `prompts`."""

    key = "acceptance_length"

    def __init__(self, prompts: Sequence[Sequence[int]], draft_length: int, max_tokens: int, every: int):
        super().__init__()
        self.prompts, self.draft_length, self.max_tokens, self.every = prompts, draft_length, max_tokens, every

    def evaluate(self, trainer) -> dict[str, float]:
        model = trainer.model
        was_training = model.training
        model.eval()
        try:
            value = acceptance_length(model, self.prompts, self.draft_length, self.max_tokens)
        finally:
            model.train(was_training)
        self.history.append((trainer.step, value))
        return {self.key: value}
