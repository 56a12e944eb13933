"""The turn loop of multi-turn, tool-using rollouts: a model drives each task's episode (`Environment.episode`)
through turns until it answers without a tool call, reaches the turn limit or the token budget.

    trajectories = run_episodes(engine_generate(engine), tokenizer, get_env("math-python"), tasks,
                                SamplingParams(max_tokens=256, temperature=1.0), token_budget=2048)

Each step generates the next turn of every unfinished trajectory in one batch (`generate`: one completion per
prompt, with the sampled tokens' log-probs; `engine_generate` wraps hybridtron's engine, and an RL rollout engine,
`hybridtron.post.rl.engines.RolloutEngine`, fits with its version bound). A turn ends at the end token (`<|im_end|>`,
which the engine always stops at); its calls are parsed as the server parses them (`hybridtron.data.tools`,
vLLM's Hermes format) and run in the episode (`hybridtron.envs.agentic.run_calls`, in threads across trajectories:
each sandboxed call is a process of its own); their results are appended as `tool` messages followed by the next
generation prompt (`hybridtron.data.chat.tool_turn_text`), encoded and appended to the sampled tokens as they are
(token in, token out: the model's tokens are never re-encoded, so the sequence the learner trains on is the one that
was sampled, and its log-probs line up with it). The trajectory ends with "answer" (a turn without a call), "length"
(a turn reached `params.max_tokens`), "turn_limit" (calls after `max_turns` turns: they are run, so the final state
holds them, but not answered) or "token_budget" (the whole sequence, prompt and tool responses included, would pass
`token_budget`); then the episode's verifier scores the final answer and state, and the episode is closed.

A model's mistakes never raise here (a malformed call, an unknown tool, a tool that fails, times out or floods its
output: each is a tool response with an error, counted in `Trajectory.stats`); a failure of `generate` itself does,
after every episode is closed.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

from hybridtron.data.chat import tokenize_chat, tool_turn_text
from hybridtron.data.tokenizer import IM_END, THINK_END, THINK_START, Tokenizer
from hybridtron.data.tools import parse_tool_calls
from hybridtron.envs.agentic import Trajectory, Turn, run_calls, tool_text
from hybridtron.envs.base import Environment, Episode, Task
from hybridtron.infer.sampling import SamplingParams
from hybridtron.infer.scheduler import Completion

Generate = Callable[[list[list[int]], SamplingParams], list[Completion]]
TURN_SEED_STRIDE = 1_000_003  # turn t samples with seed + t * stride: each turn its own noise, reproducibly


def engine_generate(engine, *, expert_ids: bool = False) -> Generate:
    """`generate` over hybridtron's engine (`HybridEngine.generate`): one sample per prompt, with log-probs (and,
    with `expert_ids`, each turn's routing, kept in `Turn.expert_ids` for routing replay)."""
    return lambda prompts, params: [row[0] for row in engine.generate(prompts, params, n=1, logprobs=True,
                                                                      expert_ids=expert_ids)]


@dataclasses.dataclass
class _Running:
    trajectory: Trajectory
    episode: Episode


def _start(env: Environment, task: Task, tokenizer: Tokenizer, enable_thinking: bool | None) -> _Running:
    ids = tokenize_chat(tokenizer, env.prompt_messages(task), tools=list(env.tools) or None,
                        add_generation_prompt=True, enable_thinking=enable_thinking).ids.tolist()
    trajectory = Trajectory(task=task, token_ids=[], model_mask=[], logprobs=[], prompt_length=len(ids))
    trajectory.append(ids)
    return _Running(trajectory, env.episode(task))


