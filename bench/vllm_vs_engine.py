"""vLLM against hybridtron's engine on the quickstart-size dense model: decode tokens/s at batch 1, 8 and 32, and
prefill tokens/s, side by side in one run, on this machine's CPU.

The model: the `tiny-dense` preset (the quickstart's `tiny` with dense MLP layers instead of MoE, what vLLM's CPU
backend runs), random weights, fp32, saved as an HF export with a tokenizer (both engines load the same directory).
hybridtron's engine (`HybridEngine`) runs in this process; vLLM (`vllm.LLM`, eager: `enforce_eager=True`, its engine
core in a process of its own as by default) in a subprocess of the vLLM environment's Python (.venv-vllm,
scripts/setup_vllm.sh), which runs this file with `--vllm-side`. Both decode plainly (no MTP drafting: vLLM's CPU
backend cannot draft for a Mamba hybrid) and greedily, with the same thread count (`--threads`).

Workload: prompts of `--prompt-tokens` random token ids (no special tokens), batch B of distinct prompts.
Decode tokens/s at batch B = (tokens generated with `--new-tokens` N - with 1) / (time for N - time for 1), so the
prefill cancels out; vLLM ignores end tokens, hybridtron's engine stops at one (the tokens are counted, not assumed).
Prefill tokens/s = 8 prompts of `--prefill-tokens` tokens, one new token each, tokens / time. Each run is repeated
(`--repeats`) and its fastest repetition kept (other processes only ever add time), the 1-token and the N-token runs
each. The greedy tokens of both engines on
the first prompt must agree (the same model) before anything counts.

    python bench/vllm_vs_engine.py                 # 1 thread; prints the CPU, the load and the table
    python bench/vllm_vs_engine.py --threads 2

Without the vLLM environment it stops with one line naming the fix; the vLLM side's failure prints the end of its log.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from clock import cpu_line

BATCHES = (1, 8, 32)
PREFILL_BATCH = 8
FIRST_ID = 16  # past the special tokens: a random prompt holds none


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_ID, vocab) for _ in range(length)] for _ in range(count)]


def workload(args, vocab: int) -> dict:
    return {"decode": {b: prompts(b, args.prompt_tokens, vocab, seed=b) for b in BATCHES},
            "prefill": prompts(PREFILL_BATCH, args.prefill_tokens, vocab, seed=1000)}


def measure(generate, work: dict, new_tokens: int, repeats: int) -> dict:
    """`generate(prompts, max_tokens)` -> token lists; the side's numbers (module docstring)."""
    generate(work["decode"][1], 4)  # warm-up
    out = {"decode": {}, "greedy": generate(work["decode"][1], 16)[0]}
    for batch, batch_prompts in work["decode"].items():
        fastest = {}  # max_tokens -> (seconds, tokens generated) of its fastest repetition
        for _ in range(repeats):
            for tokens in (1, new_tokens):
                start = time.perf_counter()
                generated = generate(batch_prompts, tokens)
                row = (time.perf_counter() - start, sum(len(g) for g in generated))
                fastest[tokens] = min(fastest.get(tokens, row), row)
        (t1, n1), (tn, nn) = fastest[1], fastest[new_tokens]
        out["decode"][batch] = (nn - n1) / (tn - t1)
    best = None
    for _ in range(repeats):
        start = time.perf_counter()
        generate(work["prefill"], 1)
        rate = PREFILL_BATCH * len(work["prefill"][0]) / (time.perf_counter() - start)
        best = rate if best is None else max(best, rate)
    out["prefill"] = best
    return out


