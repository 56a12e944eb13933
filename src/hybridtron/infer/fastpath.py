"""Decoding fast paths: the model's forward on a cache, computed in fewer or cheaper calls for a CPU's latency.

An eager decode step of a small model spends most of its time dispatching small aten calls, and the rest in
matrix-vector products. Each path below replaces one block's reference forward (`hybridtron.model`) where it
applies and falls back to it where it does not; it changes how, not what, the block computes, and
tests/infer/test_fastpath.py compares each with the reference, outputs and states:

- Mamba, one token: the conv as the K taps of its window (F.conv1d costs about 40 us per call at any size), the SSM
  state advanced in place (`ops.ssd.ssd_step_`: the state is the largest tensor a decode step touches, and a new
  one per token costs as much memory traffic again).
- Mamba, up to `CONV_TAPS_MAX_TOKENS` tokens (short prefill chunks, verification): the conv as taps too.
- Mamba, recorded (speculative verification): the scan over the k+1 tokens keeps the state after every token
  (`ops.ssd.ssd_steps`, one pass instead of k+1 one-token steps), left in `HybridCache.recorded` for `rewind_to`.
- Attention, every row at the same length (batch 1 always): the new keys and values written as one slice, and no
  mask for a single new token (it sees every cached position).
- Routed experts, no more (token, expert) pairs than experts and no gradient: one matrix-vector product per pair on
  the chosen expert's weights in place. The grouped GEMM costs about a pair's worth per expert, rows or not (one
  token of `tiny`: 20 us against 52 us); the two meet at as many pairs as experts. Only with the plain GEMM: a
  grouped GEMM a precision converter swapped in must see every row.
- Routed experts, 2..`DENSE_EXPERTS_MAX_TOKENS` tokens (a verification, a catch-up, a small batch) whose stacked
  weights are small (`DENSE_EXPERTS_MAX_BYTES`): every expert on every token, weighted by the routing weights (zero
  for the experts a token did not choose), in two batched products (`experts_dense`). It does E / k times the
  arithmetic of the pairs but a fixed dozen calls instead of four per pair; 1 thread, AMD EPYC, 8 experts of
  48 x 96 (the `deep` preset): 4 tokens 57 us against 147 us for the pair loop, 7 tokens 75 against 315 (the
  grouped GEMM); `tiny`'s 96 x 192 experts: 117 against 189 and 176 against 382.
- Weight layout (`lay_out_for_decoding`): weight matrices stored transposed, for MKL's matrix-vector product. It
  rewrites the model's storage, so it is an explicit step of building an engine, applied to weights the engine owns
  (`hybridtron.infer.engine`), never a side effect of decoding.

Compiled decoding runs the static-shape forms of `hybridtron.infer.steps` instead (one graph per shape); these
slice the cache to what a step reads, which suits eager calls.

The switch: `forward(model, ids, cache, fast=...)` and `mtp_forward(...)` run the fast paths when `fast`, the
model's own forward otherwise; a decoder chooses once (`Decoder(fast_paths=...)`, on by default on a CPU, where
these were measured; a GPU would rather not read expert ids and lengths back to the host every step).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from hybridtron.config import ATTENTION, MAMBA, MOE
from hybridtron.infer.cache import HybridCache, RecordedSteps, check_state_quant
from hybridtron.model.attention import Attention
from hybridtron.model.block import run_mixer
from hybridtron.model.mamba2 import Mamba2Mixer
from hybridtron.model.mlp import relu2
from hybridtron.model.moe import RoutedExperts
from hybridtron.model.state import KVCache, MambaState
from hybridtron.ops.grouped_mm import grouped_mm
from hybridtron.ops.ssd import ssd_chunked, ssd_step_, ssd_steps

CONV_TAPS_MAX_TOKENS = 16
DENSE_EXPERTS_MAX_TOKENS = 16
DENSE_EXPERTS_MAX_BYTES = 1 << 20  # per stacked matrix: what the dense form reads of every expert stays in L2


# ---------------------------------------------------------------------------------------------------- Mamba
def conv_taps(mixer: Mamba2Mixer, conv_input_BCT: torch.Tensor) -> torch.Tensor:
    """The depthwise causal conv of [B, C, K-1+T] inputs -> [B, C, T], as a product and a sum over the unfolded
    inputs (one output per window of K) instead of a call to F.conv1d."""
    kernel = mixer.conv1d.kernel_size[0]
    out = (conv_input_BCT.unfold(-1, kernel, 1) * mixer.conv1d.weight).sum(-1)
    return out if mixer.conv1d.bias is None else out + mixer.conv1d.bias[:, None]


def mamba_step(mixer: Mamba2Mixer, hidden_B1D: torch.Tensor, state: MambaState) -> torch.Tensor:
    """One token: the decode step's inputs (`Mamba2Mixer.decode_inputs`), the SSM state advanced in place."""
    z, x, B, C, dt, A = mixer.decode_inputs(hidden_B1D[:, 0], state)
    ssm = state.read_ssm()  # the state itself when it is an fp32 buffer
    if torch.is_grad_enabled():
        ssm = ssm.clone()
    y = ssd_step_(ssm, x.float() * dt[..., None], dt * A, B.float(), C.float())
    if ssm is not state.ssm_BHPN:
        state.write_ssm(ssm)
    return mixer.finish(y, x, z)[:, None]


