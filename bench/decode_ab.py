"""Decode speed of this tree against another copy of hybridtron's source, interleaved: a refactor's before/after.

    cp -r src /tmp/before-src      # before changing anything
    ... change the code ...
    python bench/decode_ab.py --baseline /tmp/before-src --trained /tmp/bench-model --rounds 10

Two worker processes, one per source tree (`--baseline` and this tree's `src/`), one thread each, stay alive for the
whole run; the driver hands them the same case one after the other, round after round, alternating which goes
first, so a busy moment of a shared machine hits both sides alike. Each side keeps its fastest round (other jobs
only ever add time), measured on the process's CPU clock. Cases: eager and compiled greedy decode per token of
`tiny` and bench22m (prompt 32, (time of 65 tokens - time of 1) / 64, weights laid out for decoding); plain and
speculative decoding of the speculative section's bench model (`bench/decode.py --trained DIR`; skipped without
it), greedy and T = 1, 128 tokens; decode per token after a 4096-token prompt (hybrid and all-attention `tiny`).

The workers import whichever API their tree has: before issue 10 the decoder lived in `infer/generate.py`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = ["eager tiny", "eager bench22m", "compiled tiny", "compiled bench22m", "spec plain greedy",
         "spec k=3 greedy", "spec k=7 greedy", "spec plain T=1", "spec k=7 T=1", "context hybrid 4096",
         "context attention 4096"]


# ------------------------------------------------------------------------------------------------- worker
def worker(trained: str | None) -> None:
    import torch

    torch.set_num_threads(1)
    from hybridtron.checkpoint import load_pretrained, save_pretrained
    from hybridtron.config import ATTENTION, MAMBA, bench22m, tiny
    from hybridtron.infer.sampling import SamplingParams
    from hybridtron.infer.speculative import SpeculativeDecoder
    from hybridtron.model.lm import HybridLM
    try:
        from hybridtron.infer.decoder import Decoder
        from hybridtron.infer.fastpath import lay_out_for_decoding
    except ImportError:  # a tree from before issue 10
        from hybridtron.infer.generate import Decoder, lay_out_for_decoding

    def checkpointed(config):
        torch.manual_seed(0)
        model = HybridLM(config).eval()
        with tempfile.TemporaryDirectory() as directory:
            save_pretrained(model, directory)
            model = load_pretrained(directory).eval()
        lay_out_for_decoding(model)
        return model

    def run(decoder) -> float:
        started = time.process_time()
        for _ in decoder:
            pass
        return time.process_time() - started

    models = {"tiny": checkpointed(tiny()), "bench22m": checkpointed(bench22m())}
    prompt = torch.randint(3, 512, (32,), generator=torch.Generator().manual_seed(1)).tolist()

    def per_token(name: str, compile: bool = False, tokens: int = 64) -> float:
        def decode(n):
            return run(Decoder(models[name], [prompt], SamplingParams(temperature=0, max_tokens=n), compile=compile))
        return (decode(tokens + 1) - decode(1)) / tokens

    spec = None
    if trained:
        spec = load_pretrained(trained).eval()
        lay_out_for_decoding(spec)
    spec_prompt = torch.randint(3, 512, (16,), generator=torch.Generator().manual_seed(3)).tolist()

    def speculative(k: int, temperature: float) -> float:
        params = SamplingParams(temperature=temperature, max_tokens=128, seed=0)
        decoder = Decoder(spec, [spec_prompt], params) if k == 0 else \
            SpeculativeDecoder(spec, [spec_prompt], params, draft_length=k)
        return run(decoder) / 128

    long_decoders = {}

    def after_context(kind: str, context: int = 4096) -> float:
        if kind not in long_decoders:
            config = tiny(max_position_embeddings=context + 4096)
            if kind == "attention":
                config = config.replace(layers_block_type=tuple(ATTENTION if k == MAMBA else k
                                                               for k in config.layers_block_type))
            torch.manual_seed(0)
            model = HybridLM(config).eval()
            lay_out_for_decoding(model)
            ids = torch.randint(3, config.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
            decoder = Decoder(model, [ids.tolist()], SamplingParams(temperature=0, max_tokens=4000))
            decoder.step()
            decoder.step()
            long_decoders[kind] = decoder
        decoder = long_decoders[kind]
        started = time.process_time()
        for _ in range(16):
            decoder.step()
        return (time.process_time() - started) / 16

    cases = {
        "eager tiny": lambda: per_token("tiny"), "eager bench22m": lambda: per_token("bench22m"),
        "compiled tiny": lambda: per_token("tiny", True), "compiled bench22m": lambda: per_token("bench22m", True),
        "spec plain greedy": lambda: speculative(0, 0.0), "spec k=3 greedy": lambda: speculative(3, 0.0),
        "spec k=7 greedy": lambda: speculative(7, 0.0), "spec plain T=1": lambda: speculative(0, 1.0),
        "spec k=7 T=1": lambda: speculative(7, 1.0),
        "context hybrid 4096": lambda: after_context("hybrid"),
        "context attention 4096": lambda: after_context("attention"),
    }
    per_token("tiny", True)  # compile both graphs before anything is timed
    per_token("bench22m", True)
    print("ready", flush=True)
    for line in sys.stdin:
        case = line.strip()
        print(f"{min(cases[case]() for _ in range(2)) * 1e3:.4f}", flush=True)


# ------------------------------------------------------------------------------------------------- driver
def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="the other tree's source directory (holding hybridtron/)")
    parser.add_argument("--trained", default=None, help="bench/decode.py's trained bench model (speculative cases)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.trained)
    if not args.baseline or not (Path(args.baseline) / "hybridtron").is_dir():
        raise SystemExit(f"--baseline must be a source directory holding hybridtron/, got {args.baseline!r}")
    here = Path(__file__).resolve().parent.parent / "src"
    cases = [c for c in CASES if args.trained or not c.startswith("spec")]
    workers = {}
    for side, source in (("baseline", Path(args.baseline).resolve()), ("this tree", here)):
        command = [sys.executable, __file__, "--worker"] + (["--trained", args.trained] if args.trained else [])
        env = {**os.environ, "PYTHONPATH": str(source), "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp()}
        workers[side] = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    for side, process in workers.items():
        if process.stdout.readline().strip() != "ready":
            raise SystemExit(f"the {side} worker did not start")
    best = {(side, case): float("inf") for side in workers for case in cases}
    for round_ in range(args.rounds):
        for case in cases:
            for side in (list(workers) if round_ % 2 == 0 else list(reversed(workers))):
                workers[side].stdin.write(case + "\n")
                workers[side].stdin.flush()
                best[side, case] = min(best[side, case], float(workers[side].stdout.readline()))
        print(f"round {round_ + 1}/{args.rounds}", file=sys.stderr, flush=True)
    for process in workers.values():
        process.stdin.close()
        process.wait()
    print(f"{args.rounds} interleaved rounds, fastest round per side, CPU clock, 1 thread\n")
    print("| case | baseline ms/token | this tree ms/token | this tree / baseline |\n|---|---:|---:|---:|")
    for case in cases:
        before, after = best["baseline", case], best["this tree", case]
        print(f"| {case} | {before:.3f} | {after:.3f} | {after / before:.3f} |")


if __name__ == "__main__":
    main()
