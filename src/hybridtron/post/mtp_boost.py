"""MTP boosting: train only the MTP block, so that its drafts agree with the backbone more often.

The recipe (the Nemotron 3 Ultra report, the last post-training stage; SPEC-algorithms.md):

- Backbone, embedding and lm_head frozen; only the MTP block's weights train.
- Loss: forward KL from the backbone's next-token distribution to the block's, both at temperature T = 2, scaled
  by T^2 (distillation's usual factor, which keeps the gradient's size independent of T); no gold-token CE.
- Self-conditioned inputs: the block is unrolled for `depths` steps (7 in the report) exactly as the drafter runs
  it. Depth 1 at anchor a reads the backbone's hidden state h_a and the token x_{a+1}; depth j > 1 reads the
  block's own output of depth j-1 and the token x_{a+j}, and predicts x_{a+j+1}, whose target is the backbone's
  distribution at position a+j. Its attention sees the depth-1 entries of positions 0..a and the chain's own
  entries of depths 2..j, the same keys the drafter's cache holds (`hybridtron.infer.speculative`).
- Data: on-policy samples of the model itself at temperature 1 (the backbone is frozen, so a pool drawn once stays
  on-policy).
- Departure from the report: the tokens fed at depths > 1 are the sample's (teacher forcing), not the drafter's own
  draft tokens; under greedy verification only drafts equal to the target's tokens matter, and the sample's tokens
  are what the target produced.

`mtp_chain` computes every anchor's chain in parallel, one depth at a time; `mtp_chain_ref` runs the drafter's own
cached code path (`MTPBlock.forward` with a KV cache), one position per depth, and is the reference it is tested
against. Acceptance is measured with greedy self-speculative decoding on fixed prompts, before and after.

`hybridtron mtp-boost --model DIR [--steps N --lr LR --out DIR]` writes the boosted checkpoint (and tokenizer.json).

Shapes: B batch, T time (anchors), H hidden, V vocabulary, Hq / Hkv query / key-value heads, D head dim.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from hybridtron.checkpoint import load_pretrained, save_pretrained
from hybridtron.data.chat import TOKENIZER_FILES
from hybridtron.config import ATTENTION
from hybridtron.infer.cache import HybridCache, KVCache
from hybridtron.infer.generate import generate
from hybridtron.infer.sampling import SamplingParams
from hybridtron.infer.speculative import SpeculativeDecoder, check_drafter
from hybridtron.model.block import run_mixer


@dataclass(frozen=True, kw_only=True)
class BoostConfig:
    """steps / lr / batch_size: the AdamW run over the MTP block. depths: self-conditioned depths unrolled (7 in
    the report). kl_temperature: T of the KL (2 in the report). num_samples x sample_length: the on-policy pool,
    sampled at sample_temperature from `prompts`. draft_length / eval_tokens: the greedy acceptance measurement."""

    steps: int = 200
    lr: float = 3e-4
    batch_size: int = 8
    depths: int = 7
    kl_temperature: float = 2.0
    num_samples: int = 256
    sample_length: int = 64
    sample_temperature: float = 1.0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    draft_length: int = 7
    eval_tokens: int = 64
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "batch_size", "depths", "num_samples", "sample_length", "draft_length", "eval_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("lr", "kl_temperature", "sample_temperature", "grad_clip"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")


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


def mtp_chain(model, input_ids_BT: torch.Tensor, hidden0_BTH: torch.Tensor, depths: int) -> list[torch.Tensor]:
    """The MTP block unrolled `depths` times over every anchor at once: [B, T, H] outputs per depth.

    Entry a of depth j reads token x_{a+j} (zero embedding past the end: those entries are never scored) and
    predicts x_{a+j+1}.
    """
    mtp = model.mtp
    first = mtp.layers[0]
    embeddings = model.backbone.embeddings(input_ids_BT)
    real_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    chain_kv: dict[int, list] = {i: [] for i, layer in enumerate(mtp.layers) if layer.kind == ATTENTION}
    previous, outputs = hidden0_BTH, []
    for depth in range(1, depths + 1):
        next_embedding = F.pad(embeddings[:, depth:], (0, 0, 0, depth))
        u = first.eh_proj(torch.cat([first.enorm(next_embedding), first.hnorm(previous)], dim=-1))
        for i, layer in enumerate(mtp.layers):
            normed = layer.norm(u)
            if layer.kind != ATTENTION:
                u = u + run_mixer(layer.kind, layer.mixer, normed)
                continue
            attention = layer.mixer
            q, k, v = attention.project(normed)
            if depth == 1:
                real_kv[i] = (k, v)
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            else:
                chain_kv[i].append((k, v))
                out = chain_attention(q, *real_kv[i], chain_kv[i])
            u = u + attention.o_proj(out.transpose(1, 2).flatten(-2))
        previous = mtp.layers[-1].final_layernorm(u)
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
    """`count` sequences [count, prompt + length] sampled from the model (prompts cycled, all of one length)."""
    lengths = {len(p) for p in prompts}
    if len(lengths) != 1:
        raise ValueError(f"on-policy prompts must all have the same length, got lengths {sorted(lengths)}")
    chosen = [list(prompts[i % len(prompts)]) for i in range(count)]
    params = SamplingParams(temperature=temperature, max_tokens=length, seed=seed)
    generated = generate(model, chosen, params)
    return torch.tensor([p + g for p, g in zip(chosen, generated)], device=model.lm_head.weight.device)


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


# ------------------------------------------------------------------------------------------------ command
def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = BoostConfig()
    parser.add_argument("--model", required=True,
                        help="checkpoint directory (config.json, safetensors, tokenizer.json)")
    parser.add_argument("--out", default=None,
                        help="where to write the boosted checkpoint (default: MODEL-mtp-boosted)")
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--depths", type=int, default=defaults.depths, help="self-conditioned depths unrolled")
    parser.add_argument("--num-samples", type=int, default=defaults.num_samples, help="on-policy sequences sampled")
    parser.add_argument("--sample-length", type=int, default=defaults.sample_length, help="tokens per sample")
    parser.add_argument("--draft-length", type=int, default=defaults.draft_length,
                        help="draft length of the acceptance measurement")
    parser.add_argument("--prompts", default=None,
                        help="text file, one prompt per line, to sample from (default: the bos token alone)")
    parser.add_argument("--seed", type=int, default=defaults.seed)


def _prompts(args, model_dir: Path, bos_id: int) -> tuple[list[list[int]], list[list[int]]]:
    """(sampling prompts, acceptance prompts). From a prompt file: each line's tokens, cut to the shortest line so
    that the pool is one tensor; evaluation uses the same lines. Without a file: bos alone to sample from, and the
    first 8 tokens of 8 held-out samples (another seed) to measure acceptance on."""
    if args.prompts is None:
        return [[bos_id]], None
    tokenizer_file = model_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ValueError(f"--prompts needs {tokenizer_file} to encode the prompts, and it is missing")
    from hybridtron.data.tokenizer import Tokenizer
    tokenizer = Tokenizer.load(tokenizer_file)
    lines = [line for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"--prompts {args.prompts}: no non-empty lines")
    encoded = [[bos_id] + tokenizer.encode(line) for line in lines]
    shortest = min(len(p) for p in encoded)
    return [p[:shortest] for p in encoded], encoded


def run(args) -> int:

    config = BoostConfig(steps=args.steps, lr=args.lr, batch_size=args.batch_size, depths=args.depths,
                         num_samples=args.num_samples, sample_length=args.sample_length,
                         draft_length=args.draft_length, seed=args.seed)
    model_dir = Path(args.model)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{model_dir}: no such checkpoint directory")
    out_dir = Path(args.out) if args.out else model_dir.with_name(model_dir.name + "-mtp-boosted")
    if out_dir.resolve() == model_dir.resolve():
        raise ValueError(f"--out {out_dir} is the input checkpoint; write the boosted model elsewhere")
    model = load_pretrained(model_dir)
    check_drafter(model, config.draft_length)
    bos = model.config.bos_token_id if model.config.bos_token_id is not None else 0
    prompts, eval_prompts = _prompts(args, model_dir, bos)
    if eval_prompts is None:
        held_out = on_policy_samples(model, prompts, 8, 8, config.sample_temperature, config.seed + 1)
        eval_prompts = held_out.tolist()
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    result = boost_mtp(model, prompts, eval_prompts, config, log=log)
    save_pretrained(model, out_dir)
    for name in TOKENIZER_FILES:  # the boosted model speaks with the same tokenizer and chat template
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, out_dir / name)
    (out_dir / "mtp_boost.json").write_text(json.dumps({"config": asdict(config), **asdict(result)}, indent=2))
    print(f"mean acceptance length (greedy, draft length {config.draft_length}): "
          f"{result.acceptance_before:.3f} -> {result.acceptance_after:.3f}; loss {result.losses[0]:.4f} -> "
          f"{result.losses[-1]:.4f} in {result.seconds:.0f}s; saved {out_dir}")
    return 0
