"""The serving cache: the model's layer states (`hybridtron.model.state`) for a batch of sequences, with what
decoding adds: rewinding after speculative verification, SSM states stored in lower precision, row copies (slots),
memory.

Attention layers grow with the context (one K and one V row per token, preallocated to `max_len`), a windowed layer's
(`config.sliding_window`) only up to its window: a ring whose slot p % window holds position p, so its row copies
take every slot and a rewind (speculative verification) is refused, the ring having overwritten what it would
restore. Mamba layers keep
a constant-size state per sequence: the last `conv_kernel - 1` conv inputs and the [heads, head_dim, state] SSM
state. Each sequence of the batch has its own length, so sequences of different prompt lengths decode together.

Rows are slots (`hybridtron.infer.decoder.DecodeBatch`): `copy_row_from` gives a row what a row of another cache of
the same layers holds (a prefill staged in a one-row cache joins the batch; a finished sequence's slot takes the
last row's sequence), `reset_rows` empties rows for a new prompt, `resized` grows the batch, `slot_bytes` is the
memory of one row.

Speculative verification runs a recorded forward (`hybridtron.infer.fastpath.forward(..., record=True)`), which
keeps every Mamba layer's state after each of its tokens (`recorded`); `HybridCache.rewind_to(accepted)` then
restores each sequence's Mamba states to the slot of its last accepted token and truncates the KV lengths: no
recompute.

SSM state in lower precision (`state_quant`, the modes of `hybridtron.infer.state_quant`: fp32, fp16_sr,
fp16_rtn, bf16_sr, bf16_rtn, int8_sr, int8_rtn): `store_states()` rounds every SSM state (and the recorded
per-token states) to what that format would hold; whoever runs a forward on the cache calls it right after, so
the next token reads the rounded state, as a cache that stores the format would give it. The values stay in an
fp32 buffer (the mixer updates the state in fp32 and writes it back in place), so the rounding is exact but the
memory saving is simulated: `memory_bytes()` counts the bytes of the stored format. The stochastic modes draw from
the cache's own generator (seeded by `quant_seed`), so a seeded decode stays reproducible.

`hybridtron.infer.fastpath.state_quant_drift` measures a mode: the KL from the fp32-cache model over a teacher-forced
decode. Stochastic rounding wins where rounding errors can build up (a long SSM memory and a steady input,
tests/infer/test_cache.py); where the state forgets quickly or the input is random, RTN's errors do not accumulate
and SR's extra variance can make it the worse of the two. The measurements are in docs/LOG.md ("inference",
2026-11-29); the report's advantage of SR (Table 16) was measured on a large model over long generations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from hybridtron.config import ModelConfig
from hybridtron.infer.state_quant import INT8_BLOCK, MODES, roundtrip
from hybridtron.model.state import KVCache, LayerStates, MambaState, allocate_layers, kv_slots, select_layers

STORED_ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}
INT8_SCALE_BYTES = 4


@dataclass
class RecordedSteps:
    """A Mamba layer's state after each token of a recorded forward of T tokens."""

    conv_BTCK: torch.Tensor  # [batch, T, conv channels, kernel - 1]
    ssm_BTHPN: torch.Tensor  # [batch, T, heads, head_dim, state]