def mamba_forward(mixer: Mamba2Mixer, hidden_BTD: torch.Tensor, state: MambaState,
                  cache: HybridCache | None = None) -> torch.Tensor:
    """`mixer(hidden, state)`; with `cache`, the state after each token is recorded in it (`cache.record`)."""
    length = hidden_BTD.shape[1]
    if cache is None and length == 1:
        return mamba_step(mixer, hidden_BTD, state)
    if cache is None and length > CONV_TAPS_MAX_TOKENS:
        return mixer(hidden_BTD, state)
    z, xBC, dt_raw = mixer.split_projection(mixer.in_proj(hidden_BTD))
    conv_input_BCT = mixer.conv_input(xBC, state)
    if length <= CONV_TAPS_MAX_TOKENS:
        conv_BCT = conv_taps(mixer, conv_input_BCT)
    else:
        conv_BCT = F.conv1d(conv_input_BCT, mixer.conv1d.weight, mixer.conv1d.bias, groups=mixer.conv_channels)
    x, B, C = mixer.split_xbc(F.silu(conv_BCT).transpose(1, 2))
    dt, A = mixer.discretize(dt_raw)
    x_dt, a = x.float() * dt[..., None], dt * A
    initial = state.read_ssm()  # read before the state is overwritten below
    if torch.is_grad_enabled():  # autograd may keep it for the backward
        initial = initial.clone()
    if cache is None:
        y, final = ssd_chunked(x_dt, a, B.float(), C.float(), mixer.chunk_size, initial)
    else:
        y, ssm_steps = ssd_steps(x_dt, a, B.float(), C.float(), initial)
        final = ssm_steps[:, -1]
        kernel = mixer.conv1d.kernel_size[0]
        # the conv state after token t: the K-1 inputs ending at t (a view; rewind_to copies out the one it keeps)
        conv_steps = conv_input_BCT.unfold(-1, kernel - 1, 1)[:, :, 1:].permute(0, 2, 1, 3)
        cache.record(state, RecordedSteps(conv_steps, ssm_steps.to(state.ssm_dtype)))
    state.conv_BCK.copy_(conv_input_BCT[..., length:])
    state.write_ssm(final)
    return mixer.finish(y, x, z)


def forward_recorded_ref(model, ids_BT: torch.Tensor, cache: HybridCache):
    """The reference of a recorded forward: the model's own forward one token at a time, the Mamba states copied
    after each. Returns the model's output over all the tokens (logits and hidden states)."""
    outputs, steps = [], {i: [] for i, layer in enumerate(cache.layers) if isinstance(layer, MambaState)}
    for t in range(ids_BT.shape[1]):
        outputs.append(model(ids_BT[:, t:t + 1], cache=cache, mtp=False))
        for i, kept in steps.items():
            kept.append((cache.layers[i].conv_BCK.clone(), cache.layers[i].read_ssm().clone()))
    for i, kept in steps.items():
        cache.recorded[i] = RecordedSteps(torch.stack([c for c, _ in kept], 1), torch.stack([s for _, s in kept], 1))
    out = outputs[-1]
    out.logits = torch.cat([o.logits for o in outputs], 1)
    out.hidden = torch.cat([o.hidden for o in outputs], 1)
    return out


