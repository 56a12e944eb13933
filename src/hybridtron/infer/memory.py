"""KV cache and Mamba state memory of a model at a context and batch (the bytes per token and per sequence are
`hybridtron.model.memory`'s).

The crossover is the shortest context at which the KV cache of a sequence is at least as large as its Mamba state:
below it the constant Mamba state dominates, above it the KV cache does. Ultra, FP8 KV, fp32 SSM + bf16 conv:
6,144 B/token, 389 MiB of state, crossover at 66,400 tokens (65,536 = 64K counting the SSM state alone).
Windowed attention layers (`config.sliding_window`) stop growing at their window (`model.memory.kv_cache_bytes`):
`kv_per_token` is the growth within every window; the totals, the crossover and the slots count a windowed layer's
window only.

Slots for a memory budget (`--budget-gib`): the engine (`hybridtron.infer.engine.HybridEngine(memory_budget_gib=
...)`) keeps one slot per sequence it decodes at once, each holding a sequence's KV cache at the full context, its
Mamba state and, with speculative decoding (`--include-mtp`), the MTP block's KV cache over `CATCH_UP_WIDTH` more
positions and the drafter's catch-up buffer (that many hidden states); one more row of all of it stages prefills.
`slot_bytes` is exactly what the engine allocates per slot (tests/infer/test_memory.py checks it against the
engine's caches).

Weights (`--weights nvfp4|fp8|bf16`, `--policy`): the bytes of the model's checkpoint in that format under an
export policy (`hybridtron.numerics.export_policy`, what `hybridtron quantize` writes), spread evenly over `--gpus`
GPUs of `--gpu-memory-gib` each, and what each has left for activations, KV cache and Mamba state; the table shows
all three formats, the asked one marked, alone unless `--context` or `--budget-gib` asks for the cache too. Ultra's
report: on 8 x H100 an FP8 checkpoint (~540 GiB) leaves ~10 GiB per GPU, an NVFP4 one (~330 GiB) ~40 GiB. ultra3
(560B parameters) under `--policy experts`: FP8 554 GiB (10.7 GiB left), NVFP4 340 GiB (37.5 GiB left); under
`ultra` the BF16 tail (16 layers of 512 experts) adds ~105 GiB to NVFP4.

`hybridtron memory --preset ultra3 --context 262144 --batch 8 --kv-dtype fp8 --state-dtype fp32`
`hybridtron memory --config runs/quickstart/hf --kv-dtype fp32 --conv-dtype fp32 --include-mtp --budget-gib 1`
`hybridtron memory --preset ultra3 --weights nvfp4 --policy experts --gpus 8 --gpu-memory-gib 80`
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

from hybridtron.checkpoint.hf import read_model_config
from hybridtron.config import ATTENTION, MAMBA, PRESETS, ModelConfig, preset
from hybridtron.model.lm import HybridLM
from hybridtron.model.memory import (
    BYTES_PER_ELEMENT, CONV_DTYPES, KV_DTYPES, STATE_DTYPES, conv_state_bytes, count_layers, kv_bytes_per_token,
    kv_bytes_per_layer_token, kv_cache_bytes, mamba_state_bytes, ssm_state_bytes,
)
from hybridtron.numerics.export_policy import EXPORT_POLICIES, WEIGHT_FORMATS, weight_bytes

CATCH_UP_WIDTH = 64  # positions a speculative engine's drafter may lag the backbone (`hybridtron.infer.speculative`)
MiB = 1024 ** 2
GiB = 1024 ** 3


def crossover_context(kv_per_token: int, state_per_sequence: int) -> int | None:
    """Shortest context where the KV cache of a sequence is >= its Mamba state; None if it never is (no KV)."""
    if kv_per_token == 0:
        return None if state_per_sequence > 0 else 0
    return math.ceil(state_per_sequence / kv_per_token)


def windowed_crossover(config: ModelConfig, kv_dtype: str, state_per_sequence: int, include_mtp: bool) -> int | None:
    """`crossover_context` when windowed layers stop growing at their window: the shortest context whose
    `kv_cache_bytes` is >= the state; None if it never is."""
    within_window = crossover_context(kv_bytes_per_token(config, kv_dtype, include_mtp), state_per_sequence)
    window = config.sliding_window
    if window is None or within_window is None or within_window <= window:
        return within_window
    at_window = kv_cache_bytes(config, window, kv_dtype, include_mtp)
    full_layers = count_layers(config, ATTENTION, include_mtp) - len(config.windowed_layers)
    beyond = crossover_context(kv_bytes_per_layer_token(config, kv_dtype) * full_layers,
                               state_per_sequence - at_window)
    return None if beyond is None else window + beyond


def slot_bytes(config: ModelConfig, context: int, kv_dtype: str = "fp32", state_dtype: str = "fp32",
               conv_dtype: str = "fp32", include_mtp: bool = False) -> int:
    """Cache bytes of one engine slot at `context` positions (see the module docstring)."""
    total = kv_cache_bytes(config, context, kv_dtype) + mamba_state_bytes(config, state_dtype, conv_dtype)
    if include_mtp and config.has_mtp:
        mtp_kv = kv_bytes_per_token(config, kv_dtype, include_mtp=True) - kv_bytes_per_token(config, kv_dtype)
        hidden_bytes = BYTES_PER_ELEMENT[conv_dtype]  # the activation dtype, as the conv state's
        total += mtp_kv * (context + CATCH_UP_WIDTH) + CATCH_UP_WIDTH * (config.hidden_size * hidden_bytes + 8) + 8
    return total


def slots_for_budget(config: ModelConfig, budget_gib: float, context: int, kv_dtype: str = "fp32",
                     state_dtype: str = "fp32", conv_dtype: str = "fp32", include_mtp: bool = False) -> int:
    """Slots (sequences decoding at once) that fit in `budget_gib` GiB of cache, one more row staging prefills;
    ValueError when not even one does."""
    if isinstance(budget_gib, bool) or not isinstance(budget_gib, (int, float)) or not budget_gib > 0:
        raise ValueError(f"memory budget must be a number of GiB > 0, got {budget_gib!r}")
    per_slot = slot_bytes(config, context, kv_dtype, state_dtype, conv_dtype, include_mtp)
    slots = int(budget_gib * GiB) // per_slot - 1
    if slots < 1:
        raise ValueError(f"a memory budget of {budget_gib} GiB holds no slot: one slot at context {context:,} takes "
                         f"{human_bytes(per_slot)}, and one more row stages prefills (two at least)")
    return slots


@dataclass(frozen=True)
class MemoryReport:
    """Everything `hybridtron memory` prints; bytes unless the name says otherwise."""

    context: int
    batch: int
    kv_dtype: str
    state_dtype: str
    conv_dtype: str
    attention_layers: int
    mamba_layers: int
    kv_per_token: int
    ssm_state_per_sequence: int
    conv_state_per_sequence: int
    mamba_state_per_sequence: int
    kv_total: int
    mamba_total: int
    total: int
    crossover_tokens: int | None
    crossover_ssm_only_tokens: int | None
    slot_bytes: int  # one engine slot at this context (`slot_bytes`)
    windowed_attention_layers: int = 0  # of attention_layers, those holding only their sliding_window
    budget_gib: float | None = None
    slots_in_budget: int | None = None


def memory_report(config: ModelConfig, context: int, batch: int = 1, kv_dtype: str = "fp8",
                  state_dtype: str = "fp32", conv_dtype: str = "bf16", include_mtp: bool = False,
                  budget_gib: float | None = None) -> MemoryReport:
    """KV cache and Mamba state of `batch` sequences of `context` tokens each."""
    for name, value in (("context", context), ("batch", batch)):
        if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "context" else 1):
            raise ValueError(f"{name} must be an integer >= {0 if name == 'context' else 1}, got {value!r}")
    kv_per_token = kv_bytes_per_token(config, kv_dtype, include_mtp)
    ssm = ssm_state_bytes(config, state_dtype)
    conv = conv_state_bytes(config, conv_dtype)
    kv_total = kv_cache_bytes(config, context, kv_dtype, include_mtp) * batch
    mamba_total = (ssm + conv) * batch
    return MemoryReport(
        context=context, batch=batch, kv_dtype=kv_dtype, state_dtype=state_dtype, conv_dtype=conv_dtype,
        attention_layers=count_layers(config, ATTENTION, include_mtp), mamba_layers=count_layers(config, MAMBA),
        kv_per_token=kv_per_token, ssm_state_per_sequence=ssm, conv_state_per_sequence=conv,
        mamba_state_per_sequence=ssm + conv, kv_total=kv_total, mamba_total=mamba_total,
        total=kv_total + mamba_total, crossover_tokens=windowed_crossover(config, kv_dtype, ssm + conv, include_mtp),
        crossover_ssm_only_tokens=windowed_crossover(config, kv_dtype, ssm, include_mtp),
        slot_bytes=slot_bytes(config, context, kv_dtype, state_dtype, conv_dtype, include_mtp),
        windowed_attention_layers=len(config.windowed_layers),
        budget_gib=budget_gib,
        slots_in_budget=None if budget_gib is None else
        slots_for_budget(config, budget_gib, context, kv_dtype, state_dtype, conv_dtype, include_mtp),
    )


@dataclass(frozen=True)
class WeightsRow:
    """One weight format's checkpoint bytes and what it leaves per GPU when spread evenly over `gpus`."""

    weights: str
    policy: str
    total: int
    per_gpu: int
    left_per_gpu: int  # GPU memory less its share of the weights: for activations, KV cache and Mamba state
    gpus: int
    gpu_memory: int


