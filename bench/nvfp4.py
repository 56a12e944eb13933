"""NVFP4 numerics benchmarks, one section per question.

Section ``quantize``: quantize + dequantize of an N x N fp32 tensor (default 4096) with hybridtron's fast path
and with torchao's ``NVFP4Tensor`` (``to_nvfp4`` with ``per_tensor_scale = amax / (448*6)``, then
``dequantize``), on the CPU with a fixed thread count (2 by default). Before timing, it checks:
  - hybridtron's fast path equals its TE-chain reference bit for bit (codes, scale bytes, dequantized values),
    and the fused ``fake_quantize`` equals quantize -> dequantize bit for bit;
  - against torchao: scale bytes identical, E2M1 codes identical except where torchao's element multiplier
    ``(1/pts)/s_b`` and TE's ``1/(s_b*S_dec)`` differ by an ulp at a decision threshold (counted), and the
    dequantized values are reported (torchao rounds ``pts * s_b`` first, so the last bit can differ).
Each repetition times torchao and hybridtron back to back, so both see the same machine load; the table gives
the median and the minimum over repetitions.

    python bench/nvfp4.py                          # all sections
    python bench/nvfp4.py --section quantize --size 4096 --repeats 7 --threads 2
    python bench/nvfp4.py --clock cpu --threads 1      # on a busy machine: this process's CPU time

New sections (e.g. the bf16 / mxfp8 / nvfp4 training-step comparison) are functions ``(args) -> None``
registered in ``SECTIONS``; their options go in ``add_arguments``.
"""

from __future__ import annotations

import argparse
import statistics
import warnings

import torch

from hybridtron.numerics import nvfp4

import clock
from clock import timed



def _check_against_reference(x: torch.Tensor) -> None:
    q, q_ref = nvfp4.quantize(x), nvfp4.quantize_ref(x)
    assert torch.equal(q.codes, q_ref.codes), "fast codes differ from the TE-chain reference"
    assert torch.equal(q.scales, q_ref.scales), "fast scale bytes differ from the TE-chain reference"
    dq = nvfp4.dequantize(q)
    assert torch.equal(dq.view(torch.int32), nvfp4.dequantize_ref(q_ref).view(torch.int32))
    assert torch.equal(nvfp4.fake_quantize(x).view(torch.int32), dq.view(torch.int32))
    print("hybridtron fast path == TE-chain reference: codes, scale bytes, dequantized values bit-identical")


def _compare_with_torchao(x: torch.Tensor, torchao_quantize) -> None:
    q = nvfp4.quantize(x)
    ao = torchao_quantize(x)
    scale_diff = int((q.scales != ao.scale.view(torch.uint8)).sum())
    assert scale_diff == 0, f"{scale_diff} scale bytes differ from torchao"
    codes, ao_codes = nvfp4.unpack_codes(q.codes), nvfp4.unpack_codes(ao.qdata.view(torch.uint8))
    code_diff = int((codes != ao_codes).sum())
    assert code_diff <= x.numel() // 1_000_000 + 2, f"{code_diff} codes differ from torchao"
    dq, ao_dq = nvfp4.dequantize(q), ao.dequantize(torch.float32)
    value_diff = int((dq != ao_dq).sum())
    max_rel = float(((dq - ao_dq).abs() / ao_dq.abs().clamp(min=1e-30))[codes == ao_codes].max())
    print(
        f"vs torchao: scale bytes identical; codes differ at {code_diff} of {x.numel()} elements (encode-scale "
        f"ulp at a threshold); dequantized values differ at {value_diff} ({value_diff / x.numel():.1%}), "
        f"max relative difference where codes agree {max_rel:.1e}"
    )