# ------------------------------------------------------------------------------------------------ the vLLM side
def vllm_side(job_file: str, out_file: str) -> None:
    from vllm import LLM, SamplingParams

    job = json.loads(Path(job_file).read_text())
    # no prefix caching: vLLM 0.32's CPU backend fails a batch of long prompts with it on a Mamba hybrid ("index 39
    # is out of bounds" in mamba_mixer2.py's varlen states, 8 prompts of 512 tokens), and the prompts share nothing
    llm = LLM(job["model"], dtype="float32", enforce_eager=True, seed=0, max_model_len=job["max_model_len"],
              max_num_seqs=max(BATCHES), enable_prefix_caching=False)

    def generate(batch_prompts, max_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        results = llm.generate([{"prompt_token_ids": p} for p in batch_prompts], params, use_tqdm=False)
        return [list(r.outputs[0].token_ids) for r in results]

    work = {"decode": {int(b): p for b, p in job["work"]["decode"].items()}, "prefill": job["work"]["prefill"]}
    Path(out_file).write_text(json.dumps(measure(generate, work, job["new_tokens"], job["repeats"])))


def run_vllm(args, model_dir: Path, work: dict, scratch: Path) -> dict:
    from hybridtron.post.rl.engines.vllm import PYTHON_ENV, vllm_python

    python = vllm_python()
    if not python.exists():
        raise SystemExit(f"vllm_vs_engine: no vLLM environment at {python}; create it with ./scripts/setup_vllm.sh "
                         f"(or point {PYTHON_ENV} at a Python that imports vllm)")
    job = {"model": str(model_dir), "work": work, "new_tokens": args.new_tokens, "repeats": args.repeats,
           "max_model_len": args.prefill_tokens + args.new_tokens + 8}
    (scratch / "job.json").write_text(json.dumps(job))
    # the engine core in its own process, as vLLM runs by default: in its caller's process
    # (VLLM_ENABLE_V1_MULTIPROCESSING=0, bound to core 0) a decode step took 0.15-0.2 s against 3 ms on this machine
    # under a load average of 14 (2-3 ms both ways when idle). One thread: vLLM's own binding (the worker on core 0,
    # a core kept for the front end); more: bound to cores 0..threads-1
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    if args.threads > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{args.threads - 1}"
    log = scratch / "vllm.log"
    with open(log, "w") as out:
        done = subprocess.run([str(python), __file__, "--vllm-side", str(scratch / "job.json"),
                               str(scratch / "out.json")], stdout=out, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise SystemExit(f"vllm_vs_engine: the vLLM side exited {done.returncode} ({log}):\n{tail}")
    return json.loads((scratch / "out.json").read_text())


# ------------------------------------------------------------------------------------------ hybridtron's side
def build_model(directory: Path, seed: int) -> int:
    """The tiny-dense export both engines load; returns its vocabulary size."""
    import torch

    from hybridtron.checkpoint.hf import save_pretrained
    from hybridtron.config import preset
    from hybridtron.data.chat import save_tokenizer_files
    from hybridtron.data.tokenizer import Tokenizer
    from hybridtron.model.lm import HybridLM

    config = preset("tiny-dense")
    texts = [path.read_text(errors="replace") for path in sorted(Path(os.__file__).parent.glob("*.py"))[:200]]
    tokenizer = Tokenizer.train(texts, config.vocab_size)
    torch.manual_seed(seed)
    save_pretrained(HybridLM(config).eval(), directory)
    save_tokenizer_files(tokenizer, directory)
    return config.vocab_size


def run_hybridtron(args, model_dir: Path, work: dict) -> dict:
    import torch

    from hybridtron.infer.engine import load_engine
    from hybridtron.infer.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    engine = load_engine(model_dir, speculative=False, dtype=torch.float32, max_slots=max(BATCHES))

    def generate(batch_prompts, max_tokens):
        completions = engine.generate(batch_prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                                      logprobs=False)
        return [row[0].token_ids for row in completions]

    return measure(generate, work, args.new_tokens, args.repeats)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--vllm-side":
        vllm_side(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="threads of each engine (default: 1)")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="prompt length of the decode runs (128)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per sequence (64)")
    parser.add_argument("--prefill-tokens", type=int, default=512, help="prompt length of the prefill run (512)")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions of each measurement, fastest kept (3)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vllm-vs-engine-") as scratch:
        scratch = Path(scratch)
        vocab = build_model(scratch / "model", args.seed)
        work = workload(args, vocab)
        print(f"{cpu_line()}; {args.threads} thread(s) each", flush=True)
        ours = run_hybridtron(args, scratch / "model", work)
        theirs = run_vllm(args, scratch / "model", work, scratch)
        print(f"{cpu_line()}; {args.threads} thread(s) each")
    if ours["greedy"] != theirs["greedy"]:
        raise SystemExit(f"vllm_vs_engine: the engines' greedy tokens differ on the same model: {ours['greedy']} "
                         f"against vLLM's {theirs['greedy']}")
    decode = "  ".join(f"decode b{b:<2} tok/s" for b in BATCHES)
    print(f"\n{'engine':<12}{decode}  prefill tok/s")
    for name, side in (("hybridtron", ours), ("vllm", theirs)):
        cells = "  ".join(f"{side['decode'][b if name == 'hybridtron' else str(b)]:>16.0f}" for b in BATCHES)
        print(f"{name:<12}{cells}  {side['prefill']:>13.0f}")
    ratios = "  ".join(f"{ours['decode'][b] / theirs['decode'][str(b)]:>15.2f}x" for b in BATCHES)
    print(f"{'ratio':<12}{ratios}  {ours['prefill'] / theirs['prefill']:>12.2f}x")


if __name__ == "__main__":
    main()