def weights_table(config: ModelConfig, policy: str = "ultra", gpus: int = 8,
                  gpu_memory_gib: float = 80.0) -> list[WeightsRow]:
    """The weights of `config`'s model in each format (`WEIGHT_FORMATS`) under `policy`, per GPU."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"--gpus: expected a number of GPUs >= 1, got {gpus!r}")
    if not gpu_memory_gib > 0:
        raise ValueError(f"--gpu-memory-gib: expected a number of GiB > 0, got {gpu_memory_gib!r}")
    model = HybridLM.on_meta(config)
    memory = int(gpu_memory_gib * GiB)
    rows = []
    for weights in WEIGHT_FORMATS:
        total = weight_bytes(model, weights, policy).total
        per_gpu = math.ceil(total / gpus)
        rows.append(WeightsRow(weights, policy, total, per_gpu, memory - per_gpu, gpus, memory))
    return rows


def format_weights(rows: list[WeightsRow], chosen: str, name: str) -> str:
    first = rows[0]
    size, unit = (GiB, "GiB") if max(row.total for row in rows) >= GiB else (MiB, "MiB")
    lines = [f"{name}: weights under export policy {first.policy!r} on {first.gpus} GPUs of "
             f"{first.gpu_memory / GiB:g} GiB",
             f"  {'format':<8}{'total':>14}{'per GPU':>12}{'left per GPU':>15}"]
    for row in rows:
        mark = "  <-" if row.weights == chosen else ""
        lines.append(f"  {row.weights:<8}{row.total / size:>10,.1f} {unit}{row.per_gpu / size:>8,.1f} {unit}"
                     f"{row.left_per_gpu / size:>11,.1f} {unit}{mark}")
    return "\n".join(lines)


def human_bytes(n: int) -> str:
    """`402653184` -> `384.00 MiB (402,653,184 B)`."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:,.2f} {unit} ({n:,} B)"
    return f"{n:,} B"


