"""`train.compile` against eager: the fp32 training step of bench22m, side by side, with tokens/s and MFU.

    python bench/compile.py [--threads 1] [--clock cpu] [--repeats 5] [--batch 4] [--seq 512] [--logits]
                            [--gemm-share] [--blocks] [--device cuda] [--precision bf16]

Two copies of the same model (same weights, same batch): one eager with foreach AdamW (what `hybridtron pretrain`
runs by default), one as `train.compile=true` runs it (every block, the MTP block included, compiled in place by
`hybridtron.distributed.parallelize`; torch's fused AdamW). A step is the objective's forward + backward + the optimizer
step; both apply lm_head inside the loss (`ops/linear_cross_entropy.py`, eager in both), and `--logits` adds both
steps with the loss on the model's logits instead (the compiled one on the same compiled modules). The compiled copy
is warmed up first (its compile time is reported apart); then the repetitions alternate the steps, so all see the
same machine load, and the table reports medians and their ratio to the eager step. MFU is against the matmul
peak of the precision used (`--precision`: fp32, or bf16 autocast as `train.precision=bf16` runs it) measured in the
same run on the same device and clock (`bench/pretrain.py`'s model FLOPs per token). `--device cuda` runs both
copies on a GPU (every step and matmul timed to its end with a synchronize). `--gemm-share`
profiles one more eager step and reports the share of it spent in GEMM kernels, which compile runs unchanged:
eager / (those GEMMs alone) is the most any compile of the step could give. `--blocks` also times one block of
each kind (and the MTP block, if the model has one) alone, forward + backward of the sum of its output, eager against
compiled, the medians of `--repeats`: where the step's gain comes from, and what stays eager (the loss).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from hybridtron.config import bench22m
from hybridtron.distributed.parallelize import parallelize
from hybridtron.model.lm import HybridLM
from hybridtron.train.config import TrainConfig
from hybridtron.train.loop import build_optimizer
from hybridtron.train.objectives import PretrainObjective

import clock
from clock import timed
from pretrain import finished, matmul_peak, model_flops_per_token


def autocast(device: torch.device, precision: str):
    """bf16 autocast as the Trainer runs `train.precision=bf16`; a no-op context for fp32."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def make_step(model, compiled: bool, ids, labels, fused_head: bool = True, precision: str = "fp32"):
    optimizer = build_optimizer(model, TrainConfig(lr=1e-4, compile=compiled))  # compiled: fused AdamW
    # fused_head=False: the loss reads the model's logits (compiled: through the compiled cross entropy)
    objective = PretrainObjective(compile_loss=compiled, fused_head=fused_head)
    def step():
        objective.begin_step([(ids, labels)])
        with autocast(ids.device, precision):
            out = objective(model, (ids, labels))
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return out.loss.detach()

    return finished(step, ids.device)


GEMM_OPS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::addbmm",
            "aten::_grouped_mm")


