"""`hybridtron eval`: a checkpoint's pass@k on the held-out (test-split) tasks of one or more environments.

    hybridtron eval --model runs/pipe/rlvr/hf --env math --levels 1,2 --tasks 200
    hybridtron eval --model DIR --env math,code --tasks 50 --samples 8 --temperature 1.0 --json result.json

Greedy decoding (one sample a task) by default, so pass@1 is one deterministic number per checkpoint; with
`--samples n` and a temperature, pass@k for k = 1, 2, 4, ... n (hybridtron.eval.tasks).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hybridtron.checkpoint import load_pretrained
from hybridtron.data.chat import load_chat_tokenizer
from hybridtron.envs import get_env
from hybridtron.eval.tasks import evaluate_env

THINKING = {"auto": None, "on": True, "off": False}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="an HF checkpoint directory with its tokenizer files and chat "
                                                       "template (required)")
    parser.add_argument("--env", default="math", help="environments, comma-separated: math, code (default: math)")
    parser.add_argument("--levels", help="difficulty levels, e.g. 1,2 (default: each environment's own)")
    parser.add_argument("--tasks", type=int, default=200, help="test-split tasks per environment (default: 200)")
    parser.add_argument("--samples", type=int, default=1, help="completions per task; above 1 needs --temperature "
                                                               "(default: 1)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    parser.add_argument("--max-tokens", type=int, default=256, help="completion length cap (default: 256)")
    parser.add_argument("--batch-size", type=int, default=32, help="prompts decoded together (default: 32)")
    parser.add_argument("--thinking", choices=tuple(THINKING), default="auto",
                        help="the generation prompt's thinking switch: auto (the model decides), on (opens <think>), "
                             "off (an empty <think></think>) (default: auto)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the task draw and of sampling (default: 0)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: 0, torch's)")
    parser.add_argument("--json", help="also write the results (and 5 sample completions per environment) to this "
                                       "file (default: none)")


def run(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    levels = {"levels": tuple(int(v) for v in args.levels.split(","))} if args.levels else {}
    model = load_pretrained(args.model, dtype=torch.float32)
    tokenizer = load_chat_tokenizer(args.model, vocab_size=model.config.vocab_size, require_template=True)
    results = {}
    for name in [n.strip() for n in args.env.split(",") if n.strip()]:
        with get_env(name, **levels) as env:
            tasks = env.tasks("test", args.tasks, args.seed)
            result = evaluate_env(model, tokenizer, env, tasks, samples=args.samples, max_tokens=args.max_tokens,
                                  batch_size=args.batch_size, temperature=args.temperature, seed=args.seed,
                                  enable_thinking=THINKING[args.thinking])
        print(f"{name} test ({args.levels or 'all levels'}): {result.format()}")
        results[name] = result.to_dict(samples=5)
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "levels": args.levels, **results}, indent=2))
    return 0
