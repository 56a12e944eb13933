"""Environments for RL with verifiable rewards and for SFT data: one small interface, a registry, and the built-ins.
Single-turn: `math` (exact-value grading in child processes), `code` (hidden unit tests in a sandbox) and `copy`
(repeat a number or a name: the copying every tool rests on). Multi-turn, with tools run in the sandbox:
`math-python` (a `python` tool) and `terminal` (a `bash` tool on a generated file tree; see hybridtron.envs.agentic
and the turn loop, hybridtron.post.agentic).

    env = get_env("math", levels=(1, 2))
    tasks = env.tasks("train", 64, seed=0)
    rewards = env.rewards(tasks, completions)       # floats in [0, 1]
    write_jsonl("sft.jsonl", env.sft_examples(1000))

Write your own: subclass `Environment`, implement `generate(rng) -> Task` (or `tasks`) and `reward`, and
decorate it with `@register("name")`.
"""

from hybridtron.envs.base import (ENV_PREFIX, SPLITS, Environment, Episode, Task, ToolResult, assistant_turn, env_names,
                                  env_sft_examples, get_env, register, split_of, write_jsonl)
from hybridtron.envs.code import CodeEnv
from hybridtron.envs.copy import CopyEnv
from hybridtron.envs.math import MathEnv
from hybridtron.envs.math_python import MathPythonEnv
from hybridtron.envs.terminal import TerminalEnv

__all__ = ["ENV_PREFIX", "SPLITS", "CodeEnv", "CopyEnv", "Environment", "Episode", "MathEnv", "MathPythonEnv", "Task",
           "TerminalEnv", "ToolResult", "assistant_turn", "env_names", "env_sft_examples", "get_env", "register",
           "split_of", "write_jsonl"]
