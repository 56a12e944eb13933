"""Multi-turn, tool-using trajectories: what one is made of, how a turn's tool calls are run, and the sandboxed tools
the built-in agentic environments share.

A `Trajectory` is one sequence of tokens, the way RL trains on it: the first prompt (system turn with the tools, the
task), then for each turn the tokens the model sampled (`model_mask` True, with their sampled log-probs) and what the
environment appended after them (the `tool` messages and the next generation prompt: `model_mask` False, never
trained). Its `turns` record each model turn (its span of tokens, its text, its calls and their results) and `stats`
count the tool calls by outcome. The turn loop that produces it is `hybridtron.post.agentic.run_episodes`.

`run_calls` turns a model's turn into tool results and never raises: a call that does not parse, names no declared
tool, or has arguments against its declaration, and a tool that fails, each become a `ToolResult` with an error (the
model reads what went wrong; `ToolStats` counts it). `SandboxEpisode` gives a trajectory its own directory, which
its `python` and `bash` calls run in (`hybridtron.envs.sandbox`: namespaces, Landlock, a wall clock, CPU, memory,
process, file and output limits per call) and which the verifier reads at the end.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any, Sequence

from hybridtron.data.chat import RESERVED_TOKENS
from hybridtron.data.tools import ParsedOutput, ToolCall, function_tool
from hybridtron.envs.base import TOOL_ERRORS, Environment, Episode, Task, ToolResult
from hybridtron.envs.sandbox import (SandboxConfig, SandboxResult, hand_over, make_workdir, new_run_as,
                                     remove_workdir, run_python, run_shell)

# A tool call's limits: seconds of wall clock and of CPU, and the output the model reads back (bytes).
TOOL_SANDBOX = SandboxConfig(wall_s=5.0, cpu_s=5, output_bytes=4096, disk_mb=16, file_mb=8, processes=32)

PYTHON_TOOL = function_tool(
    "python", "Run a Python 3 program in a fresh process in the task's directory and return what it prints (the "
              "value of a last bare expression is printed too). Files persist between calls; variables do not.",
    {"type": "object", "properties": {"code": {"type": "string", "description": "the program"}},
     "required": ["code"]})
BASH_TOOL = function_tool(
    "bash", "Run a bash command in the task's directory and return its output (stdout and stderr) and exit status.",
    {"type": "object", "properties": {"command": {"type": "string", "description": "the command line"}},
     "required": ["command"]})


@dataclass
class ToolStats:
    """Tool calls of one trajectory (or summed over many) by outcome: `ok`, and one count per `TOOL_ERRORS` kind."""

    calls: int = 0
    ok: int = 0
    errors: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TOOL_ERRORS, 0))

    def add(self, result: ToolResult) -> None:
        self.calls += 1
        if result.error is None:
            self.ok += 1
        else:
            self.errors[result.error] += 1

    def __iadd__(self, other: "ToolStats") -> "ToolStats":
        self.calls += other.calls
        self.ok += other.ok
        for kind, count in other.errors.items():
            self.errors[kind] += count
        return self

    @property
    def well_formed(self) -> int:
        """Calls that parsed, named a declared tool and matched its arguments (whatever the tool then did)."""
        return self.calls - self.errors["malformed"] - self.errors["unknown_tool"] - self.errors["bad_arguments"]


@dataclass
class Turn:
    """One model turn: its tokens are `token_ids[start:end]` of the trajectory; `text` their decoded text; `calls`
    what parsed out of it and `results` what each call (or the malformed text, as one result) gave back."""

    start: int
    end: int
    text: str
    finish_reason: str
    calls: list[ToolCall] = field(default_factory=list)
    results: list[ToolResult] = field(default_factory=list)
    expert_ids: dict | None = None  # the engine's routing for this turn (Completion.expert_ids), where asked


FINISHES = ("answer", "turn_limit", "token_budget", "length")


@dataclass
class Trajectory:
    """A whole multi-turn rollout of one task (see the module docstring). `finish`: "answer" (the model answered
    without a call), "turn_limit" (it still called tools after `max_turns` turns), "token_budget" (the sequence
    reached its budget or the model's context), "length" (a turn reached the per-turn `max_tokens`). `final`: the
    text the verifier read as the answer; `reward`: the verifier's score of the final state."""

    task: Task
    token_ids: list[int]
    model_mask: list[bool]  # per token: sampled by the model (trained on) or written by the prompt / environment
    logprobs: list[float]  # per token: the sampled log-prob where model_mask, else 0.0
    prompt_length: int
    turns: list[Turn] = field(default_factory=list)
    stats: ToolStats = field(default_factory=ToolStats)
    finish: str = ""
    final: str = ""
    reward: float = 0.0

    def append(self, ids: Sequence[int], logprobs: Sequence[float] | None = None) -> None:
        """Tokens the model sampled (with their log-probs), or, without log-probs, tokens the environment wrote."""
        self.token_ids.extend(ids)
        self.model_mask.extend([logprobs is not None] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))

    @property
    def model_tokens(self) -> int:
        return sum(self.model_mask)

    def conversation(self, prompt_messages: Sequence[dict]) -> list[dict]:
        """The trajectory as chat messages after `prompt_messages` (the environment's `prompt_messages(task)`): each
        model turn an assistant message holding its text as sampled (tool-call markup included, so that rendering
        it gives the model's own text back), each result a `tool` message. Rendered without thinking by the chat
        template with the environment's tools, it is the trajectory's text (a turn cut by a limit has no end). A turn
        whose text the chat format refuses as content (a stray `<think>` tag, a sampled `<|im_start|>`) makes
        rendering it a ValueError naming the message."""
        messages = list(prompt_messages)
        for turn in self.turns:
            messages.append({"role": "assistant", "content": turn.text})
            messages += [{"role": "tool", "content": tool_text(result.content)} for result in turn.results]
        return messages