def format_report(report: MemoryReport, name: str) -> str:
    r = report
    crossover = ("never (no attention layers)" if r.crossover_tokens is None
                 else f"{r.crossover_tokens:,} tokens (SSM state alone: {r.crossover_ssm_only_tokens:,})")
    larger = "KV cache" if r.kv_total >= r.mamba_total else "Mamba state"
    rows = [
        (f"KV cache ({r.kv_dtype}) per token", human_bytes(r.kv_per_token)),
        ("Mamba state per sequence", human_bytes(r.mamba_state_per_sequence)),
        (f"  SSM state ({r.state_dtype})", human_bytes(r.ssm_state_per_sequence)),
        (f"  conv state ({r.conv_dtype})", human_bytes(r.conv_state_per_sequence)),
        ("KV cache total", human_bytes(r.kv_total)),
        ("Mamba state total", human_bytes(r.mamba_total)),
        ("total", f"{human_bytes(r.total)}  ({larger} is larger)"),
        ("crossover (KV >= Mamba state)", crossover),
        ("engine slot (one sequence)", human_bytes(r.slot_bytes)),
    ]
    if r.budget_gib is not None:
        rows.append((f"slots in {r.budget_gib:g} GiB", f"{r.slots_in_budget:,} (and one row staging prefills)"))
        if r.kv_dtype != r.conv_dtype:
            # hybridtron's engine keeps both in the model's dtype; fp8 KV is the report's serving figure
            rows.append(("note", "the engine keeps KV cache and conv state in the model's dtype; for its slots pass "
                                 "that as --kv-dtype and --conv-dtype (fp32 on a CPU)"))
    header = (f"{name}: {r.attention_layers} attention layers, {r.mamba_layers} Mamba layers; "
              f"context {r.context:,}, batch {r.batch}")
    lines = [header] + [f"  {label + ':':<34}{value}" for label, value in rows]
    return "\n".join(lines)


