"""`terminal`: a small generated project tree in a fresh sandbox directory per trajectory, a `bash` tool, and tasks
graded on the answer or on the tree's final state.

The tree (drawn from the task's seed, so every trajectory of a task starts from the same files): `logs/` (service
logs at INFO / WARN / ERROR / DEBUG, some in `logs/archive/`), `notes/` (.txt, .md and .rst notes, some nested),
`src/` (Python files whose functions call each other), `data/` (.csv and .json files of different sizes), `tmp/`
(.bak and other scratch files). The tasks, one kind per difficulty level:

1. how many files under logs/ contain ERROR (answer);
2. which function defined in src/ is called most (answer: its name; the draw makes it unique);
3. which file under data/ is the largest (answer: its name);
4. rename every .txt under notes/ to .md (state: the same files and contents, renamed; nothing else changed);
5. delete every .bak under tmp/ (state: they are gone, the rest is there);
6. write the number of .csv files under data/ into count.txt (state).

`sft_examples` are an expert's trajectories through the real `bash` tool, successful and failed, each prefixed with
its outcome (`hybridtron.envs.agentic_sft`; `TerminalEnv.expert_plans`).

Answers are read as `math` reads them (`\\boxed{}` or an "Answer:" line of the final turn). The final state is read
without following links and without opening anything but regular files (a FIFO or a link the model left behind is
a mismatch, never a hang or a read outside the directory).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Sequence

from hybridtron.envs.agentic import BASH_TOOL, SandboxEpisode
from hybridtron.envs.agentic_sft import FAILURE_SHARE, Plan, call_turn, expert_examples, misspelt, near_miss
from hybridtron.envs.base import Environment, Episode, Task, register
from hybridtron.envs.math_verify import extract_answer

KINDS = ("errors", "most_called", "largest", "rename", "cleanup", "count")
LEVELS = tuple(range(1, len(KINDS) + 1))
PROJECTS = ("atlas", "orbit", "ember", "quill", "delta", "nimbus", "pylon", "relay", "sprout", "tundra")
WORDS = ("alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta", "lambda", "zeta", "iota", "rho")
FUNCTIONS = ("load_config", "parse_items", "send_report", "check_limits", "merge_rows", "read_cache", "write_cache",
             "format_name", "split_path", "resolve_host", "compute_total", "validate_user")
LEVEL_NAMES = ("INFO", "WARN", "ERROR", "DEBUG")
MAX_STATE_FILES = 2000  # a tree the model blew up past this is read as far as this: it no longer matches
MAX_STATE_BYTES = 1 << 20  # per file

PROMPTS = {
    "errors": "How many files under logs/ (subdirectories included) contain the word ERROR?",
    "most_called": "Which function defined in the Python files under src/ is called the most times (definitions "
                   "not counted)? Answer with its name.",
    "largest": "Which file under data/ is the largest, in bytes? Answer with its file name.",
    "rename": "Rename every .txt file under notes/ (subdirectories included) to .md, keeping the rest of its name.",
    "cleanup": "Delete every file under tmp/ whose name ends in .bak, and nothing else.",
    "count": "Write the number of .csv files under data/ (subdirectories included) into a file named count.txt at "
             "the top of the project.",
}
SOLUTIONS = {  # the bash command of a solving trajectory, and whether its output is the answer
    "errors": "grep -rl ERROR logs | wc -l",
    "most_called": r"grep -rhoE '(def )?[a-z_]+\(' src | grep -v '^def ' | sort | uniq -c | sort -rn | head -1 "
                   r"| sed -E 's/^ *[0-9]+ //; s/\($//'",
    "largest": "find data -type f -printf '%s %f\\n' | sort -rn | head -1 | sed 's/^[0-9]* //'",
    "rename": "find notes -name '*.txt' -exec sh -c 'mv \"$1\" \"${1%.txt}.md\"' _ {} \\;",
    "cleanup": "find tmp -name '*.bak' -delete",
    "count": "find data -name '*.csv' | wc -l > count.txt",
}
ANSWER_KINDS = ("errors", "most_called", "largest")
FOLDERS = {"errors": "logs", "most_called": "src", "largest": "data", "rename": "notes", "cleanup": "tmp",
           "count": "data"}  # what a task is about: the expert lists it first in its "explore" plans
MISTAKES = {  # a plausible wrong command per kind, and why it is wrong (it may still happen to be right on a tree)
    "errors": "grep -rc ERROR logs | wc -l",  # counts every file, not the files that contain ERROR
    "most_called": r"grep -rhoE '[a-z_]+\(' src | sort | uniq -c | head -1 | sed -E 's/^ *[0-9]+ //; s/\($//'",
    "largest": "ls -S data | head -1",  # a subdirectory sorts by its own size, and files below it are missed
    "rename": 'for f in notes/*.txt; do mv "$f" "${f%.txt}.md"; done',  # misses notes/old/
    "cleanup": "rm -f tmp/*",  # deletes the other scratch files too
    "count": "ls data/*.csv | wc -l > count.txt",  # misses data/extra/
}


def _log_file(rng: random.Random, error: bool) -> str:
    lines = [f"2026-0{rng.randint(1, 9)}-1{rng.randint(0, 9)} {rng.randint(10, 23)}:{rng.randint(10, 59)} "
             f"{rng.choice(('INFO', 'WARN', 'DEBUG'))} {rng.choice(WORDS)} {rng.choice(WORDS)}"
             for _ in range(rng.randint(2, 8))]
    if error:
        lines.insert(rng.randrange(len(lines) + 1), f"2026-01-01 12:00 ERROR {rng.choice(WORDS)} failed")
    return "\n".join(lines) + "\n"


def _sources(rng: random.Random) -> dict[str, str]:
    """Python files under src/ whose defined functions call each other; the most called one is unique."""
    names = rng.sample(FUNCTIONS, rng.randint(4, 7))
    counts = [rng.randint(0, 5) for _ in names]
    counts[rng.randrange(len(names))] = max(counts) + rng.randint(1, 3)
    calls = [name for name, count in zip(names, counts) for _ in range(count)]
    rng.shuffle(calls)
    files: dict[str, list[str]] = {f"src/{w}.py": [] for w in rng.sample(WORDS, rng.randint(2, 4))}
    paths = sorted(files)
    for name in names:
        files[rng.choice(paths)].append(f"def {name}(x):\n    return x\n")
    for i in range(0, len(calls), 3):  # calls grouped three to a line-block, in some file
        body = "\n".join(f"    total += {call}(value)" for call in calls[i:i + 3])
        files[rng.choice(paths)].append(f"def step_{i}(value):\n    total = 0\n{body}\n    return total\n")
    return {path: "\n\n".join(parts) + "\n" for path, parts in files.items()}


def build_tree(seed: int) -> dict[str, str]:
    """The task's files, {relative path: text}, a function of `seed` alone."""
    rng = random.Random(f"terminal-tree/{seed}")
    files: dict[str, str] = {"README.md": f"# {rng.choice(PROJECTS)}\n\nA small project.\n"}
    for i in range(rng.randint(3, 8)):
        folder = "logs/archive" if rng.random() < 0.25 else "logs"
        files[f"{folder}/service-{i}.log"] = _log_file(rng, rng.random() < 0.5)
    for word in rng.sample(WORDS, rng.randint(4, 8)):
        folder = "notes/old" if rng.random() < 0.25 else "notes"
        files[f"{folder}/{word}.{rng.choice(('txt', 'txt', 'md', 'rst'))}"] = f"{word} notes\n" * rng.randint(1, 5)
    files.update(_sources(rng))
    sizes = rng.sample(range(20, 4000), rng.randint(3, 6))  # distinct sizes: one largest file
    for word, size in zip(rng.sample(WORDS, len(sizes)), sizes):
        extension = rng.choice(("csv", "csv", "json"))
        files[f"data/{word}.{extension}"] = ("x" * (size - 1)) + "\n"
    if rng.random() < 0.5:
        files["data/extra/more.csv"] = "a,b\n"
    for word in rng.sample(WORDS, rng.randint(2, 6)):
        files[f"tmp/{word}.{rng.choice(('bak', 'bak', 'tmp', 'log'))}"] = "scratch\n"
    return files


