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
fp16_rtn, bf16_sr, bf16_rtn, int8_sr, int8_rtn): every Mamba layer's SSM state is stored in that format
(`StoredMambaState`: int8 values and their fp32 block scales, or fp16 / bf16 values), so `memory_bytes()` is the
bytes of the tensors the cache holds. The update reads the state dequantized to fp32 (`read_ssm`) and writes its
result back quantized (`write_ssm`), one layer at a time: the fp32 copy of a layer's state lives only during that
layer's update. The stochastic modes draw from the cache's own generator (seeded by `quant_seed`), so a seeded
decode stays reproducible. A compiled step cannot draw from a generator inside its graph: its new states leave
the graph in fp32 (one step's, transient) and `store_states()` quantizes them right after, in the same order. A
recorded forward's per-token states are kept in fp32 until `store_states()`, which quantizes them after the
layers' own states (so a rewind restores values and scales as stored, with no second rounding); whoever runs a
forward on the cache calls `store_states()` right after it.

The reference (`reference_quant=True`): an fp32 buffer that `store_states()` rounds in place to what the format
holds (`state_quant.roundtrip`), drawing in the same order, so the stored cache decodes bit for bit as it does
(tests/infer/test_stored_state.py).

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
from hybridtron.infer.state_quant import MODES, StoredState, dequantize_state, quantize_state, roundtrip, \
    stored_layout
from hybridtron.model.state import KVCache, LayerStates, MambaState, allocate_layers, kv_slots, select_layers


@dataclass
class RecordedSteps:
    """A Mamba layer's state after each token of a recorded forward of T tokens; for a `StoredMambaState`, after
    `store_states()`, the SSM states as it stores them (values, and the int8 scales)."""

    conv_BTCK: torch.Tensor  # [batch, T, conv channels, kernel - 1]
    ssm_BTHPN: torch.Tensor  # [batch, T, heads, head_dim, state]
    scales_BTHPS: torch.Tensor | None = None  # [batch, T, heads, head_dim, state blocks]: int8 only


@dataclass
class StoredMambaState(MambaState):
    """A Mamba state whose SSM part is stored in a `state_quant` mode other than fp32: `ssm_BHPN` holds the values
    in the stored dtype (int8, fp16, bf16), `scales_BHPS` the int8 modes' fp32 scale per block of INT8_BLOCK along
    the state axis (None otherwise), as `state_quant.quantize_state` makes them. `pending`: where a compiled step
    writes its new state, in fp32 (`HybridCache.stage_writes` allocates it before the step, `store_states`
    quantizes it and lets it go)."""

    scales_BHPS: torch.Tensor | None
    mode: str
    generator: torch.Generator | None
    pending: torch.Tensor | None = None

    @classmethod
    def zeros(cls, conv_BCK: torch.Tensor, shape: tuple[int, ...], mode: str,
              generator: torch.Generator | None) -> "StoredMambaState":
        dtype, scales_shape = stored_layout(shape, mode)
        device = conv_BCK.device
        scales = None if scales_shape is None else torch.zeros(scales_shape, dtype=torch.float32, device=device)
        return cls(conv_BCK, torch.zeros(shape, dtype=dtype, device=device), scales, mode, generator)

    def read_ssm(self) -> torch.Tensor:
        # contiguous (as the reference's fp32 buffer is): the update's reductions then sum in the same order
        return dequantize_state(StoredState(self.mode, self.ssm_BHPN, self.scales_BHPS))

    def write_ssm(self, ssm_BHPN: torch.Tensor) -> None:
        if torch.compiler.is_compiling():  # no generator inside a graph: `store_states` quantizes it after
            assert self.pending is not None, "a compiled step on a stored SSM state needs stage_writes() first"
            self.pending.copy_(ssm_BHPN)
        else:
            self.store(quantize_state(ssm_BHPN, self.mode, self.generator))

    def store(self, stored: StoredState) -> None:
        self.ssm_BHPN.copy_(stored.values)
        if self.scales_BHPS is not None:
            self.scales_BHPS.copy_(stored.scales)

    @property
    def ssm_dtype(self) -> torch.dtype:
        return torch.float32  # until `store_states` quantizes them

    def tensors(self) -> dict[str, torch.Tensor]:
        scales = {} if self.scales_BHPS is None else {"scales_BHPS": self.scales_BHPS}
        return {**super().tensors(), **scales}


def check_state_quant(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"state_quant: unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    return mode


@dataclass
class HybridCache(LayerStates):
    max_len: int
    state_quant: str = "fp32"
    quant_generator: torch.Generator | None = None
    reference_quant: bool = False  # fp32 buffers rounded in place by `store_states` (see the module docstring)
    # by layer index: the states after each token of the last recorded forward (until `rewind_to`)
    recorded: dict[int, RecordedSteps] = field(default_factory=dict)

    @classmethod
    def allocate(cls, config: ModelConfig, batch: int, max_len: int, *, dtype=torch.float32, device="cpu",
                 state_dtype=torch.float32, kinds: tuple[str, ...] | None = None, state_quant: str = "fp32",
                 quant_seed: int = 0, reference_quant: bool = False) -> "HybridCache":
        """Zero states (`model.state.allocate_layers`); with `state_quant` other than fp32 every Mamba layer's SSM
        state stored in it (`StoredMambaState`), or with `reference_quant` in an fp32 buffer that `store_states`
        rounds (the reference)."""
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
            if not reference_quant:
                layers = [StoredMambaState.zeros(layer.conv_BCK, layer.ssm_BHPN.shape, state_quant, generator)
                          if isinstance(layer, MambaState) else layer for layer in layers]
        return cls(layers, torch.zeros(batch, dtype=torch.long, device=device), max_len,
                   state_quant=state_quant, quant_generator=generator, reference_quant=reference_quant)

    def select(self, index: int) -> "HybridCache":
        """A view of one sequence (writes go through to this cache)."""
        return self.rows(index, index + 1)

    def rows(self, start: int, stop: int) -> "HybridCache":
        """A view of sequences start..stop-1 (writes go through to this cache); used to prefill some rows."""
        rows = slice(start, stop)
        return HybridCache(select_layers(self.layers, rows), self.lengths[rows], self.max_len,
                           state_quant=self.state_quant, quant_generator=self.quant_generator,
                           reference_quant=self.reference_quant)

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
                for mine, theirs in zip(layer.tensors().values(), from_layer.tensors().values()):
                    mine[targets] = theirs[source].clone() if same else theirs[source]
        self.lengths[targets] = length

    def reset_rows(self, start: int, stop: int) -> None:
        """Empty rows start..stop-1: length 0 and zero Mamba states, where a new prompt starts (keys and values
        past a row's length are never read, so they stay)."""
        for layer in self.layers:
            if isinstance(layer, MambaState):
                for tensor in layer.tensors().values():
                    tensor[start:stop].zero_()
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
                layers.append(layer.map_rows(lambda tensor: resized_rows(tensor, rows)))
            else:
                layers.append(None)
        return HybridCache(layers, resized_rows(self.lengths, rows), max_len, state_quant=self.state_quant,
                           quant_generator=self.quant_generator, reference_quant=self.reference_quant)

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
            if isinstance(state, StoredMambaState):  # the values and scales as stored: no second rounding
                assert steps.ssm_BTHPN.dtype == state.ssm_BHPN.dtype, "rewind_to before store_states"
                state.store(StoredState(state.mode, steps.ssm_BTHPN[batch, slot],
                                        None if steps.scales_BTHPS is None else steps.scales_BTHPS[batch, slot]))
            else:
                state.ssm_BHPN.copy_(steps.ssm_BTHPN[batch, slot])
        self.recorded.clear()
        self.lengths -= new_tokens - kept_new_tokens

    def stage_writes(self) -> None:
        """Before a compiled step: an fp32 buffer for each stored SSM state's new value (the graph cannot draw the
        stochastic rounding's numbers), which `store_states` quantizes after it."""
        for layer in self.layers:
            if isinstance(layer, StoredMambaState):
                layer.pending = torch.empty(layer.ssm_BHPN.shape, dtype=torch.float32, device=layer.ssm_BHPN.device)

    @torch.no_grad()
    def store_states(self) -> None:
        """Store what the last forward left in fp32 in the `state_quant` format: a compiled step's new SSM states,
        then the per-token states of a recorded forward (the reference: round every SSM state, then those).

        Call after each forward that updated the cache. fp32 is a no-op.
        """
        if self.state_quant == "fp32":
            return
        for layer in self.layers:
            if isinstance(layer, StoredMambaState) and layer.pending is not None:
                layer.store(quantize_state(layer.pending, self.state_quant, self.quant_generator))
                layer.pending = None
            elif isinstance(layer, MambaState) and not isinstance(layer, StoredMambaState):
                layer.ssm_BHPN.copy_(roundtrip(layer.ssm_BHPN, self.state_quant, self.quant_generator))
        for index, steps in self.recorded.items():
            if isinstance(self.layers[index], StoredMambaState):
                stored = quantize_state(steps.ssm_BTHPN, self.state_quant, self.quant_generator)
                steps.ssm_BTHPN, steps.scales_BTHPS = stored.values, stored.scales
            else:
                steps.ssm_BTHPN = roundtrip(steps.ssm_BTHPN, self.state_quant, self.quant_generator)

    def slot_bytes(self) -> int:
        """Bytes of one row (one sequence's slot): `memory_bytes() / rows`."""
        return self.memory_bytes() // self.batch_size

    def memory_bytes(self) -> int:
        """Bytes of the tensors the cache holds (a stored SSM state's values and scales; the reference's fp32
        buffers)."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, KVCache):
                total += layer.k_BHTD.nbytes + layer.v_BHTD.nbytes
            elif isinstance(layer, MambaState):
                total += sum(tensor.nbytes for tensor in layer.tensors().values())
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