def add_arguments(parser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="a built-in configuration (default: ultra3 when --config is not given)")
    parser.add_argument("--config", default=None,
                        help="a checkpoint directory, a run directory (its hf/ export) or a config.json instead of "
                             "--preset (default: none)")
    parser.add_argument("--context", type=int, default=None,
                        help="tokens per sequence (default: the model's max_position_embeddings)")
    parser.add_argument("--batch", type=int, default=1, help="sequences held at once (default: %(default)s)")
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default="fp8",
                        help="KV cache dtype (default: %(default)s)")
    parser.add_argument("--state-dtype", choices=STATE_DTYPES, default="fp32",
                        help="SSM state dtype (default: %(default)s)")
    parser.add_argument("--conv-dtype", choices=CONV_DTYPES, default="bf16",
                        help="conv state dtype (default: %(default)s)")
    parser.add_argument("--include-mtp", action="store_true", help="count the MTP block's attention KV cache too")
    parser.add_argument("--budget-gib", type=float, default=None,
                        help="also print how many engine slots (sequences decoding at once) fit in this much cache "
                             "memory, in GiB; with --include-mtp, a speculative engine's slots (default: none)")
    parser.add_argument("--weights", choices=WEIGHT_FORMATS, default=None,
                        help="print the checkpoint's weights in this format (and the others) per GPU and what that "
                             "leaves for activations and cache; alone, unless --context or --budget-gib asks for the "
                             "cache too (default: none)")
    parser.add_argument("--policy", choices=EXPORT_POLICIES, default="ultra",
                        help="with --weights: which weights are quantized (hybridtron quantize's --policy) "
                             "(default: %(default)s)")
    parser.add_argument("--gpus", type=int, default=8, help="with --weights: GPUs the weights are spread over "
                                                             "(default: %(default)s)")
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0,
                        help="with --weights: memory of one GPU in GiB (default: %(default)s, an H100)")
    parser.add_argument("--json", action="store_true", help="print the numbers as one JSON object")


def run(args) -> int:
    if args.preset and args.config:
        raise ValueError("give --preset or --config, not both")
    if args.config:
        config, name = read_model_config(args.config), args.config
    else:
        name = args.preset or "ultra3"
        config = preset(name)
    context = config.max_position_embeddings if args.context is None else args.context
    report = memory_report(config, context, args.batch, args.kv_dtype, args.state_dtype, args.conv_dtype,
                           args.include_mtp, args.budget_gib)
    rows = None if args.weights is None else weights_table(config, args.policy, args.gpus, args.gpu_memory_gib)
    # --weights alone asks about the checkpoint: its table only; --context or --budget-gib asks for the cache too
    cache = rows is None or args.context is not None or args.budget_gib is not None
    if args.json:
        print(json.dumps({**(asdict(report) if cache else {}),
                          **({"weights": [asdict(row) for row in rows]} if rows else {})}))
    else:
        if cache:
            print(format_report(report, name))
        if rows:
            print(format_weights(rows, args.weights, name))
    return 0