def tool_text(content: str) -> str:
    """A tool's output as a `tool` message may hold it: the chat format's own markers (which would end or open a
    turn inside the response) are broken up, visibly."""
    for token in RESERVED_TOKENS:
        content = content.replace(token, token[:1] + " " + token[1:])
    return content


def check_arguments(tool: dict, arguments: dict) -> str | None:
    """Why `arguments` do not fit `tool`'s declaration (its required properties, each declared property's JSON type
    where it names a simple one), or None. Not a full JSON Schema validator: what a tool needs to run safely."""
    parameters = tool["function"].get("parameters") or {}
    properties = parameters.get("properties") or {}
    missing = [name for name in parameters.get("required", ()) if name not in arguments]
    if missing:
        return f"missing required argument {missing[0]!r}"
    unknown = [name for name in arguments if properties and name not in properties]
    if unknown:
        return f"unknown argument {unknown[0]!r}; {tool['function']['name']} takes {', '.join(properties)}"
    types = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}
    for name, value in arguments.items():
        expected = types.get((properties.get(name) or {}).get("type"))
        if expected is not None and (not isinstance(value, expected) or (expected is int and isinstance(value, bool))):
            return f"argument {name!r} must be a {properties[name]['type']}, got {type(value).__name__}"
    return None


def run_calls(episode: Episode, tools: Sequence[dict], parsed: ParsedOutput) -> list[ToolResult]:
    """The results of a turn's calls, in order (one result for a malformed turn). Never raises."""
    if parsed.malformed is not None:
        return [ToolResult(f"error: the tool call did not parse ({parsed.malformed}); write "
                           '<tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call>', "malformed")]
    declared = {tool["function"]["name"]: tool for tool in tools}
    results = []
    for call in parsed.calls:
        if call.name not in declared:
            results.append(ToolResult(f"error: no tool {call.name!r}; the tools are {', '.join(declared)}",
                                      "unknown_tool"))
            continue
        problem = check_arguments(declared[call.name], call.arguments)
        if problem is not None:
            results.append(ToolResult(f"error: {call.name}: {problem}", "bad_arguments"))
            continue
        try:
            results.append(episode.call(call.name, call.arguments))
        except Exception as exc:  # noqa: BLE001 - a tool's own bug must not end the rollout; it is reported
            results.append(ToolResult(f"error: {call.name} failed: {type(exc).__name__}: {exc}"[:1000], "failed"))
    return results