def write_tree(root: Path, files: dict[str, str]) -> None:
    for path, text in files.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)


def read_tree(root: Path) -> dict[str, str | None]:
    """{relative path: text} of the regular files below `root` (None for anything else: links, FIFOs, sockets,
    devices, a file past MAX_STATE_BYTES), read without following links; at most MAX_STATE_FILES entries."""
    out: dict[str, str | None] = {}
    for parent, dirs, names in os.walk(root, followlinks=False):
        for name in sorted(names) + sorted(d for d in dirs if os.path.islink(os.path.join(parent, d))):
            if len(out) >= MAX_STATE_FILES:
                return out
            path = os.path.join(parent, name)
            relative = os.path.relpath(path, root)
            st = os.lstat(path)
            if not os.path.isfile(path) or os.path.islink(path) or st.st_size > MAX_STATE_BYTES:
                out[relative] = None
                continue
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                out[relative] = None
                continue
            with os.fdopen(fd, "rb") as f:
                out[relative] = f.read(MAX_STATE_BYTES).decode("utf-8", errors="replace")
    return out


def expected_answer(kind: str, files: dict[str, str]) -> str | None:
    if kind == "errors":
        return str(sum(1 for path, text in files.items() if path.startswith("logs/") and "ERROR" in text))
    if kind == "most_called":
        text = "".join(t for p, t in files.items() if p.startswith("src/"))
        defined = [line[4:line.index("(")] for line in text.splitlines() if line.startswith("def ")]
        calls = {name: text.count(f"{name}(") - text.count(f"def {name}(") for name in defined}
        return max(calls, key=calls.get)
    if kind == "largest":
        data = {p: t for p, t in files.items() if p.startswith("data/")}
        return max(data, key=lambda p: len(data[p].encode())).split("/")[-1]
    return None


