#!/usr/bin/env bash
# The GPU check, as one command for a machine with a CUDA GPU (no package registry needed: it runs from src/ on the
# torch that machine has, with numpy, safetensors, tokenizers and pytest). About 9 minutes on one H200:
#
#   scripts/gpu_check.sh [OUT_DIR]     # default runs/gpu_check: summary.md and steps.log (every step's output) go
#                                      # there, the run directories under OUT_DIR/runs (or $GPU_CHECK_RUNS)
#
# Through this workplace's device tool, where only a few files come back:
#   GPU_CHECK_RUNS=/tmp/gpu_check_runs scripts/gpu_check.sh $OUT      (timeout_s 600)
#
# 1. the CUDA tests of the suite (the stochastic-rounding generators on the GPU);
# 2. `hybridtron pretrain` (tiny, 20 steps) as a plain CPU process and as one torchrun process on cuda:0, which is
#    the distributed path on a mesh of one with NCCL; the loss curves side by side (fp32 on both, so they differ
#    by float rounding in other kernels' orders, and by TF32 wherever torch's defaults let cuDNN use it), then the
#    same on CUDA with train.compile, bf16 and nvfp4, and with dist.offload_optimizer (FSDP2's CPU offload); then
#    tests/distributed/offload_worker.py on cuda:0 with and without the offload: where the master weights, gradients and
#    AdamW moments are (bytes by device, to compare with `hybridtron plan`'s) and what is left allocated on the GPU;
# 3. `hybridtron sft` on one torchrun process on cuda:0 from that export (a few steps);
# 4. bench/compile.py on cuda: eager against train.compile on bench22m, tokens/s and MFU against the measured peak,
#    in fp32 and in bf16 autocast.
# Each step is bounded by `timeout` and the script goes on past a failure; summary.md says what passed. On a machine
# without CUDA the torchrun runs are plain CPU processes and the benchmarks refuse to start: a dry run of the script.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/gpu_check}
runs=${GPU_CHECK_RUNS:-$out/runs}
mkdir -p "$out" "$runs"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HYBRIDTRON_CACHE="$runs/cache"
python=${PYTHON:-python3}
summary="$out/summary.md" log="$out/steps.log"
: >"$summary"
: >"$log"

step() {  # step NAME SECONDS COMMAND...: run it, its output appended to steps.log, one line in the summary
  local name=$1 limit=$2 started=$SECONDS
  shift 2
  echo "===== $name: $*" >>"$log"
  timeout "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  echo "- $name: $([ $rc = 0 ] && echo ok || echo "FAILED (exit $rc)") in $((SECONDS - started)) s" >>"$summary"
}

$python - >>"$summary" 2>&1 <<'EOF'
import platform, torch
print(f"# GPU check: torch {torch.__version__}, CUDA {torch.version.cuda}, Python {platform.python_version()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"- device: {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs, "
          f"capability {p.major}.{p.minor}")
else:
    print("- no CUDA device: the checks below that need one fail")
EOF

step cuda_tests 120 $python -m pytest -q -p no:cacheprovider tests/numerics/test_quant_linear.py -k gpu

tiny=(--preset tiny --quiet --steps 20 --set train.threads=4 --set train.checkpoint_every=10 --set data.seq_len=64
      --set data.val_batches=1 --set train.val_every=10)
torchrun=($python -m torch.distributed.run --standalone --nproc-per-node 1 -m hybridtron)
step pretrain_cpu 120 $python -m hybridtron pretrain --out "$runs/cpu" "${tiny[@]}"
step pretrain_cuda 120 "${torchrun[@]}" pretrain --out "$runs/cuda" "${tiny[@]}"
step pretrain_cuda_compile 150 "${torchrun[@]}" pretrain --out "$runs/cuda_compile" "${tiny[@]}" --set train.compile=true
step pretrain_cuda_bf16 90 "${torchrun[@]}" pretrain --out "$runs/cuda_bf16" "${tiny[@]}" --set train.precision=bf16
step pretrain_cuda_nvfp4 90 "${torchrun[@]}" pretrain --out "$runs/cuda_nvfp4" "${tiny[@]}" --set train.precision=nvfp4
step pretrain_cuda_offload 120 "${torchrun[@]}" pretrain --out "$runs/cuda_offload" "${tiny[@]}" \
    --set dist.offload_optimizer=true
$python - "$runs" >>"$summary" 2>&1 <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def losses(run):
    path = out / run / "metrics.jsonl"
    if not path.is_file():
        return None
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r}
reference = losses("cpu")
print("\n| run | final loss | max abs loss difference from the CPU run |\n|---|---:|---:|")
for run in ("cpu", "cuda", "cuda_compile", "cuda_bf16", "cuda_nvfp4", "cuda_offload"):
    got = losses(run)
    if got is None or reference is None:
        print(f"| {run} | - | no metrics |")
        continue
    gap = max(abs(got[s] - reference[s]) for s in reference if s in got)
    print(f"| {run} | {got[max(got)]:.4f} | {gap:.2e} |")
print()
EOF

step offload_placement 120 $python -m torch.distributed.run --standalone --nproc-per-node 1 \
    tests/distributed/offload_worker.py "$out/offload.json" steps=3 offload_optimizer=1,steps=3
$python - "$out/offload.json" >>"$summary" 2>&1 <<'EOF'
import json, sys
from pathlib import Path
path = Path(sys.argv[1])
if not path.is_file():
    sys.exit(print("- offload placement: no results"))
runs = json.loads(path.read_text())
print("| dist.offload_optimizer | master weights | gradients | AdamW moments | allocated on the GPU | loss at step 3 |")
print("|---|---|---|---|---:|---:|")
for text, run in runs.items():
    rank = run["ranks"][0]
    where = lambda kind: ", ".join(f"{n:,} B on {device}" for device, n in rank["bytes"][kind].items())
    print(f"| {'true' if 'offload' in text else 'false'} | {where('master')} | {where('grads')} | {where('moments')} "
          f"| {rank['device_allocated'] or 0:,} B | {run['steps'][-1]['losses']['loss']:.6f} |")
print(f"\n{runs[list(runs)[-1]]['describe']}\n")
EOF

step sft_cuda 90 "${torchrun[@]}" sft --model "$runs/cuda/hf" --data env:math --out "$runs/sft_cuda" --quiet \
    --steps 4
for precision in fp32 bf16; do  # bf16 on a longer batch: a GPU step of 4 x 512 tokens is too short to time well
  shape=$([ $precision = bf16 ] && echo "--batch 8 --seq 1024" || echo "")
  step "bench_compile_$precision" 200 $python bench/compile.py --device cuda --precision $precision $shape --repeats 10
  { echo; echo "## bench/compile.py --device cuda --precision $precision $shape"
    sed -n "/^===== bench_compile_$precision/,\$p" "$log" | grep -E '^(bench22m|fp32 |bf16 |\|)'; } >>"$summary"
done
cat "$summary"
