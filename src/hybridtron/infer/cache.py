"""The hybrid inference cache: a preallocated KV cache per attention layer, conv + SSM state per Mamba layer.

Attention layers grow with the context (one K and one V row per token); Mamba layers keep a constant-size state
per sequence: the last `conv_kernel - 1` conv inputs and the [heads, head_dim, state] SSM state. Each sequence of
the batch has its own length, so sequences of different prompt lengths can decode together.

For speculative decoding a Mamba state can record the state after every token of a multi-token forward
(`record_steps=True`); `HybridCache.rewind_to(accepted)` then restores each sequence's Mamba states to the slot of
its last accepted token and truncates the KV lengths: no recompute.

SSM state in lower precision (`state_quant`, the modes of `hybridtron.infer.state_quant`: fp32, fp16_sr,
fp16_rtn, bf16_sr, bf16_rtn, int8_sr, int8_rtn): `store_states()` rounds every SSM state (and the recorded
per-token states) to what that format would hold; whoever runs a forward on the cache calls it right after, so
the next token reads the rounded state, as a cache that stores the format would give it. The values stay in an
fp32 buffer (the mixer updates the state in fp32 and writes it back in place), so the rounding is exact but the
memory saving is simulated: `memory_bytes()` counts the bytes of the stored format. The stochastic modes draw from
the cache's own generator (seeded by `quant_seed`), so a seeded decode stays reproducible.

`state_quant_drift` measures a mode: the KL from the fp32-cache model over a teacher-forced decode. What it showed
(2026-11-29, CPU, fp32 models): stochastic rounding wins where rounding errors can build up, a long SSM memory and
a steady input (random small model, dt in [1e-4, 1e-3], one token repeated, 256 tokens: mean KL fp16 SR 9.7e-14 vs
RTN 4.0e-12, int8 SR 1.2e-12 vs RTN 1.8e-11; tests/infer/test_cache.py). Where the state forgets quickly (the
bench's trained Markov-chain model, 1024 tokens: fp16 SR 7.6e-10 vs RTN 1.1e-10, int8 SR 4.8e-7 vs RTN 3.4e-7) or
the input is random, RTN's errors do not accumulate and SR's extra variance makes it the worse of the two, by up to
7x. The report's advantage of SR (Table 16) was measured on a large model over long generations.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridtron.config import ATTENTION, MAMBA, ModelConfig
from hybridtron.infer.state_quant import INT8_BLOCK, MODES, roundtrip

STORED_ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}
INT8_SCALE_BYTES = 4


@dataclass
class KVCache:
    k_BHTD: torch.Tensor  # [batch, kv heads, max_len, head_dim]
    v_BHTD: torch.Tensor


@dataclass
class MambaState:
    conv_BCK: torch.Tensor  # [batch, conv channels, kernel - 1]: the raw conv inputs of the last tokens
    ssm_BHPN: torch.Tensor  # [batch, heads, head_dim, state], fp32
    record_steps: bool = False
    # when record_steps: the state after each token of the last forward, [batch, T, ...]
    conv_steps: torch.Tensor | None = None
    ssm_steps: torch.Tensor | None = None


def check_state_quant(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"state_quant: unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    return mode


@dataclass
class HybridCache:
    layers: list  # one KVCache, MambaState or None per layer
    lengths: torch.Tensor  # [batch] tokens already in the cache, per sequence
    max_len: int
    extra: dict = field(default_factory=dict)  # e.g. the MTP block's own cache
    state_quant: str = "fp32"
    quant_generator: torch.Generator | None = None

    @classmethod
    def allocate(cls, config: ModelConfig, batch: int, max_len: int, *, dtype=torch.float32, device="cpu",
                 state_dtype=torch.float32, kinds: tuple[str, ...] | None = None, state_quant: str = "fp32",
                 quant_seed: int = 0) -> "HybridCache":
        if max_len > config.max_position_embeddings:
            raise ValueError(f"max_len {max_len} exceeds the model's max_position_embeddings "
                             f"{config.max_position_embeddings}")
        check_state_quant(state_quant)
        if state_quant != "fp32" and state_dtype != torch.float32:
            raise ValueError(f"state_quant={state_quant!r} rounds an fp32 state buffer; state_dtype must be "
                             f"torch.float32, got {state_dtype}")
        layers = []
        conv_channels = config.mamba_inner_size + 2 * config.n_groups * config.ssm_state_size
        for kind in kinds or config.layers_block_type:
            if kind == ATTENTION:
                shape = (batch, config.num_key_value_heads, max_len, config.head_dim)
                layers.append(KVCache(torch.zeros(shape, dtype=dtype, device=device),
                                      torch.zeros(shape, dtype=dtype, device=device)))
            elif kind == MAMBA:
                layers.append(MambaState(
                    torch.zeros(batch, conv_channels, config.conv_kernel - 1, dtype=dtype, device=device),
                    torch.zeros(batch, config.mamba_num_heads, config.mamba_head_dim, config.ssm_state_size,
                                dtype=state_dtype, device=device)))
            else:
                layers.append(None)
        generator = None
        if state_quant != "fp32":
            generator = torch.Generator(device=device).manual_seed(quant_seed)
        return cls(layers, torch.zeros(batch, dtype=torch.long, device=device), max_len,
                   state_quant=state_quant, quant_generator=generator)

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def select(self, index: int) -> "HybridCache":
        """A view of one sequence (writes go through to this cache); used to prefill prompts one at a time."""
        def row(t):
            return t[index:index + 1]
        layers = []
        for layer in self.layers:
            if isinstance(layer, KVCache):
                layers.append(KVCache(row(layer.k_BHTD), row(layer.v_BHTD)))
            elif isinstance(layer, MambaState):
                layers.append(MambaState(row(layer.conv_BCK), row(layer.ssm_BHPN)))
            else:
                layers.append(None)
        return HybridCache(layers, row(self.lengths), self.max_len, state_quant=self.state_quant,
                           quant_generator=self.quant_generator)

    def set_record_steps(self, on: bool) -> None:
        for layer in self.layers:
            if isinstance(layer, MambaState):
                layer.record_steps = on
                layer.conv_steps = layer.ssm_steps = None

    def rewind_to(self, kept_new_tokens: torch.Tensor, new_tokens: int) -> None:
        """After a recorded forward of `new_tokens` tokens, keep only the first `kept_new_tokens[b]` of them."""
        batch = torch.arange(self.batch_size, device=self.lengths.device)
        slot = kept_new_tokens - 1
        if (kept_new_tokens < 1).any():
            raise ValueError("rewind_to keeps at least one of the recorded tokens per sequence")
        for layer in self.layers:
            if isinstance(layer, MambaState):
                if layer.ssm_steps is None:
                    raise RuntimeError("rewind_to needs a forward with record_steps on")
                layer.conv_BCK.copy_(layer.conv_steps[batch, slot])
                layer.ssm_BHPN.copy_(layer.ssm_steps[batch, slot])
        self.lengths -= new_tokens - kept_new_tokens

    @torch.no_grad()
    def store_states(self) -> None:
        """Round every SSM state (and the per-token states of a recorded forward) to the `state_quant` format.

        Call after each forward that updated the cache. fp32 is a no-op.
        """
        if self.state_quant == "fp32":
            return
        for layer in self.layers:
            if isinstance(layer, MambaState):
                layer.ssm_BHPN.copy_(roundtrip(layer.ssm_BHPN, self.state_quant, self.quant_generator))
                if layer.ssm_steps is not None:
                    layer.ssm_steps = roundtrip(layer.ssm_steps, self.state_quant, self.quant_generator)

    def ssm_state_bytes(self, state: MambaState) -> int:
        """Bytes of one layer's SSM state as the `state_quant` format stores it (fp32: the buffer itself)."""
        if self.state_quant == "fp32":
            return state.ssm_BHPN.nbytes
        fmt = self.state_quant.split("_")[0]
        elements = state.ssm_BHPN.numel()
        total = elements * STORED_ELEMENT_BYTES[fmt]
        if fmt == "int8":
            size = state.ssm_BHPN.shape[-1]
            blocks = elements // size * -(-size // INT8_BLOCK)
            total += blocks * INT8_SCALE_BYTES
        return total

    def memory_bytes(self) -> int:
        total = 0
        for layer in self.layers:
            if isinstance(layer, KVCache):
                total += layer.k_BHTD.nbytes + layer.v_BHTD.nbytes
            elif isinstance(layer, MambaState):
                total += layer.conv_BCK.nbytes + self.ssm_state_bytes(layer)
        return total


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

    def decode_logprobs(mode: str) -> torch.Tensor:
        cache = HybridCache.allocate(model.config, batch, length, dtype=model.lm_head.weight.dtype,
                                     device=tokens_BT.device, state_quant=mode, quant_seed=seed)
        out = []
        for t in range(length):
            logits = model(tokens_BT[:, t:t + 1], cache=cache, mtp=False).logits[:, -1]
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