def expected_tree(kind: str, files: dict[str, str]) -> dict[str, str] | None:
    if kind == "rename":
        return {(p[:-4] + ".md" if p.startswith("notes/") and p.endswith(".txt") else p): t for p, t in files.items()}
    if kind == "cleanup":
        return {p: t for p, t in files.items() if not (p.startswith("tmp/") and p.endswith(".bak"))}
    if kind == "count":
        count = sum(1 for p in files if p.startswith("data/") and p.endswith(".csv"))
        return {**files, "count.txt": str(count)}
    return None


def _wrong_answer(kind: str, files: dict[str, str], answer: str, rng: random.Random) -> str:
    """A wrong answer of the right sort: another count, another defined function, another data file."""
    if kind == "errors":
        return near_miss(answer, rng)
    if kind == "most_called":
        text = "".join(t for p, t in files.items() if p.startswith("src/"))
        others = [line[4:line.index("(")] for line in text.splitlines() if line.startswith("def ")
                  and not line.startswith("def step_")]
    else:
        others = [p.split("/")[-1] for p in files if p.startswith("data/")]
    return rng.choice(sorted(set(others) - {answer}))


class TerminalEpisode(SandboxEpisode):
    def setup(self) -> None:
        write_tree(self.workdir, build_tree(json.loads(self.task.state)["seed"]))

    def reward(self, final: str) -> float:
        state = json.loads(self.task.state)
        kind = state["kind"]
        if kind in ANSWER_KINDS:
            return self.env.reward(self.task, final)
        expected, got = expected_tree(kind, build_tree(state["seed"])), read_tree(self.workdir)
        if kind == "count":  # the number, with or without a newline after it
            got = {**got, "count.txt": (got.get("count.txt") or "").strip()}
        return 1.0 if got == expected else 0.0


