"""Agentic SFT data: synthetic trajectories of a tool environment, successful and failed, each prefixed with its
outcome.

A scripted expert (each tool environment's `expert_plans`) plays a training task through a real episode: its turns
are parsed as the turn loop parses them (`hybridtron.data.tools.parse_tool_calls`) and run in the sandbox
(`hybridtron.envs.agentic.run_calls`), so every tool response is the genuine one, errors included; the episode's
verifier then scores the final answer and state, and the trajectory becomes a conversation
(`Trajectory.conversation`: each assistant turn the text the model would sample, tool-call markup included, each
result a `tool` message), which `hybridtron sft` renders with the environment's tools and trains on its assistant
tokens alone.

The outcome prefix. Nemotron 3's data notes: "for synthetic pretraining data they include both successful and
failed rollouts and prepend the data with whether it failed or succeeded" (../shared/seeds/002). Here the prefix is
the first line of the system message, `Outcome: success` or `Outcome: failure` (`outcome_messages`), and the label
is the verifier's score of the trajectory (1.0: success), never the plan's intent. The line is prompt: it is never a
loss target, so the model learns to act given the label without learning to write it. It is dropped at inference:
the turn loop, `grpo`, `eval tasks` and `serve` send `env.prompt_messages(task)` unchanged, without the line, so
the failed trajectories teach the tool-call format and what tool errors look like while the model's unconditioned
behaviour stays a mixture weighted to success by `failure_share` (default 0.25). To condition a rollout on success
instead, prompt with `outcome_messages(env.prompt_messages(task), "success")`.

`expert_examples` is deterministic for (environment, levels, n, seed, failure_share): exactly
`round(n * failure_share)` failures, placed by a seeded shuffle; a task on which no plan reaches the outcome asked
for (a state task whose tree needs no change cannot be failed by doing nothing) hands its slot to the next task.
Tasks come from the training split only.
"""

from __future__ import annotations

import json
import random
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

from hybridtron.data.tokenizer import TOOL_CALL_END, TOOL_CALL_START
from hybridtron.data.tools import parse_tool_calls
from hybridtron.envs.agentic import Trajectory, Turn, run_calls
from hybridtron.envs.base import Environment, Task

OUTCOMES = ("success", "failure")
OUTCOME_LINE = "Outcome: {}"
FAILURE_SHARE = 0.25
# A plan: the expert's next assistant turn (its text, tool calls written in the chat format) from the contents of
# the tool responses so far; a turn without a call ends the trajectory.
Plan = Callable[[list[str]], str]


def outcome_messages(messages: Sequence[dict], outcome: str) -> list[dict]:
    """`messages` with `Outcome: {outcome}` as the first line of the system message (one is opened if none)."""
    if outcome not in OUTCOMES:
        raise ValueError(f"outcome must be one of {', '.join(OUTCOMES)}, got {outcome!r}")
    line = OUTCOME_LINE.format(outcome)
    messages = [dict(message) for message in messages]
    if messages and messages[0].get("role") == "system":
        messages[0]["content"] = f"{line}\n{messages[0]['content']}"
        return messages
    return [{"role": "system", "content": line}, *messages]


def play(env: Environment, task: Task, plan: Plan) -> Trajectory:
    """The trajectory of `plan` on `task` through a fresh episode of `env` (its turns and tool results, text only:
    no tokens), with the verifier's score as its `reward`. A plan that still calls tools after the environment's
    `max_turns` is a bug of the expert: ValueError."""
    trajectory = Trajectory(task=task, token_ids=[], model_mask=[], logprobs=[], prompt_length=0)
    with env.episode(task) as episode:
        outputs: list[str] = []
        for _ in range(env.max_turns):
            text = plan(outputs)
            parsed = parse_tool_calls(text)
            turn = Turn(0, 0, text, "stop", list(parsed.calls))
            trajectory.turns.append(turn)
            if not parsed.calls and parsed.malformed is None:
                trajectory.final, trajectory.finish = text, "answer"
                break
            turn.results = run_calls(episode, env.tools, parsed)
            for result in turn.results:
                trajectory.stats.add(result)
            outputs += [result.content for result in turn.results]
        else:
            raise ValueError(f"{env.name}: an expert plan for task {task.id} still calls tools after "
                             f"{env.max_turns} turns")
        trajectory.reward = float(episode.reward(trajectory.final))
    return trajectory


def expert_example(env: Environment, task: Task, outcome: str, seed: int) -> dict | None:
    """One SFT example of `task` whose verified outcome is `outcome`, from the first of the environment's plans for
    it (`env.expert_plans(task, failure, rng)`, rng seeded by task and seed) that reaches it; None if none does."""
    rng = random.Random(f"{env.name}/sft/{seed}/{task.id}")
    for name, plan in env.expert_plans(task, outcome == "failure", rng):
        trajectory = play(env, task, plan)
        if (trajectory.reward >= 1.0) == (outcome == "success"):
            messages = trajectory.conversation(outcome_messages(env.prompt_messages(task), outcome))
            return {"messages": messages, "tools": list(env.tools), "domain": task.domain, "outcome": outcome,
                    "plan": name, "task": task.id}
    return None


def expert_examples(env: Environment, n: int, seed: int = 0, *, failure_share: float = FAILURE_SHARE,
                    threads: int = 8) -> list[dict]:
    """`n` SFT examples of `env`'s training tasks (see the module docstring), `round(n * failure_share)` of them
    failures; `threads`: tasks played at once (each tool call is a sandboxed process of its own)."""
    if type(n) is not int or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    if not 0 <= failure_share <= 1:
        raise ValueError(f"failure_share must be a number in [0, 1], got {failure_share!r}")
    failures = round(n * failure_share)
    wanted = ["failure"] * failures + ["success"] * (n - failures)
    random.Random(f"{env.name}/sft-outcomes/{seed}").shuffle(wanted)
    pending = deque(wanted)
    # skipped tasks are rare (see the module docstring): half as many again covers them
    tasks = iter(env.tasks("train", n + n // 2 + 8, seed))
    examples: list[dict] = []
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        while pending:
            batch = []
            for _ in range(min(len(pending), 4 * max(1, threads))):
                task = next(tasks, None)
                if task is None:
                    raise ValueError(f"environment {env.name!r}: its expert reached the asked outcomes on only "
                                     f"{len(examples)} of the {n} examples; ask for fewer or widen its levels")
                batch.append((task, pending.popleft()))
            made = pool.map(lambda item: expert_example(env, item[0], item[1], seed), batch)
            for (_, outcome), example in zip(batch, made):
                if example is None:
                    pending.append(outcome)
                else:
                    examples.append(example)
    return examples


def call_turn(name: str, arguments: dict, lead: str = "") -> str:
    """An assistant turn that calls the tool `name` with `arguments`, after the text `lead` if any, laid out as the
    chat template renders a call (so the turn is the text a model trained on it samples)."""
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{lead}{chr(10) if lead else ''}{TOOL_CALL_START}\n{call}\n{TOOL_CALL_END}"


def near_miss(value: str, rng: random.Random) -> str:
    """An integer's text with one digit changed (never to a leading zero): a wrong answer of the right size."""
    digits = list(value)
    position = rng.randrange(len(digits))
    low = 1 if position == 0 and len(digits) > 1 else 0
    digits[position] = rng.choice([d for d in "0123456789"[low:] if d != digits[position]])
    return "".join(digits)


def misspelt(word: str) -> str:
    """`word` with its second and third letters swapped (`print` -> `pirnt`, `grep` -> `gerp`): a typo."""
    return word[0] + word[2] + word[1] + word[3:] if len(word) > 2 else word + word[-1]