def gemm_share(step) -> tuple[float, float]:
    """(seconds of one call of `step`, seconds of it inside GEMM kernels), from the profiler's self times."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    gemm = sum(e.self_cpu_time_total for e in events if e.key in GEMM_OPS)
    return total / 1e6, gemm / 1e6


def block_times(model, batch: int, seq: int, repeats: int, precision: str) -> list[tuple[str, float, float]]:
    """(block kind, eager seconds, compiled seconds) of one block of each kind, forward + backward alone."""
    from hybridtron.distributed.parallelize import _all_blocks, _get

    device = next(model.parameters()).device
    hidden = torch.randn(batch, seq, model.config.hidden_size, requires_grad=True, device=device)
    next_embedding = torch.randn(batch, seq, model.config.hidden_size, device=device)
    seen, rows = set(), []
    for parent, key in _all_blocks(model):
        block = _get(parent, key)
        kind = getattr(block, "kind", "mtp")
        if kind in seen:
            continue
        seen.add(kind)

        def run(module):
            # one MTP depth reads the previous depth's hidden states and the next tokens' embeddings
            with autocast(device, precision):
                out = module(hidden, next_embedding) if kind == "mtp" else module(hidden)
            (out[0] if isinstance(out, tuple) else out).float().sum().backward()

        compiled = copy.deepcopy(block)
        compiled.compile()
        for module in (block, compiled, block, compiled):  # warm-up (and compile)
            run(module)
        times = {id(block): [], id(compiled): []}
        for _ in range(repeats):
            for module in (block, compiled):
                times[id(module)].append(timed(finished(lambda: run(module), device)))
        rows.append((kind, statistics.median(times[id(block)]), statistics.median(times[id(compiled)])))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--logits", action="store_true",
                        help="also time both steps with the loss on the model's logits (no fused lm_head + loss)")
    parser.add_argument("--gemm-share", action="store_true",
                        help="also profile an eager step: its GEMM time, the bound on any compile's speedup")
    parser.add_argument("--blocks", action="store_true",
                        help="also time one block of each kind alone, eager against compiled")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="fp32 (default) or bf16 autocast; MFU is against the peak of the same precision")
    clock.add_clock_argument(parser)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this machine has no CUDA device")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device {args.device}: expected cpu, cuda or cuda:N")
    if args.gemm_share and device.type != "cpu":
        parser.error("--gemm-share profiles CPU kernels; run it with --device cpu")
    if args.clock == "cpu" and device.type != "cpu":
        parser.error("--clock cpu counts this process's CPU time, not the GPU's; use the wall clock with --device cuda")
    clock.select(args.clock)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    eager = HybridLM(bench22m()).to(device)
    compiled = parallelize(copy.deepcopy(eager), None, compile=True)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, eager.config.vocab_size, (args.batch, args.seq), generator=generator).to(device)
    labels = torch.roll(ids, -1, dims=1)

    def step_of(model, compiled_step: bool, **options):
        return make_step(model, compiled_step, ids, labels, precision=args.precision, **options)

    steps = {"eager": step_of(eager, False), "compiled": step_of(compiled, True)}
    if args.logits:
        steps["eager, logits"] = step_of(copy.deepcopy(eager), False, fused_head=False)
        steps["compiled, logits"] = step_of(compiled, True, fused_head=False)  # its own optimizer
    eager_step, compiled_step = steps["eager"], steps["compiled"]

    started = time.perf_counter()
    first = compiled_step()
    compile_s = time.perf_counter() - started
    eager_loss = eager_step()
    assert torch.allclose(first, eager_loss, rtol=1e-4 if args.precision == "fp32" else 2e-2), \
        (float(first), float(eager_loss))
    compiled_step()  # a second call: anything recompiled for the second step's state is done too
    for name in list(steps)[2:]:  # the logits steps' warm-up (their compiled cross entropy compiles here)
        steps[name]()
        steps[name]()
    times = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            times[name].append(timed(step))
    peak = matmul_peak({"fp32": torch.float32, "bf16": torch.bfloat16}[args.precision], device)
    flops = model_flops_per_token(eager, args.seq)
    tokens = args.batch * args.seq
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{args.threads} thread(s)"
    print(f"bench22m {args.precision}, batch {args.batch}x{args.seq}, {where}, {args.clock} clock, "
          f"{args.repeats} repeats; compile (first step): {compile_s:.0f} s wall")
    print(f"{args.precision} matmul peak {peak / 1e9:.0f} GFLOP/s; {flops / 1e6:.1f} MFLOP per token\n")
    print(f"| step | median (s) | tokens/s | MFU vs {args.precision} peak | speedup |")
    print("|---|---:|---:|---:|---:|")
    base = statistics.median(times["eager"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.3f} | {tokens / median:.0f} | {tokens / median * flops / peak:.0%} | "
              f"{base / median:.2f}x |")
    if args.gemm_share:
        total, gemm = gemm_share(eager_step)
        print(f"\neager step profiled: {total:.3f} s, {gemm:.3f} s in GEMM kernels ({gemm / total:.0%}); a step of "
              f"those GEMMs alone would be {total / gemm:.2f}x the eager step")
    if args.blocks:
        print("\n| block (forward + backward alone) | eager (ms) | compiled (ms) | speedup |")
        print("|---|---:|---:|---:|")
        for kind, eager_s, compiled_s in block_times(eager, args.batch, args.seq, args.repeats, args.precision):
            print(f"| {kind} | {eager_s * 1e3:.1f} | {compiled_s * 1e3:.1f} | {eager_s / compiled_s:.2f}x |")


if __name__ == "__main__":
    main()
