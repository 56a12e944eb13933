"""A policy's score on an environment's tasks: the held-out accuracy that every post-training stage reports.

Each task's prompt (`env.prompt_messages(task)`: the environment's system prompt and the task) is rendered in the
chat format with the generation prompt (`<|im_start|>assistant\\n`, plus the thinking switch `enable_thinking`),
the model continues it with hybridtron.infer's batched `generate_tokens` until `<|im_end|>` (or `max_tokens`), and the
environment grades the completion (`env.rewards`: math takes the last `\\boxed{}` after `</think>`; code the
share of hidden tests passed). Greedy decoding by default, so pass@1 is one deterministic number per model.

    pass_at_1     share of tasks with reward 1 (solved); with `samples` n > 1, the mean over tasks of c / n
    pass_at_k     {k: the unbiased estimate of pass@k} for k = 1, 2, 4, ... up to n (Chen et al. 2021: the chance
                  that at least one of k samples drawn from the task's n is solved, 1 - C(n - c, k) / C(n, k))
    mean_reward   mean reward (equal to pass_at_1 where rewards are 0 or 1, as in math)
    by_difficulty pass@1 per difficulty level

A completion that never closed its turn was cut: at `max_tokens` (`truncated_share`), or earlier by the model's
context (`context_cut_share`: prompt + completion reached max_position_embeddings; `hybridtron eval tasks` refuses a
`--max-tokens` for which that can happen, `check_max_tokens`).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Sequence

from hybridtron.data.chat import tokenize_chat
from hybridtron.data.tokenizer import IM_END, THINK_START
from hybridtron.eval.progress import Progress
from hybridtron.infer.engine import generate_tokens
from hybridtron.infer.sampling import SamplingParams


def pass_at_k(samples: int, solved: int, k: int) -> float:
    """The unbiased pass@k of one task from `samples` completions of which `solved` were right: 1 - C(n - c, k) /
    C(n, k), the chance that k drawn without replacement include a right one."""
    if not 1 <= k <= samples:
        raise ValueError(f"pass@{k} needs 1 <= k <= samples ({samples})")
    if samples - solved < k:
        return 1.0
    return 1.0 - math.comb(samples - solved, k) / math.comb(samples, k)


def k_values(samples: int) -> list[int]:
    """The k reported for n samples: 1, 2, 4, ... below n, and n."""
    ks = [1 << i for i in range(samples.bit_length()) if 1 << i < samples]
    return ks + [samples]


@dataclass
class EnvEvaluation:
    tasks: int
    samples: int  # completions per task
    pass_at_1: float
    pass_at_k: dict[int, float]
    mean_reward: float
    by_difficulty: dict[int, float]
    mean_completion_tokens: float
    truncated_share: float  # completions cut at max_tokens (they never closed their turn)
    context_cut_share: float  # completions cut before max_tokens by the model's context
    context: int  # the model's context (max_position_embeddings): prompt + completion at most
    seconds: float
    completions: list[str] = field(repr=False)  # task by task, each task's samples together
    rewards: list[float] = field(repr=False)

    def format(self) -> str:
        levels = ", ".join(f"L{level} {value:.1%}" for level, value in sorted(self.by_difficulty.items()))
        extra = "".join(f", pass@{k} {value:.1%}" for k, value in self.pass_at_k.items() if k > 1)
        context_cut = (f", {self.context_cut_share:.0%} cut by the model's context ({self.context} tokens)"
                       if self.context_cut_share else "")
        return (f"pass@1 {self.pass_at_1:.1%}{extra} on {self.tasks} tasks x {self.samples} ({levels}); mean reward "
                f"{self.mean_reward:.3f}; {self.mean_completion_tokens:.0f} tokens a completion, "
                f"{self.truncated_share:.0%} cut at max_tokens{context_cut}; {self.seconds:.0f}s")

    def to_dict(self, samples: int = 0) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("completions", "rewards")}
        if samples:
            out["samples_shown"] = [{"completion": c, "reward": r} for c, r in zip(self.completions[:samples],
                                                                                  self.rewards[:samples])]
        return out


def task_prompts(tokenizer, env, tasks: Sequence, enable_thinking: bool | None = None) -> list[list[int]]:
    """Each task's prompt ids: its messages in the chat format with the generation prompt."""
    return [tokenize_chat(tokenizer, env.prompt_messages(task), add_generation_prompt=True,
                          enable_thinking=enable_thinking).ids.tolist() for task in tasks]


