"""RULER samples with their answers as a JSONL corpus (`{"text": prompt + answer}` a line), to train a model on a task
itself: the sanity row of BENCHMARKS.md's RULER table, which shows the scorer gives high scores when they are earned.

    python bench/ruler_needles.py --model runs/quickstart/hf --task niah_single_1 --length 256 --samples 4000 \\
        --out runs/needles.jsonl
    hybridtron pretrain --phase long_context --from runs/quickstart/hf --out runs/needle-sanity \\
        --set phase.lengths=2048 --set phase.shares=1.0 --set phase.sources=runs/needles.jsonl ...

The samples use seeds from --seed-offset on (default 1000), so they never repeat the evaluation's (seed 0).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hybridtron.data.tokenizer import Tokenizer
from hybridtron.eval.ruler import Haystack, generate_sample, task_spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the checkpoint whose tokenizer sizes the samples (required)")
    parser.add_argument("--task", default="niah_single_1", help="a RULER task (default: niah_single_1)")
    parser.add_argument("--length", type=int, default=512, help="tokens per sample, prompt + answer (default: 512)")
    parser.add_argument("--samples", type=int, default=3000, help="samples written (default: 3000)")
    parser.add_argument("--seed-offset", type=int, default=1000, help="first sample seed (default: 1000)")
    parser.add_argument("--out", required=True, help="the JSONL file to write (required)")
    args = parser.parse_args()
    tokenizer = Tokenizer.load(args.model)
    haystack = Haystack.stdlib() if task_spec(args.task).haystack == "text" else None
    with Path(args.out).open("w", encoding="utf-8") as out:
        for index in range(args.samples):
            sample = generate_sample(args.task, tokenizer, args.length, seed=args.seed_offset + index, index=0,
                                     haystack=haystack)
            out.write(json.dumps({"text": f"{sample.prompt} {', '.join(sample.references)}."}) + "\n")
    print(f"{args.samples} samples of {args.task} at {args.length} tokens -> {args.out}")


if __name__ == "__main__":
    main()