@register("terminal")
class TerminalEnv(Environment):
    """Shell tasks on a generated project tree (see the module docstring); `levels`: the task kinds to draw."""

    domain = "terminal"
    system_prompt = ("You are in a project directory. Use the bash tool to inspect and change it. When done, reply "
                     "without a tool call; give an answer the task asks for in \\boxed{}.")
    tools = (BASH_TOOL,)
    max_turns = 6

    def __init__(self, levels: Sequence[int] = LEVELS, *, failure_share: float = FAILURE_SHARE):
        levels = tuple(levels)
        if not levels or any(level not in LEVELS for level in levels):
            raise ValueError(f"terminal: levels must be a non-empty subset of {LEVELS}, got {levels}")
        self.levels, self.failure_share = levels, failure_share

    def generate(self, rng: random.Random) -> Task:
        level = rng.choice(self.levels)
        kind, seed = KINDS[level - 1], rng.randrange(10 ** 6)
        project = f"{PROJECTS[seed % len(PROJECTS)]}-{seed}"
        return Task(prompt=f"Project {project}. {PROMPTS[kind]}", answer=expected_answer(kind, build_tree(seed)),
                    domain=self.domain, difficulty=level, state=json.dumps({"kind": kind, "seed": seed}),
                    reference=call_turn("bash", {"command": SOLUTIONS[kind]}))

    def sft_examples(self, n: int, seed: int = 0) -> list[dict]:
        """`n` expert trajectories of training tasks, `failure_share` of them failed, each prefixed with its
        outcome (`hybridtron.envs.agentic_sft`)."""
        return expert_examples(self, n, seed, failure_share=self.failure_share)

    def expert_plans(self, task: Task, failure: bool, rng: random.Random) -> list[tuple[str, Plan]]:
        """The expert's ways through `task`, to be tried in order (`agentic_sft.expert_example`); an answer is the
        last line the last command printed, boxed, and a state task ends with "Done.". Success: the reference
        command ("direct"), or first a listing of the folder the task is about ("explore", one in four), or first
        the command with its program misspelt and its "command not found" ("recover", one in four). Failure, one
        picked first and the others after: the kind's plausible wrong command (`MISTAKES`, "wrong_command"), the
        misspelt command and no retry ("typo"), and for an answer, the right command with a wrong reading of it
        (another count, function or file: "misread")."""
        state = json.loads(task.state)
        kind, command = state["kind"], SOLUTIONS[state["kind"]]
        program, rest = command.split(" ", 1)
        typo = call_turn("bash", {"command": f"{misspelt(program)} {rest}"})
        wrong = _wrong_answer(kind, build_tree(state["seed"]), task.answer, rng) if kind in ANSWER_KINDS else None

        def finish(outputs: list[str], answer: str | None = None) -> str:
            if kind not in ANSWER_KINDS:
                return "Done."
            lines = outputs[-1].strip().splitlines() if outputs else []
            return f"The answer is \\boxed{{{answer or (lines[-1].strip() if lines else '')}}}."

        listing = call_turn("bash", {"command": f"find {FOLDERS[kind]} | sort"}, "First, what is there:")
        plans = {
            "direct": lambda outputs: finish(outputs) if outputs else task.reference,
            "explore": lambda outputs: (listing, task.reference)[len(outputs)] if len(outputs) < 2
            else finish(outputs),
            "recover": lambda outputs: (typo, call_turn("bash", {"command": command}, f"I misspelt {program}; again:"))
            [len(outputs)] if len(outputs) < 2 else finish(outputs),
            "wrong_command": lambda outputs: finish(outputs) if outputs else call_turn("bash",
                                                                                       {"command": MISTAKES[kind]}),
            "typo": lambda outputs: finish(outputs) if outputs else typo,
            "misread": lambda outputs: finish(outputs, wrong) if outputs else task.reference,
        }
        if not failure:
            order = [rng.choice(("explore", "recover", "direct", "direct")), "direct"]
            return [(name, plans[name]) for name in dict.fromkeys(order)]
        order = ["wrong_command", "typo"] + (["misread"] if kind in ANSWER_KINDS else [])
        order.insert(0, order.pop(rng.randrange(len(order))))
        return [(name, plans[name]) for name in order]

    def episode(self, task: Task) -> Episode:
        if not task.state:
            raise ValueError(f"terminal: task {task.id} has no state (its tree's seed)")
        return TerminalEpisode(self, task)

    def reward(self, task: Task, completion: str) -> float:
        """The answer kinds: the final turn's answer equals the expected one (a name read without quotes, a
        directory or an extension's case). The state kinds are graded by their episode's final tree."""
        if task.answer is None:
            raise ValueError(f"terminal: task {task.id} is graded on its final tree, not on an answer; run it "
                             "through an episode (env.episode(task).reward(final))")
        got = extract_answer(completion)
        if got is None:
            return 0.0
        got = got.strip().strip("`'\"").removeprefix("\\text{").removesuffix("}").strip()
        return 1.0 if got.split("/")[-1].removesuffix("()") == task.answer else 0.0