def check_state_quant(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"state_quant: unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    return mode


@dataclass
class HybridCache(LayerStates):
    max_len: int
    state_quant: str = "fp32"
    quant_generator: torch.Generator | None = None
    # by layer index: the states after each token of the last recorded forward (until `rewind_to`)
    recorded: dict[int, RecordedSteps] = field(default_factory=dict)

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
        layers = allocate_layers(config, batch, max_len, dtype=dtype, device=device, state_dtype=state_dtype,
                                 kinds=kinds)
        generator = None
        if state_quant != "fp32":
            generator = torch.Generator(device=device).manual_seed(quant_seed)
        return cls(layers, torch.zeros(batch, dtype=torch.long, device=device), max_len,
                   state_quant=state_quant, quant_generator=generator)

    def select(self, index: int) -> "HybridCache":
        """A view of one sequence (writes go through to this cache)."""
        return self.rows(index, index + 1)

    def rows(self, start: int, stop: int) -> "HybridCache":
        """A view of sequences start..stop-1 (writes go through to this cache); used to prefill some rows."""
        rows = slice(start, stop)
        return HybridCache(select_layers(self.layers, rows), self.lengths[rows], self.max_len,
                           state_quant=self.state_quant, quant_generator=self.quant_generator)

    def copy_row(self, source: int, targets: Sequence[int]) -> None:
        """Make rows `targets` hold what row `source` holds (its positions, states and length): samples of one
        prompt share its prefill, and a freed slot takes the batch's last sequence."""
        self.copy_row_from(self, source, targets)

    def copy_row_from(self, other: "HybridCache", source: int, targets: Sequence[int]) -> None:
        """Make rows `targets` hold what row `source` of `other` (a cache of the same layers, or this one) holds:
        the keys and values up to its length, the Mamba states, the length. Positions past the length are not
        copied: nothing reads them."""
        targets = list(targets)
        if not targets:
            return
        length = int(other.lengths[source])
        same = other is self
        for layer, from_layer in zip(self.layers, other.layers):
            # a row copied within one tensor is read out first: an indexed write may not read the tensor it writes
            if isinstance(layer, KVCache):
                held = min(length, layer.k_BHTD.shape[2])  # a ring that has wrapped holds its positions in every slot
                for mine, theirs in ((layer.k_BHTD, from_layer.k_BHTD), (layer.v_BHTD, from_layer.v_BHTD)):
                    row = theirs[source, :, :held]
                    mine[targets, :, :held] = row.clone() if same else row
            elif isinstance(layer, MambaState):
                for mine, theirs in ((layer.conv_BCK, from_layer.conv_BCK), (layer.ssm_BHPN, from_layer.ssm_BHPN)):
                    mine[targets] = theirs[source].clone() if same else theirs[source]
        self.lengths[targets] = length

    def reset_rows(self, start: int, stop: int) -> None:
        """Empty rows start..stop-1: length 0 and zero Mamba states, where a new prompt starts (keys and values
        past a row's length are never read, so they stay)."""
        for layer in self.layers:
            if isinstance(layer, MambaState):
                layer.conv_BCK[start:stop].zero_()
                layer.ssm_BHPN[start:stop].zero_()
        self.lengths[start:stop] = 0

    def resized(self, rows: int, max_len: int | None = None) -> "HybridCache":
        """A cache of `rows` rows of `max_len` positions (default: as now; same layers and format) holding what this
        cache's first rows hold."""
        max_len = max_len or self.max_len
        assert max_len >= self.max_len or int(self.lengths.max()) <= max_len, "resizing would drop positions"
        layers = []
        for layer in self.layers:
            if isinstance(layer, KVCache):
                # a ring's slot count changes only while no sequence has outgrown it (`kv_slots`): no slot moves
                slots = kv_slots(max_len, layer.window)
                layers.append(KVCache(*(_resized_kv(t, rows, slots) for t in (layer.k_BHTD, layer.v_BHTD)),
                                      layer.window))
            elif isinstance(layer, MambaState):
                layers.append(MambaState(resized_rows(layer.conv_BCK, rows), resized_rows(layer.ssm_BHPN, rows)))
            else:
                layers.append(None)
        return HybridCache(layers, resized_rows(self.lengths, rows), max_len, state_quant=self.state_quant,
                           quant_generator=self.quant_generator)

    def record(self, state: MambaState, steps: RecordedSteps) -> None:
        """Keep a Mamba layer's per-token states of the forward that is running (fastpath calls this)."""
        index = next(i for i, layer in enumerate(self.layers) if layer is state)
        self.recorded[index] = steps

    def rewind_to(self, kept_new_tokens: torch.Tensor, new_tokens: int) -> None:
        """After a recorded forward of `new_tokens` tokens, keep only the first `kept_new_tokens[b]` of them."""
        if (kept_new_tokens < 1).any():
            raise ValueError("rewind_to keeps at least one of the recorded tokens per sequence")
        if any(isinstance(layer, KVCache) and layer.window is not None for layer in self.layers):
            raise ValueError("rewind_to: a sliding_window layer's KV cache is a ring of its window, and the rejected "
                             "tokens overwrote positions it would need; speculative decoding needs sliding_window None")
        mamba_layers = [i for i, layer in enumerate(self.layers) if isinstance(layer, MambaState)]
        if any(i not in self.recorded for i in mamba_layers):
            raise RuntimeError("rewind_to needs a recorded forward (`fastpath.forward(..., record=True)`) first")
        batch = torch.arange(self.batch_size, device=self.lengths.device)
        slot = kept_new_tokens - 1
        for i in mamba_layers:
            state, steps = self.layers[i], self.recorded[i]
            state.conv_BCK.copy_(steps.conv_BTCK[batch, slot])
            state.ssm_BHPN.copy_(steps.ssm_BTHPN[batch, slot])
        self.recorded.clear()
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
        for steps in self.recorded.values():
            steps.ssm_BTHPN = roundtrip(steps.ssm_BTHPN, self.state_quant, self.quant_generator)

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

    def slot_bytes(self) -> int:
        """Bytes of one row (one sequence's slot): `memory_bytes() / rows`."""
        return self.memory_bytes() // self.batch_size

    def memory_bytes(self) -> int:
        total = 0
        for layer in self.layers:
            if isinstance(layer, KVCache):
                total += layer.k_BHTD.nbytes + layer.v_BHTD.nbytes
            elif isinstance(layer, MambaState):
                total += layer.conv_BCK.nbytes + self.ssm_state_bytes(layer)
        return total


def resized_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """A tensor of `rows` rows holding `tensor`'s first rows (zeros after them)."""
    out = tensor.new_zeros(rows, *tensor.shape[1:])
    kept = min(rows, tensor.shape[0])
    out[:kept] = tensor[:kept]
    return out


def _resized_kv(tensor_BHTD: torch.Tensor, rows: int, positions: int) -> torch.Tensor:
    out = tensor_BHTD.new_zeros(rows, tensor_BHTD.shape[1], positions, tensor_BHTD.shape[3])
    kept_rows, kept_positions = min(rows, tensor_BHTD.shape[0]), min(positions, tensor_BHTD.shape[2])
    out[:kept_rows, :, :kept_positions] = tensor_BHTD[:kept_rows, :, :kept_positions]
    return out