def evaluate_env(model, tokenizer, env, tasks: Sequence, *, samples: int = 1, max_tokens: int = 256,
                 batch_size: int = 32, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 enable_thinking: bool | None = None, speculative: bool = False,
                 progress: bool = False) -> EnvEvaluation:
    """Generate `samples` completions per task (greedy unless `temperature` > 0; several greedy samples would all
    be the same, so `samples` > 1 needs a temperature) and grade them with `env`. `model` is put in eval mode. A
    sampled completion depends on its task, its place in the list and `seed`, not on `batch_size`: a task listed k
    times gets k independent samples. `progress`: a progress line on stderr (`hybridtron.eval.progress`)."""
    if not tasks:
        raise ValueError("evaluate_env: no tasks")
    if batch_size < 1:
        raise ValueError(f"evaluate_env: batch_size must be >= 1, got {batch_size}")
    if samples < 1 or (samples > 1 and temperature <= 0):
        raise ValueError(f"evaluate_env: samples={samples} needs samples >= 1, and a temperature > 0 when above 1 "
                         f"(greedy samples are all the same)")
    started = time.perf_counter()
    model.eval()
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, max_tokens=max_tokens,
                            stop_token_ids=(tokenizer.token_id(IM_END), tokenizer.eos_id))
    # the opening the generation prompt wrote belongs to the completion the grader reads
    opening = THINK_START + "\n" if enable_thinking is True else ""
    graded = [task for task in tasks for _ in range(samples)]
    prompts = [ids for ids in task_prompts(tokenizer, env, tasks, enable_thinking) for _ in range(samples)]
    context = model.config.max_position_embeddings
    line = Progress(f"eval tasks {env.domain}", len(prompts), "completions", enabled=progress)
    completions, lengths, truncated, context_cut = [], [], 0, 0
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start:start + batch_size]
        for tokens in generate_tokens(model, batch, params, speculative=speculative, first_sample=start):
            stopped = bool(tokens) and tokens[-1] in params.stop_token_ids
            if not stopped and len(tokens) < max_tokens:  # the decoder stopped it at the context's end
                context_cut += 1
            else:
                truncated += not stopped
            completions.append(opening + tokenizer.decode(tokens[:-1] if stopped else tokens))
            lengths.append(len(tokens))
        line.advance(len(batch))
    rewards = env.rewards(graded, completions)
    solved = [sum(reward == 1.0 for reward in rewards[i * samples:(i + 1) * samples]) for i in range(len(tasks))]
    levels: dict[int, list[float]] = {}
    for task, right in zip(tasks, solved):
        levels.setdefault(task.difficulty, []).append(right / samples)
    pass_k = {k: sum(pass_at_k(samples, right, k) for right in solved) / len(tasks) for k in k_values(samples)}
    return EnvEvaluation(
        tasks=len(tasks), samples=samples, pass_at_1=pass_k[1], pass_at_k=pass_k,
        mean_reward=sum(rewards) / len(rewards),
        by_difficulty={level: sum(v) / len(v) for level, v in sorted(levels.items())},
        mean_completion_tokens=sum(lengths) / len(lengths), truncated_share=truncated / len(graded),
        context_cut_share=context_cut / len(graded), context=context,
        seconds=time.perf_counter() - started, completions=completions, rewards=rewards)