def run_episodes(generate: Generate, tokenizer: Tokenizer, env: Environment, tasks: Sequence[Task],
                 params: SamplingParams, *, max_turns: int | None = None, token_budget: int = 4096,
                 enable_thinking: bool | None = None, tool_threads: int = 16) -> list[Trajectory]:
    """One trajectory per task (see the module docstring): `params.max_tokens` bounds each turn, `token_budget`
    the whole sequence; `max_turns` defaults to the environment's; `enable_thinking` shapes every generation
    prompt as the chat template does; `tool_threads`: trajectories whose calls run at once."""
    max_turns = env.max_turns if max_turns is None else max_turns
    if type(max_turns) is not int or max_turns < 1:
        raise ValueError(f"max_turns must be an int >= 1, got {max_turns!r}")
    if type(token_budget) is not int or token_budget < 1:
        raise ValueError(f"token_budget must be an int >= 1, got {token_budget!r}")
    im_end = tokenizer.token_id(IM_END)
    opening = THINK_START + "\n" if enable_thinking is True else ""  # what the generation prompt already wrote
    running: list[_Running] = []
    try:
        for task in tasks:
            running.append(_start(env, task, tokenizer, enable_thinking))
        active = [r for r in running if not _over_budget(r.trajectory, token_budget)]
        with ThreadPoolExecutor(max_workers=max(1, tool_threads)) as pool:
            for turn in range(max_turns):
                if not active:
                    break
                completions = _generate_turn(generate, active, params, token_budget, turn)
                calling = []
                for run, completion in zip(active, completions):
                    if _take_turn(run, completion, opening, im_end, params.max_tokens, token_budget, tokenizer):
                        calling.append(run)
                results = list(pool.map(lambda run: _run_calls(run, env), calling))
                active = []
                for run, contents in zip(calling, results):
                    if turn + 1 == max_turns:
                        run.trajectory.finish = "turn_limit"
                        continue
                    run.trajectory.append(tokenizer.encode(tool_turn_text(contents, enable_thinking=enable_thinking)))
                    if _over_budget(run.trajectory, token_budget):
                        run.trajectory.finish = "token_budget"
                    else:
                        active.append(run)
        for run in running:
            trajectory = run.trajectory
            if not trajectory.finish:  # its prompt alone filled the budget
                trajectory.finish = "token_budget"
            trajectory.reward = float(run.episode.reward(trajectory.final))
    finally:
        for run in running:
            run.episode.close()
    return [run.trajectory for run in running]


def _over_budget(trajectory: Trajectory, token_budget: int) -> bool:
    return len(trajectory.token_ids) >= token_budget


def _generate_turn(generate: Generate, active: list[_Running], params: SamplingParams, token_budget: int,
                   turn: int) -> list[Completion]:
    """The next turn of every active trajectory: one `generate` call per distinct turn length (each capped by what
    is left of its trajectory's budget; usually one call)."""
    seed = None if params.seed is None else params.seed + turn * TURN_SEED_STRIDE
    caps = [min(params.max_tokens, token_budget - len(r.trajectory.token_ids)) for r in active]
    out: list[Completion | None] = [None] * len(active)
    for cap in sorted(set(caps)):
        picked = [i for i, c in enumerate(caps) if c == cap]
        batch = generate([active[i].trajectory.token_ids for i in picked],
                         dataclasses.replace(params, max_tokens=cap, seed=seed))
        for i, completion in zip(picked, batch):
            out[i] = completion
    return out


def _take_turn(run: _Running, completion: Completion, opening: str, im_end: int, max_tokens: int,
               token_budget: int, tokenizer: Tokenizer) -> bool:
    """Append a sampled turn; True when its calls are to be run, else the trajectory is finished."""
    trajectory = run.trajectory
    ids = list(completion.token_ids)
    logprobs = completion.logprobs.tolist() if completion.logprobs is not None else [0.0] * len(ids)
    start = len(trajectory.token_ids)
    trajectory.append(ids, logprobs)
    ended = completion.finish_reason == "stop" and bool(ids) and ids[-1] == im_end
    text = opening + tokenizer.decode(ids[:-1] if completion.finish_reason == "stop" and ids else ids)
    parsed = parse_tool_calls(text.rsplit(THINK_END, 1)[-1])
    record = Turn(start, len(trajectory.token_ids), text, completion.finish_reason, list(parsed.calls),
                  expert_ids=completion.expert_ids)
    trajectory.turns.append(record)
    if completion.finish_reason == "length":
        trajectory.final = text
        budget = len(ids) < max_tokens or _over_budget(trajectory, token_budget)
        trajectory.finish = "token_budget" if budget else "length"
        return False
    if not ended or (not parsed.calls and parsed.malformed is None):
        trajectory.final = text
        trajectory.finish = "answer"
        return False
    trajectory.final = (parsed.content or "") if parsed.calls else text
    return True


def _run_calls(run: _Running, env: Environment) -> list[str]:
    """Run the last turn's calls; the tool messages' contents."""
    turn = run.trajectory.turns[-1]
    text = turn.text.rsplit(THINK_END, 1)[-1]
    turn.results = run_calls(run.episode, env.tools, parse_tool_calls(text))
    for result in turn.results:
        run.trajectory.stats.add(result)
    return [tool_text(result.content) for result in turn.results]

