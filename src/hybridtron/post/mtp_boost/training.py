"""MTP boosting's training: the self-conditioned chain through the model's own MTP block, the forward-KL loss, the
on-policy pool and the acceptance measurement (the recipe: `hybridtron.post.mtp_boost`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from hybridtron.config import ATTENTION
from hybridtron.infer.cache import HybridCache
from hybridtron.infer.engine import generate_tokens
from hybridtron.infer.sampling import SamplingParams
from hybridtron.infer.speculative import SpeculativeDecoder, check_drafter
from hybridtron.model.block import run_mixer
from hybridtron.model.state import KVCache
from hybridtron.post.mtp_boost import BoostConfig


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
    the anchor and the chain's."""

    def __init__(self):
        self.depth = 1
        self.real_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # by attention module
        self.chain_kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def __call__(self, kind, mixer, normed_BTH, layer_cache=None, lengths=None, expert_ids=None):
        if kind != ATTENTION:
            return run_mixer(kind, mixer, normed_BTH)
        q, k, v = mixer.project(normed_BTH)
        if self.depth == 1:
            self.real_kv[id(mixer)] = (k, v)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            chain = self.chain_kv.setdefault(id(mixer), [])
            chain.append((k, v))
            out = chain_attention(q, *self.real_kv[id(mixer)], chain)
        return mixer.o_proj(out.transpose(1, 2).flatten(-2))


def mtp_chain(model, input_ids_BT: torch.Tensor, hidden0_BTH: torch.Tensor, depths: int) -> list[torch.Tensor]:
    """The MTP block unrolled `depths` times over every anchor at once: [B, T, H] outputs per depth.

    Entry a of depth j reads token x_{a+j} (zero embedding past the end: those entries are never scored) and
    predicts x_{a+j+1}.
    """
    embeddings = model.backbone.embeddings(input_ids_BT)
    mixers = ChainAttention()
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
               depths: int, temperature: float = 2.0) -> tuple[torch.Tensor, list[float]]:
    """Mean over depths of T^2 * KL(backbone_T || mtp_T) over the anchors whose target exists; per-depth values."""
    length = input_ids_BT.shape[1]
    per_depth = []
    for depth, hidden in enumerate(mtp_chain(model, input_ids_BT, hidden0_BTH, depths), start=1):
        if depth >= length:
            break
        student = model.lm_head(hidden[:, :length - depth]).float() / temperature
        teacher = target_logits_BTV[:, depth:].float() / temperature
        kl = F.kl_div(F.log_softmax(student, -1), F.log_softmax(teacher, -1), log_target=True,
                      reduction="none").sum(-1).mean()
        per_depth.append(kl * temperature ** 2)
    loss = torch.stack(per_depth).mean()
    return loss, [float(v.detach()) for v in per_depth]


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


@dataclass
class BoostResult:
    acceptance_before: float
    acceptance_after: float
    losses: list[float]  # per step
    first_loss_per_depth: list[float]
    last_loss_per_depth: list[float]
    seconds: float


def boost_mtp(model, prompts: Sequence[Sequence[int]], eval_prompts: Sequence[Sequence[int]], config: BoostConfig,
              log=None) -> BoostResult:
    """Train `model.mtp` in place on on-policy samples from `prompts`; measure acceptance on `eval_prompts`."""
    check_drafter(model, config.draft_length)
    started = time.perf_counter()
    model.eval()  # no dropout anywhere; eval() only fixes the mode
    before = acceptance_length(model, eval_prompts, config.draft_length, config.eval_tokens)
    pool = on_policy_samples(model, prompts, config.num_samples, config.sample_length, config.sample_temperature,
                             config.seed)
    trainable = list(model.mtp.parameters())
    frozen = [p for name, p in model.named_parameters() if not name.startswith("mtp.")]
    flags = [p.requires_grad for p in frozen]
    for p in frozen:
        p.requires_grad_(False)
    optimizer = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=config.weight_decay)
    generator = torch.Generator().manual_seed(config.seed)
    losses, first, last = [], [], []
    try:
        for step in range(config.steps):
            rows = torch.randint(0, len(pool), (config.batch_size,), generator=generator)
            ids = pool[rows.to(pool.device)]
            with torch.no_grad():
                target = model(ids, mtp=False)
            loss, per_depth = boost_loss(model, ids, target.hidden, target.logits, config.depths,
                                         config.kl_temperature)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, config.grad_clip)
            optimizer.step()
            losses.append(float(loss.detach()))
            first = first or per_depth
            last = per_depth
            if log is not None and (step % max(1, config.steps // 10) == 0 or step == config.steps - 1):
                log(f"step {step + 1}/{config.steps}  loss {losses[-1]:.4f}  per depth "
                    + " ".join(f"{v:.3f}" for v in per_depth))
    finally:
        for p, flag in zip(frozen, flags):
            p.requires_grad_(flag)
    after = acceptance_length(model, eval_prompts, config.draft_length, config.eval_tokens)
    return BoostResult(before, after, losses, first, last, time.perf_counter() - started)