def sandbox_result(result: SandboxResult, limits: SandboxConfig) -> ToolResult:
    """A sandboxed run as the model reads it: its output, then what went wrong, if anything."""
    text = result.output
    error = None
    if result.timed_out:
        text, error = text + f"\n[killed: past the limit of {limits.wall_s:g} s wall clock or {limits.cpu_s} s CPU]", \
            "timeout"
    elif result.disk_exceeded:
        text, error = text + f"\n[killed: the task directory grew past {limits.disk_mb} MiB]", "disk_limit"
    elif result.output_truncated:
        text, error = text + f"\n[output cut at {limits.output_bytes} bytes]", "output_limit"
    elif result.supervisor_error is not None:
        text, error = text + "\n[the sandbox failed]", "failed"
    elif result.load_error is not None:
        text, error = text + f"\n{result.load_error}", "failed"
    elif result.exit_code not in (0, None):
        text, error = text + f"\n[exit status {result.exit_code}]", "failed"
    return ToolResult(text.strip("\n") or "(no output)", error)


def echo_last_expression(code: str) -> str:
    """`code` with a last bare expression printed (as a REPL shows it), so `2 ** 100` alone answers; unchanged when
    it does not parse (the sandbox then reports the SyntaxError)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return code
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return code
    last = tree.body[-1]
    show = ast.parse("if (__value := None) is not None: print(repr(__value))").body[0]
    show.test.left.value = last.value  # (__value := <the expression>) is not None
    tree.body[-1] = show
    return ast.unparse(ast.fix_missing_locations(tree))


class SandboxEpisode(Episode):
    """A trajectory with a directory of its own (filled by `setup`) that its `python` and `bash` tools run in, each
    call a separate sandboxed process with `limits`, as a user of its own (under a root parent: so that its process
    limit is its own, whatever the other trajectories run); the directory is removed at `close`."""

    def __init__(self, env: Environment, task: Task, limits: SandboxConfig = TOOL_SANDBOX):
        super().__init__(env, task)
        self.limits = limits
        self.workdir, self.run_as = make_workdir(), new_run_as()
        try:
            self.setup()
            hand_over(self.workdir, self.run_as)
        except BaseException:
            remove_workdir(self.workdir)
            raise

    def setup(self) -> None:
        """Write the task's starting files into `self.workdir`."""

    def call(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        if name == "python":
            return sandbox_result(run_python(echo_last_expression(arguments["code"]), [], self.limits,
                                             workdir=self.workdir, run_as=self.run_as), self.limits)
        if name == "bash":
            return sandbox_result(run_shell(arguments["command"], self.workdir, self.limits, run_as=self.run_as),
                                  self.limits)
        return super().call(name, arguments)

    def close(self) -> None:
        remove_workdir(self.workdir)


def summarize(trajectories: Sequence[Trajectory]) -> dict[str, Any]:
    """What a batch of trajectories did: pass rate (mean reward), turns and model tokens per trajectory, the tool
    calls and the share of them well-formed, the errors by kind, and how the trajectories ended."""
    stats = ToolStats()
    for trajectory in trajectories:
        stats += trajectory.stats
    n = max(len(trajectories), 1)
    return {"trajectories": len(trajectories),
            "pass_rate": sum(t.reward for t in trajectories) / n,
            "turns": sum(len(t.turns) for t in trajectories) / n,
            "model_tokens": sum(t.model_tokens for t in trajectories) / n,
            "tool_calls": stats.calls,
            "well_formed": stats.well_formed / stats.calls if stats.calls else None,
            "errors": {kind: count for kind, count in stats.errors.items() if count},
            "finishes": {how: sum(t.finish == how for t in trajectories) for how in FINISHES
                         if any(t.finish == how for t in trajectories)}}