def bench_quantize(args: argparse.Namespace) -> None:
    """quantize + dequantize of an N x N fp32 tensor: hybridtron vs torchao."""
    warnings.filterwarnings("ignore")  # torchao's import-time notices about CUDA kernels
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    def torchao_quantize(t: torch.Tensor):
        return NVFP4Tensor.to_nvfp4(t, per_tensor_scale=per_tensor_amax_to_scale(t.abs().max()))

    x = torch.randn(args.size, args.size, generator=torch.Generator().manual_seed(0))
    if args.check_ref:
        _check_against_reference(x)
    _compare_with_torchao(x, torchao_quantize)

    gen = torch.Generator().manual_seed(0)
    q = nvfp4.quantize(x)
    cases = {
        "torchao quantize+dequantize": lambda: torchao_quantize(x).dequantize(torch.float32),
        "hybridtron quantize+dequantize": lambda: nvfp4.dequantize(nvfp4.quantize(x)),
        "hybridtron quantize": lambda: nvfp4.quantize(x),
        "hybridtron dequantize": lambda: nvfp4.dequantize(q),
        "hybridtron fake_quantize (RNE)": lambda: nvfp4.fake_quantize(x),
        "hybridtron fake_quantize (SR)": lambda: nvfp4.fake_quantize(x, stochastic_rounding=True, generator=gen),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():  # warm-up
        fn()
    for _ in range(args.repeats):
        for name, fn in cases.items():
            times[name].append(timed(fn))

    print(f"\n{args.size}x{args.size} fp32, {torch.get_num_threads()} threads, {args.repeats} repetitions\n")
    print("| case | median ms | min ms |")
    print("|---|---:|---:|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts) * 1e3:.1f} | {min(ts) * 1e3:.1f} |")
    ours, theirs = times["hybridtron quantize+dequantize"], times["torchao quantize+dequantize"]
    print(
        f"\nspeedup over torchao (quantize+dequantize): {statistics.median(theirs) / statistics.median(ours):.1f}x "
        f"(median), {min(theirs) / min(ours):.1f}x (min)"
    )


def bench_train_step(args: argparse.Namespace) -> None:
    """Training step (forward, backward, AdamW) of the tiny preset in each precision; goal: nvfp4 <= 2x bf16."""
    import contextlib

    from hybridtron.config import tiny
    from hybridtron.model.lm import HybridLM
    from hybridtron.numerics.policy import apply_precision

    # (label, converter arguments or None, bf16 autocast): "bf16 autocast" is train.precision=bf16 of
    # `hybridtron pretrain`; "bf16 GEMMs" is the converter's bf16 recipe (the reference arm of `hybridtron branch`).
    cases = [("fp32", None, False), ("bf16 autocast", None, True), ("bf16 GEMMs (emulated)", ("bf16", "all"), False),
             ("mxfp8 (ultra policy)", ("mxfp8", "ultra"), False), ("nvfp4 (ultra policy)", ("nvfp4", "ultra"), False),
             ("nvfp4 (all)", ("nvfp4", "all"), False)]
    ids = torch.randint(0, tiny().vocab_size, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    inputs, labels = ids[:, :-1], ids[:, 1:]
    steps = {}
    for label, conversion, autocast in cases:
        torch.manual_seed(0)
        model = HybridLM(tiny())
        if conversion is not None:
            apply_precision(model, *conversion)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)

        def step(model=model, optimizer=optimizer, autocast=autocast):
            context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
            with context:
                loss = model(inputs, labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step()  # warm-up: allocations, optimizer state
        steps[label] = step
    times: dict[str, list[float]] = {label: [] for label in steps}
    for _ in range(args.repeats):
        for label, step in steps.items():
            times[label].append(timed(step))

    tokens = args.batch * args.seq
    base_autocast = statistics.median(times["bf16 autocast"])
    base_gemms = statistics.median(times["bf16 GEMMs (emulated)"])
    print(f"\ntiny preset, batch {args.batch} x {args.seq} tokens, {torch.get_num_threads()} threads, "
          f"{args.repeats} repetitions (median; min)\n")
    print("| precision | step ms (median) | min ms | tokens/s | vs bf16 autocast | vs bf16 GEMMs |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, ts in times.items():
        median = statistics.median(ts)
        print(f"| {label} | {median * 1e3:.0f} | {min(ts) * 1e3:.0f} | {tokens / median:.0f} | "
              f"{median / base_autocast:.2f}x | {median / base_gemms:.2f}x |")
    ratio = statistics.median(times["nvfp4 (ultra policy)"]) / min(base_autocast, base_gemms)
    print(f"\nnvfp4 (ultra policy) / fastest bf16 step: {ratio:.2f}x (goal: <= 2x)")
    if ratio > 2 or args.profile:
        from torch.profiler import profile

        with profile() as prof:
            steps["nvfp4 (ultra policy)"]()
        print("\nwhere an nvfp4 step's time goes (self CPU time, top 15 ops):\n")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


SECTIONS = {"quantize": bench_quantize, "train_step": bench_train_step}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--section", choices=sorted(SECTIONS), action="append", help="run only these sections")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    clock.add_clock_argument(parser)
    parser.add_argument("--repeats", type=int, default=7, help="timed repetitions per case (default 7)")
    parser.add_argument("--size", type=int, default=4096, help="quantize: the tensor is size x size (default 4096)")
    parser.add_argument("--batch", type=int, default=8, help="train_step: sequences per step (default 8)")
    parser.add_argument("--seq", type=int, default=256, help="train_step: tokens per sequence (default 256)")
    parser.add_argument("--profile", action="store_true", help="train_step: profile an nvfp4 step even within goal")
    parser.add_argument(
        "--no-check-ref", dest="check_ref", action="store_false", help="quantize: skip the (slow) reference check"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.threads < 1 or args.repeats < 1 or args.size < 16:
        parser.error("--threads and --repeats must be >= 1 and --size >= 16")
    torch.set_num_threads(args.threads)
    clock.select(args.clock)
    print(f"torch {torch.__version__}, torch.set_num_threads({args.threads}), {args.clock} clock")
    for name in args.section or list(SECTIONS):
        print(f"## {name}: {SECTIONS[name].__doc__}")
        SECTIONS[name](args)


if __name__ == "__main__":
    main()
