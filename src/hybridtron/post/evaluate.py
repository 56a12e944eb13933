"""A policy's score on an environment's tasks: the held-out accuracy that every post-training stage reports.

Each task's prompt (`env.prompt_messages(task)`: the environment's system prompt and the task) is rendered in the
chat format with the generation prompt (`<|im_start|>assistant\\n`, plus the thinking switch `enable_thinking`),
the model continues it with hybridtron.infer's batched `generate_tokens` until `<|im_end|>` (or `max_tokens`), and the
environment grades the completion (`env.rewards`: math takes the last `\\boxed{}` after `</think>`; code the
share of hidden tests passed). Greedy decoding by default, so pass@1 is one deterministic number per model.

    pass_at_1     share of tasks with reward 1 (solved)
    mean_reward   mean reward (equal to pass_at_1 where rewards are 0 or 1, as in math)
    by_difficulty pass@1 per difficulty level

`python -m hybridtron.post.evaluate --model DIR --env math --levels 1,2 --tasks 200` prints it for a checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Sequence

from hybridtron.data.tokenizer import IM_END, THINK_START


@dataclass
class EnvEvaluation:
    tasks: int
    pass_at_1: float
    mean_reward: float
    by_difficulty: dict[int, float]
    mean_completion_tokens: float
    truncated_share: float  # completions cut at max_tokens (they never closed their turn)
    seconds: float
    completions: list[str] = field(repr=False)
    rewards: list[float] = field(repr=False)

    def format(self) -> str:
        levels = ", ".join(f"L{level} {value:.1%}" for level, value in sorted(self.by_difficulty.items()))
        return (f"pass@1 {self.pass_at_1:.1%} on {self.tasks} tasks ({levels}); mean reward {self.mean_reward:.3f}; "
                f"{self.mean_completion_tokens:.0f} tokens a completion, {self.truncated_share:.0%} cut at max_tokens; "
                f"{self.seconds:.0f}s")

    def to_dict(self, samples: int = 0) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("completions", "rewards")}
        if samples:
            out["samples"] = [{"completion": c, "reward": r} for c, r in zip(self.completions[:samples],
                                                                            self.rewards[:samples])]
        return out


def evaluate_env(model, tokenizer, env, tasks: Sequence, *, max_tokens: int = 256, batch_size: int = 32,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 enable_thinking: bool | None = None, speculative: bool = False) -> EnvEvaluation:
    """Generate one completion per task (greedy unless `temperature` > 0) and grade it with `env`. `model` is put
    in eval mode. A sampled completion depends on its task, its place in `tasks` and `seed`, not on `batch_size`:
    a task listed k times gets k independent samples."""
    from hybridtron.data.chat import tokenize_chat
    from hybridtron.infer.engine import generate_tokens
    from hybridtron.infer.sampling import SamplingParams

    if not tasks:
        raise ValueError("evaluate_env: no tasks")
    if batch_size < 1:
        raise ValueError(f"evaluate_env: batch_size must be >= 1, got {batch_size}")
    started = time.perf_counter()
    model.eval()
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, max_tokens=max_tokens,
                            stop_token_ids=(tokenizer.token_id(IM_END), tokenizer.eos_id))
    # the opening the generation prompt wrote belongs to the completion the grader reads
    opening = THINK_START + "\n" if enable_thinking is True else ""
    prompts = [tokenize_chat(tokenizer, env.prompt_messages(task), add_generation_prompt=True,
                             enable_thinking=enable_thinking).ids.tolist() for task in tasks]
    completions, lengths, truncated = [], [], 0
    for start in range(0, len(prompts), batch_size):
        for tokens in generate_tokens(model, prompts[start:start + batch_size], params, speculative=speculative,
                                      first_sample=start):
            stopped = bool(tokens) and tokens[-1] in params.stop_token_ids
            truncated += not stopped
            text = tokenizer.decode(tokens[:-1] if stopped else tokens)
            completions.append(opening + text)
            lengths.append(len(tokens))
    rewards = env.rewards(list(tasks), completions)
    solved = [reward == 1.0 for reward in rewards]
    levels: dict[int, list[bool]] = {}
    for task, ok in zip(tasks, solved):
        levels.setdefault(task.difficulty, []).append(ok)
    return EnvEvaluation(
        tasks=len(tasks), pass_at_1=sum(solved) / len(tasks), mean_reward=sum(rewards) / len(tasks),
        by_difficulty={level: sum(v) / len(v) for level, v in sorted(levels.items())},
        mean_completion_tokens=sum(lengths) / len(lengths), truncated_share=truncated / len(tasks),
        seconds=time.perf_counter() - started, completions=completions, rewards=rewards)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridtron.post.evaluate", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an HF checkpoint directory with its tokenizer files")
    parser.add_argument("--env", default="math", help="environment name (default: math)")
    parser.add_argument("--levels", help="difficulty levels, e.g. 1,2 (default: the environment's)")
    parser.add_argument("--tasks", type=int, default=200, help="tasks of the test split (default: 200)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the task draw and of sampling (default: 0)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--thinking", choices=("auto", "on", "off"), default="auto",
                        help="the generation prompt's thinking switch: auto (the model decides), on (opens "
                             "<think>), off (an empty <think></think>)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument("--json", help="also write the result (and 5 sample completions) to this file")
    args = parser.parse_args(argv)

    import torch

    from hybridtron.checkpoint import load_pretrained
    from hybridtron.data.chat import load_chat_tokenizer
    from hybridtron.post.envs import get_env

    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        model = load_pretrained(args.model, dtype=torch.float32)
        tokenizer = load_chat_tokenizer(args.model, vocab_size=model.config.vocab_size)
        options = {"levels": tuple(int(v) for v in args.levels.split(","))} if args.levels else {}
        with get_env(args.env, **options) as env:
            tasks = env.tasks("test", args.tasks, args.seed)
            result = evaluate_env(model, tokenizer, env, tasks, max_tokens=args.max_tokens,
                                  batch_size=args.batch_size, temperature=args.temperature, seed=args.seed,
                                  enable_thinking={"auto": None, "on": True, "off": False}[args.thinking])
    except (ValueError, FileNotFoundError) as exc:
        print(f"evaluate: error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.model} on {args.env} test ({args.levels or 'all levels'}): {result.format()}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"model": args.model, "env": args.env, "levels": args.levels, **result.to_dict(samples=5)},
                      handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