# ------------------------------------------------------------------------------------------------ attention
def attention_forward(attention: Attention, hidden_BTD: torch.Tensor, kv: KVCache,
                      lengths: torch.Tensor) -> torch.Tensor:
    """`attention(hidden, kv, lengths)`; when every row is at the same length, one slice write per tensor (a
    windowed layer's ring cache always takes the module's own path)."""
    starts = lengths.tolist()
    if min(starts) != max(starts) or attention.sliding_window is not None:
        return attention(hidden_BTD, kv, lengths)
    q, k, v = attention.project(hidden_BTD)
    start, new = starts[0], hidden_BTD.shape[1]
    visible = start + new
    if visible > kv.k_BHTD.shape[2]:
        raise ValueError(f"the KV cache holds {kv.k_BHTD.shape[2]} positions; this forward needs {visible}")
    kv.k_BHTD[:, :, start:visible] = k
    kv.v_BHTD[:, :, start:visible] = v
    mask = None if new == 1 else \
        torch.arange(visible, device=lengths.device) <= torch.arange(start, visible, device=lengths.device)[:, None]
    k_BHTD, v_BHTD = kv.k_BHTD[:, :, :visible].to(q.dtype), kv.v_BHTD[:, :, :visible].to(q.dtype)
    out = F.scaled_dot_product_attention(q, k_BHTD, v_BHTD, attn_mask=mask, enable_gqa=True)
    return attention.o_proj(out.transpose(1, 2).flatten(-2))


# -------------------------------------------------------------------------------------------------- experts
def experts_forward(experts: RoutedExperts, x_SL: torch.Tensor, expert_ids_SK: torch.Tensor,
                    weights_SK: torch.Tensor) -> torch.Tensor:
    """`experts(x, ids, weights)`; with no more (token, expert) pairs than experts, one product per pair."""
    if torch.is_grad_enabled() or expert_ids_SK.numel() > experts.up_proj.shape[0] \
            or experts.grouped_mm is not grouped_mm:
        return experts(x_SL, expert_ids_SK, weights_SK)
    up_ELI, down_EIL = experts.up_proj.transpose(1, 2), experts.down_proj.transpose(1, 2)
    out_SL = torch.zeros_like(x_SL)
    for token, (ids, weights) in enumerate(zip(expert_ids_SK.tolist(), weights_SK.tolist())):
        x_1L, out_1L = x_SL[token, None], out_SL[token, None]
        for expert, weight in zip(ids, weights):
            out_1L.addmm_(relu2(x_1L @ up_ELI[expert]), down_EIL[expert], alpha=weight)
    return out_SL


def experts_dense(experts: RoutedExperts, x_SL: torch.Tensor, expert_ids_SK: torch.Tensor,
                  weights_SK: torch.Tensor) -> torch.Tensor:
    """`experts(x, ids, weights)` as every expert on every token, each expert's hidden state scaled by the token's
    routing weight for it (zero where the token did not choose it): two batched products over the experts."""
    gate_SE = torch.zeros(x_SL.shape[0], experts.up_proj.shape[0], dtype=x_SL.dtype, device=x_SL.device)
    gate_SE.scatter_add_(1, expert_ids_SK, weights_SK.to(x_SL.dtype))
    hidden_ESI = relu2(torch.matmul(x_SL, experts.up_proj.transpose(1, 2))) * gate_SE.T[..., None]
    return torch.bmm(hidden_ESI, experts.down_proj.transpose(1, 2)).sum(0)


def dense_experts_pay(experts: RoutedExperts, tokens: int) -> bool:
    """Whether `experts_dense` is the cheaper form for `tokens` tokens (see the module docstring)."""
    return 2 <= tokens <= DENSE_EXPERTS_MAX_TOKENS and not torch.is_grad_enabled() \
        and experts.grouped_mm is grouped_mm and experts.up_proj.nbytes <= DENSE_EXPERTS_MAX_BYTES


# ---------------------------------------------------------------------------------------------- the switch
def fast_mixer(kind: str, mixer: nn.Module, normed_BTD: torch.Tensor, layer_cache=None, lengths=None,
               expert_ids=None, seq_idx=None, *, recording: HybridCache | None = None) -> torch.Tensor:
    """`model.block.run_mixer` with the fast paths; `recording`: the cache whose Mamba layers record every state.
    Packed documents (`seq_idx`) only run without a cache, through `run_mixer`."""
    if kind == MAMBA and layer_cache is not None:
        return mamba_forward(mixer, normed_BTD, layer_cache, recording)
    if kind == ATTENTION and layer_cache is not None:
        return attention_forward(mixer, normed_BTD, layer_cache, lengths)
    if kind == MOE:
        dense = dense_experts_pay(mixer.experts, normed_BTD.shape[:-1].numel())
        return mixer(normed_BTD, experts_fn=partial(experts_dense if dense else experts_forward, mixer.experts),
                     expert_ids=expert_ids)
    return run_mixer(kind, mixer, normed_BTD, layer_cache, lengths, expert_ids, seq_idx)


