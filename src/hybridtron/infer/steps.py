"""Static-shape forms of the decoding forwards: what `torch.compile(fullgraph=True, dynamic=False)` compiles.

A compiled graph is reused only while its guards hold, so nothing here has a shape that depends on a value, reads a
value back to Python or branches on one: every shape follows from the batch, the number of tokens per row and the
cache's size (see `hybridtron.infer.decoder` for why, and for the cache sizes that keep the graphs few).

- `decode_tokens`: one token per row through every block's own `decode_step` -> (logits, hidden).
- `static_mixer`: a `mixer_fn` (`model.block.run_mixer`'s signature) for T tokens per row. Attention writes the T
  keys and values at each row's length by tensor indexing and reads the whole preallocated cache under a causal mask
  built from the lengths; Mamba runs the T-step recurrence (`ops.ssd.ssd_step` per token, which the compiler fuses),
  keeping every state when asked (`recorded`); the MoE runs its experts by index (`MoE.decode_step`).
- `forward_tokens`: the backbone over T tokens per row, optionally recording the Mamba states for `rewind`
  (speculative verification); `rewind` restores each row's states to its last kept token, by indexing.
- `mtp_tokens`: the MTP block over T positions per row (the drafter's catch-up).

The eager decoders run `hybridtron.infer.fastpath` instead, which slices the cache to what a step reads; both are
tested against the model's reference forward (tests/infer/test_steps.py).

Shapes: B batch, T tokens per row, D hidden, L cache positions, C conv channels, K conv kernel.
"""

from __future__ import annotations

from functools import partial, wraps

import torch
import torch.nn.functional as F

from hybridtron.config import ATTENTION, MAMBA, MOE
from hybridtron.infer.cache import HybridCache
from hybridtron.model.attention import Attention, windowed_cache_attention
from hybridtron.model.mamba2 import Mamba2Mixer
from hybridtron.model.moe import RoutedExperts
from hybridtron.model.state import KVCache, MambaState
from hybridtron.ops.grouped_mm import grouped_mm
from hybridtron.ops.ssd import ssd_step

COMPILED_CACHE_MIN = 256  # positions of a compiled decoder's cache at least (few sizes, so few compiled graphs)


def attention_tokens(attention: Attention, hidden_BTD: torch.Tensor, kv: KVCache,
                     lengths_B: torch.Tensor) -> torch.Tensor:
    """T new tokens per row: keys and values written at lengths..lengths+T-1, queries over the whole cache (a
    windowed layer's: over its ring, `windowed_cache_attention`)."""
    q, k, v = attention.project(hidden_BTD)  # [B, heads, T, head_dim]
    if attention.sliding_window is not None:
        out = windowed_cache_attention(q, k, v, kv, lengths_B, attention.sliding_window)
        return attention.o_proj(out.transpose(1, 2).flatten(-2))
    batch, _, tokens, _ = q.shape
    positions_BT = lengths_B[:, None] + torch.arange(tokens, device=lengths_B.device)
    rows_B1 = torch.arange(batch, device=lengths_B.device)[:, None]
    kv.k_BHTD[rows_B1, :, positions_BT] = k.transpose(1, 2).to(kv.k_BHTD.dtype)
    kv.v_BHTD[rows_B1, :, positions_BT] = v.transpose(1, 2).to(kv.v_BHTD.dtype)
    visible_BTL = torch.arange(kv.k_BHTD.shape[2], device=lengths_B.device) <= positions_BT[..., None]
    out = F.scaled_dot_product_attention(q, kv.k_BHTD.to(q.dtype), kv.v_BHTD.to(q.dtype),
                                         attn_mask=visible_BTL[:, None], enable_gqa=True)
    return attention.o_proj(out.transpose(1, 2).flatten(-2))


def mamba_tokens(mixer: Mamba2Mixer, hidden_BTD: torch.Tensor, state: MambaState,
                 recorded: list | None = None) -> torch.Tensor:
    """T new tokens per row from `state`, which is advanced past all of them; with `recorded`, append (state, the
    conv's input [B, C, K-1+T], the SSM state after each token [B, T, H, P, N]) for `rewind`."""
    tokens = hidden_BTD.shape[1]
    z, xBC, dt_raw = mixer.split_projection(mixer.in_proj(hidden_BTD))
    conv_input_BCW = torch.cat([state.conv_BCK.to(xBC.dtype), xBC.transpose(1, 2)], dim=-1)
    kernel = mixer.conv1d.kernel_size[0]
    conv_BCT = (conv_input_BCW.unfold(-1, kernel, 1) * mixer.conv1d.weight).sum(-1)
    if mixer.conv1d.bias is not None:
        conv_BCT = conv_BCT + mixer.conv1d.bias[:, None]
    x, B, C = mixer.split_xbc(F.silu(conv_BCT).transpose(1, 2))
    dt, A = mixer.discretize(dt_raw)
    x_dt, a = x.float() * dt[..., None], dt * A
    ssm = state.read_ssm()
    outputs, states = [], []
    for t in range(tokens):
        y_t, ssm = ssd_step(ssm, x_dt[:, t], a[:, t], B[:, t].float(), C[:, t].float())
        outputs.append(y_t)
        states.append(ssm)
    if recorded is not None:
        recorded.append((state, conv_input_BCW, torch.stack(states, 1).to(state.ssm_dtype)))
    state.conv_BCK.copy_(conv_input_BCW[..., tokens:])
    state.write_ssm(ssm)
    return mixer.finish(torch.stack(outputs, 1), x, z)