def forward(model, ids_BT: torch.Tensor, cache: HybridCache, *, fast: bool = True, record: bool = False):
    """`model(ids, cache=cache, mtp=False)`, with the fast paths when `fast`. `record`: keep every Mamba layer's
    state after each token in `cache.recorded`, for `cache.rewind_to` (speculative verification)."""
    if not fast:
        if record:
            return forward_recorded_ref(model, ids_BT, cache)
        return model(ids_BT, cache=cache, mtp=False)
    mixer_fn = partial(fast_mixer, recording=cache) if record else fast_mixer
    return model(ids_BT, cache=cache, mtp=False, mixer_fn=mixer_fn)


def mtp_forward(model, hidden_BTH: torch.Tensor, next_embedding_BTH: torch.Tensor, cache: HybridCache, *,
                fast: bool = True) -> torch.Tensor:
    """`model.mtp(hidden, next_embedding, caches, lengths)` on the drafter's cache, with the fast paths when `fast`;
    advances the cache's lengths."""
    out = model.mtp(hidden_BTH, next_embedding_BTH, caches=cache.layers, lengths=cache.lengths,
                    mixer_fn=fast_mixer if fast else run_mixer)
    cache.lengths += hidden_BTH.shape[1]
    return out


# ------------------------------------------------------------------------------------------------ layout
def lay_out_for_decoding(model: nn.Module) -> None:
    """Store every fp32 CPU weight matrix of `model` transposed in memory ([in, out] strides; same shapes and
    values), in place: the nn.Linear weights, and each routed expert's matrices.

    A decode step multiplies one vector per sequence by each weight matrix, and MKL's matrix-vector product reads
    a matrix stored [in, out] at close to memory speed but the [out, in] one nn.Linear keeps 1.5-2.2x slower (AMD
    EPYC; bench22m's 32000 x 256 lm_head: 1.0 against 2.2 ms). Matrix-matrix products and the grouped GEMM take
    either layout alike (a tiny training step: 916 against 923 ms), and state dicts and checkpoints hold the same
    values; but the parameters' strides and storage change, so only an engine that owns its weights does this.
    """
    def transposed_storage(weight: torch.Tensor, dims: tuple[int, int]) -> torch.Tensor:
        return weight.detach().transpose(*dims).contiguous().transpose(*dims)

    for module in model.modules():
        if type(module) is nn.Linear:
            matrices = {"weight": (0, 1)}
        elif isinstance(module, RoutedExperts) and module.grouped_mm is grouped_mm:  # not a swapped-in GEMM
            matrices = {"up_proj": (1, 2), "down_proj": (1, 2)}
        else:
            continue
        for name, dims in matrices.items():
            weight = getattr(module, name)
            if weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.is_contiguous():
                with torch.inference_mode(False):  # a weight made in inference mode could not be trained later
                    weight.data = transposed_storage(weight, dims)


# ------------------------------------------------------------------------------------------- drift of a mode
@dataclass
class DriftResult:
    mode: str
    kl_per_position: torch.Tensor  # [T] KL(fp32-cache model || this mode), mean over the batch
    mean_kl: float
    last_quarter_kl: float  # mean over the last quarter of the positions, where drift has had time to build up


@torch.no_grad()
def state_quant_drift(model, tokens_BT: torch.Tensor, modes, seed: int = 0) -> dict[str, DriftResult]:
    """How far decoding with a lower-precision SSM state drifts from the fp32-cache model.

    Teacher forcing: every mode decodes the same tokens one at a time (the state is stored, and rounded, after
    each token, as in generation); at each position the KL divergence from the fp32-cache model's next-token
    distribution to this mode's is averaged over the batch. Position 0 has not read a rounded state yet (KL 0).
    """
    batch, length = tokens_BT.shape
    fast = tokens_BT.device.type == "cpu"

    def decode_logprobs(mode: str) -> torch.Tensor:
        cache = HybridCache.allocate(model.config, batch, length, dtype=model.lm_head.weight.dtype,
                                     device=tokens_BT.device, state_quant=mode, quant_seed=seed)
        out = []
        for t in range(length):
            logits = forward(model, tokens_BT[:, t:t + 1], cache, fast=fast).logits[:, -1]
            cache.store_states()
            out.append(torch.log_softmax(logits.double(), dim=-1))
        return torch.stack(out, 1)  # [B, T, V]

    reference = decode_logprobs("fp32")
    results = {}
    for mode in modes:
        logprobs = decode_logprobs(check_state_quant(mode))
        kl = (reference.exp() * (reference - logprobs)).sum(-1).mean(0).float()
        results[mode] = DriftResult(mode, kl, float(kl.mean()), float(kl[-max(1, length // 4):].mean()))
    return results