def static_mixer(kind: str, mixer, normed_BTD: torch.Tensor, layer_cache=None, lengths=None, expert_ids=None,
                 seq_idx=None, *, recorded: list | None = None) -> torch.Tensor:
    """A `mixer_fn` with static shapes for T tokens per row (see the module docstring); no routing replay, and a
    decoding cache holds one document per row (`seq_idx` is always None here)."""
    if kind == ATTENTION:
        return attention_tokens(mixer, normed_BTD, layer_cache, lengths)
    if kind == MAMBA:
        return mamba_tokens(mixer, normed_BTD, layer_cache, recorded)
    if kind == MOE:
        return mixer.decode_step(normed_BTD.flatten(0, 1)).view_as(normed_BTD)
    return mixer(normed_BTD)


def decode_tokens(model, ids_B: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row through every block's `decode_step`: (logits [B, V], hidden [B, D] after norm_f); the
    cache is advanced in place. `HybridLM.decode_step`, keeping the hidden state the drafter reads."""
    hidden_BD = model.backbone.embeddings(ids_B)
    for layer, layer_cache in zip(model.backbone.layers, cache.layers):
        hidden_BD = layer.decode_step(hidden_BD, layer_cache, cache.lengths)
    cache.lengths.add_(1)
    hidden_BD = model.backbone.norm_f(hidden_BD)
    return model.lm_head(hidden_BD), hidden_BD


def forward_tokens(model, ids_BT: torch.Tensor, cache, recorded: list | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """T tokens per row through the backbone: (logits [B, T, V], hidden [B, T, D] after norm_f); the cache is
    advanced by T. `recorded`: a list that collects every Mamba layer's states for `rewind`."""
    hidden = model.backbone.embeddings(ids_BT)
    mixer_fn = partial(static_mixer, recorded=recorded)
    for layer, layer_cache in zip(model.backbone.layers, cache.layers):
        hidden = layer(hidden, layer_cache, cache.lengths, None, mixer_fn)
    cache.lengths.add_(ids_BT.shape[1])
    hidden = model.backbone.norm_f(hidden)
    return model.lm_head(hidden), hidden


def rewind(cache, recorded: list, kept_B: torch.Tensor, tokens: int) -> None:
    """After `forward_tokens(..., recorded)` of `tokens` tokens, keep the first `kept_B[b]` (1..tokens) of row b:
    each Mamba state is set to the one recorded after its last kept token, and the lengths drop by the rest."""
    rows_B = torch.arange(kept_B.shape[0], device=kept_B.device)
    for state, conv_input_BCW, ssm_BTHPN in recorded:
        window = state.conv_BCK.shape[-1]  # the conv state after token t: inputs t+1..t+K-1 of conv_input
        state.conv_BCK.copy_(conv_input_BCW.unfold(-1, window, 1)[rows_B, :, kept_B])
        state.write_ssm(ssm_BTHPN[rows_B, kept_B - 1])
    cache.lengths.sub_(tokens - kept_B)


def mtp_tokens(model, hidden_BTD: torch.Tensor, next_tokens_BT: torch.Tensor, mtp_cache,
               lengths_B: torch.Tensor) -> torch.Tensor:
    """The MTP block over T positions per row, writing its cache at lengths_B..+T-1 (the caller sets the lengths):
    its outputs [B, T, D]."""
    next_embedding = model.backbone.embeddings(next_tokens_BT)
    return model.mtp(hidden_BTD, next_embedding, caches=mtp_cache.layers, lengths=lengths_B, mixer_fn=static_mixer)


# ------------------------------------------------------------------------------------------ compiling them
def compiled_cache_length(positions: int, limit: int) -> int:
    """The cache size of a compiled decoder: `positions` rounded up to a power of two >= COMPILED_CACHE_MIN, at most
    `limit` (few sizes, so few compiled graphs)."""
    return min(limit, max(COMPILED_CACHE_MIN, 1 << (positions - 1).bit_length()))


def check_compilable(model) -> None:
    for module in model.modules():
        if isinstance(module, RoutedExperts) and module.grouped_mm is not grouped_mm:
            raise ValueError("compile: the routed experts run a swapped-in grouped GEMM, which the compiled decode "
                             "step (experts read by index) would bypass; decode without compile")


def compile_static(fn):
    """`torch.compile` of a static-shape step (see the module docstring). Compiling happens at the first call of
    each shape; dynamo keeps the code with the function, so later batches of the same shapes reuse it. Each call
    first stages the writes of the caches it is given (`HybridCache.stage_writes`: a stored SSM state's new value
    leaves the graph in fp32, and the caller's `store_states` quantizes it)."""
    # one graph per (rows, cache size, draft length, sampling flags) of a model: more than dynamo's default of 8
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    # cpp_wrapper: the compiled graph's launcher is C++ instead of Python, which saves what is left of the per-step
    # overhead once the ops are fused (1 thread: tiny 0.55 -> 0.43 ms/token, bench22m 3.22 -> ~3.0; compile
    # ~11 -> ~18 s)
    compiled = torch.compile(fn, fullgraph=True, dynamic=False, options={"cpp_wrapper": True})

    @wraps(fn)
    def step(*args):
        for arg in args:  # where the graph writes stored SSM states (the caller's `store_states` quantizes them)
            if isinstance(arg, HybridCache):
                arg.stage_writes()
        return compiled(*args)

    return step


def compiled_size(rows: int, compiled: set[int], capacity: int) -> int:
    """The row count a compiled step runs over for `rows` running rows: the smallest size already compiled that
    holds them, else the next power of two (at most `capacity`, the rows allocated)."""
    fitting = [size for size in compiled if rows <= size <= capacity]
    return min(fitting) if fitting else min(capacity, 1 << (rows - 1).bit_length())
