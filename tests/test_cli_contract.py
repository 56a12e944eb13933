"""The command line's contract, over every command of the registry (`hybridtron.cli.COMMANDS`) and every
subcommand of `eval` and `ladder`:

- `--help` works (exit 0) and shows the command's usage;
- a command that reads a model or checkpoint path, given a missing path, an empty directory, a directory holding
  some other file, a run directory (`hf/` holding a checkpoint, beside `checkpoints/`), a training checkpoint (a
  DCP step directory, `.metadata`) or an HF checkpoint, either works (exit 0) or says why not in ONE line on stderr,
  `hybridtron CMD: error: ...`, naming the option and the path (exit 2); a command that reads an HF checkpoint
  takes a run directory for its `hf/` export and points a training checkpoint at `hybridtron convert`;
- output piped into a closed pipe (`hybridtron plan ... | head -2`) ends quietly;
- nothing prints a traceback.

Every case runs in this process through `hybridtron.cli.main`, except the pipe's, which needs a real pipe and so a
process of its own. Commands that would start a long job given a usable checkpoint (serve, the training commands)
are run only to a refusal that comes after the path was taken (a busy port, `--steps 0`, a missing data file): the
refusal names that later check, so the path was accepted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import types
from typing import NamedTuple

import pytest
import torch

import hybridtron.eval
from hybridtron.checkpoint import save_pretrained
from hybridtron.cli import COMMANDS, build_parser, main
from hybridtron.data.chat import save_tokenizer_files
from hybridtron.data.tokenizer import Tokenizer
from hybridtron.model.lm import HybridLM

PATH, OUT = "{path}", "{out}"  # placeholders in the argument lists below
KINDS = ("missing", "empty", "other_file", "training_checkpoint", "run_directory", "checkpoint")
REFUSED = ("missing", "empty", "other_file")  # no command can use these: one line, exit 2

class Case(NamedTuple):
    """How the contract runs a command that reads a model or checkpoint path."""

    argv: list[str]  # PATH: the path under test
    option: str  # the option that takes the path
    # what shows that a usable checkpoint was taken: None where the command then runs to its end (exit 0), else the
    # text of the later refusal it is run into
    later_refusal: str | None
    # the path must be an HF checkpoint: a run directory stands for its hf/ export, a training checkpoint is refused
    # naming `hybridtron convert` (False: the command takes run directories or training checkpoints on its own terms)
    hf: bool = True


PATH_COMMANDS = {
    "generate": Case(["generate", "--model", PATH, "--prompt", "def f(", "--max-tokens", "3"], "--model", None),
    "serve": Case(["serve", "--model", PATH, "--port", "{busy_port}"], "--model", "cannot listen there"),
    "memory": Case(["memory", "--config", PATH, "--context", "64"], "--config", None),
    "plan": Case(["plan", "--config", PATH, "--gpus", "8", "--seq-len", "64", "--tokens-per-iter", "512", "--top",
                  "1"], "--config", None),
    "slice": Case(["slice", "--model", PATH, "--layers", "4", "--out", OUT], "--model", None),
    # (quantizing takes seconds: run into the refusal of an --out that holds something else)
    "quantize": Case(["quantize", "--model", PATH, "--format", "fp8", "--out", "{other_file}"], "--model",
                     "is not empty and holds no checkpoint"),
    "convert": Case(["convert", "--from", PATH, "--to", OUT], "--from", None, hf=False),
    "report": Case(["report", PATH, "--out", OUT + "/report.html"], "RUN_DIR", None, hf=False),
    "sft": Case(["sft", "--model", PATH, "--data", OUT + "/none.jsonl", "--out", OUT], "--model", "no such file"),
    "grpo": Case(["grpo", "--model", PATH, "--env", "math", "--out", OUT, "--steps", "0"], "--model",
                 "train.steps must be positive"),
    "mopd": Case(["mopd", "--student", PATH, "--general", "{checkpoint}", "--out", OUT, "--steps", "0"], "--student",
                 "train.steps must be positive"),
    "mtp-boost": Case(["mtp-boost", "--model", PATH, "--out", OUT, "--steps", "0"], "--model",
                      "train.steps must be positive"),
    "pretrain": Case(["pretrain", "--phase", "long_context", "--from", PATH, "--out", OUT, "--steps", "0"], "--from",
                     "train.steps must be positive", hf=False),
    "branch": Case(["branch", "--from", PATH, "--steps", "1", "--out", OUT], "--from", None, hf=False),
    "pipeline": Case(["pipeline", "--base", PATH, "--out", OUT, "--set", "pipeline.threads=-1"], "--base",
                     "pipeline.threads must be >= 0"),
    "eval tasks": Case(["eval", "tasks", "--model", PATH, "--env", "math", "--tasks", "1", "--max-tokens", "4"],
                       "--model", None),
    "eval loss": Case(["eval", "loss", "--model", PATH, "--lengths", "32", "--windows", "1", "--data", "{documents}",
                       "--held-out", "0"], "--model", None),
    "eval ruler": Case(["eval", "ruler", "--model", PATH, "--lengths", "64", "--samples", "1", "--tasks",
                        "niah_single_1"], "--model", "at length 64"),
    "eval harness": Case(["eval", "harness", "--model", PATH, "--tasks", "hellaswag", "--limit", "1"], "--model",
                         None),
}
NO_PATH_COMMANDS = {"precision", "ladder plan", "ladder run", "ladder fit"}


def subcommands(command: str) -> list[str]:
    """The subcommands a command's parser declares (none: [])."""
    parser = build_parser(load=command)
    top = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    actions = [a for a in top.choices[command]._actions if isinstance(a, argparse._SubParsersAction)]
    return list(actions[0].choices) if actions else []


EVERY = [name for command in COMMANDS for name in
         ([f"{command} {sub}" for sub in subcommands(command)] or [command])]


@pytest.fixture(scope="module")
def paths(tmp_path_factory, small_config):
    """One directory of each kind in KINDS (the checkpoint: a small model with a chat tokenizer)."""
    root = tmp_path_factory.mktemp("contract")
    text = "def generate_tokens(model, prompt):\n    return model(prompt)\n" * 40 + "The quick brown fox. " * 40
    tokenizer = Tokenizer.train([text], 600)
    torch.manual_seed(0)
    checkpoint = root / "checkpoint"
    save_pretrained(HybridLM(small_config(vocab_size=640, max_position_embeddings=256)).eval(), checkpoint)
    save_tokenizer_files(tokenizer, checkpoint)
    run = root / "run"
    shutil.copytree(checkpoint, run / "hf")
    step = run / "checkpoints" / "step_000010"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    (root / "empty").mkdir()
    (root / "other").mkdir()
    (root / "other" / "notes.txt").write_text("not a checkpoint\n")
    (root / "documents.jsonl").write_text(json.dumps({"text": text}) + "\n")
    return {"documents": root / "documents.jsonl", "missing": root / "missing", "empty": root / "empty",
            "other_file": root / "other", "training_checkpoint": step, "run_directory": run, "checkpoint": checkpoint}


@pytest.fixture
def busy_port():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


@pytest.fixture
def fake_lm_eval(monkeypatch):
    """lm-evaluation-harness replaced by a stub that records its arguments (the real one takes seconds to index its
    tasks, and would download a dataset)."""
    calls = []
    stub = types.SimpleNamespace(MODEL_NAME="hybridtron", main=calls.append)
    monkeypatch.setitem(sys.modules, "hybridtron.eval.lm_eval_adapter", stub)
    monkeypatch.setattr(hybridtron.eval, "lm_eval_adapter", stub, raising=False)
    return calls


def run_cli(argv, capsys):
    """(exit status, stdout, stderr) of `hybridtron ARGV` in this process."""
    try:
        status = main(argv)
    except SystemExit as exc:  # argparse: --help, or a malformed command line
        status = exc.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, err
    return status, out, err


# ------------------------------------------------------------------------------------------------------ help
@pytest.mark.parametrize("command", EVERY)
def test_every_command_has_help(command, capsys):
    status, out, _ = run_cli([*command.split(), "--help"], capsys)
    assert status == 0 and out.startswith(f"usage: hybridtron {command}")


def test_every_command_is_in_the_contract():
    """A new command (or subcommand) declares here whether it reads a model path, so the cases below cover it."""
    assert set(EVERY) == set(PATH_COMMANDS) | NO_PATH_COMMANDS


# ----------------------------------------------------------------------------------------------------- paths
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("command", list(PATH_COMMANDS))
def test_a_path_works_or_gets_one_line(command, kind, paths, busy_port, fake_lm_eval, tmp_path, capsys):
    """Exit 0, or exit 2 with one line `hybridtron CMD: error: ...` naming the option and the path; an HF command
    takes a run directory and a checkpoint (runs with them, or gets as far as the case's later refusal) and points a
    training checkpoint at `hybridtron convert`."""
    template, option, later_refusal, hf = PATH_COMMANDS[command]
    path = paths[kind]
    argv = [a.format(path=path, out=tmp_path / "out", busy_port=busy_port, checkpoint=paths["checkpoint"],
                     documents=paths["documents"], other_file=paths["other_file"]) for a in template]
    status, _, err = run_cli(argv, capsys)
    lines = err.strip().splitlines()
    name = command.split()[0]
    usable = kind in ("checkpoint", "run_directory") and hf
    if status == 0:
        assert kind not in REFUSED and (usable or not hf), err
        if usable:
            assert later_refusal is None, f"{command} started work it should have refused: {err}"
        if command == "eval harness":  # lm_eval was given the HF checkpoint, a run directory's export
            assert f"pretrained={paths['checkpoint'] if kind == 'checkpoint' else path / 'hf'}" in \
                fake_lm_eval[-1][fake_lm_eval[-1].index("--model_args") + 1]
        return
    assert status == 2 and len(lines) == 1, f"{command} on a {kind}: exit {status}, stderr:\n{err}"
    assert lines[0].startswith(f"hybridtron {name}: error: "), lines[0]
    if kind in REFUSED or kind == "training_checkpoint":
        assert str(path) in lines[0], lines[0]
        if hf:
            assert option in lines[0], lines[0]
    if hf and kind == "training_checkpoint":
        assert "hybridtron convert" in lines[0], lines[0]
    if usable:  # the path was taken: what refused it is the later check the case runs into
        assert later_refusal is not None and later_refusal in lines[0], lines[0]


# ------------------------------------------------------------------------------------------------------ pipes
@pytest.mark.parametrize("argv", [["memory", "--preset", "ultra3", "--weights", "nvfp4"], ["--help"]],
                         ids=["memory", "help"])
def test_output_into_a_closed_pipe_ends_quietly(argv):
    """`hybridtron memory ... | head -2` where head has gone: no BrokenPipeError, nothing on stderr, exit 141 (what
    the shell reports for a command the pipe stopped); argparse's help too. The pipe's read end is closed before
    the command writes, so every write fails. Block-buffered, as a pipe is by default, the write happens when the
    output is flushed, after the command returned. `hybridtron.cli.main` handles it for every command (a process
    of its own: seconds, so one command stands for all)."""
    read, write = os.pipe()
    os.close(read)
    environment = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}
    try:
        done = subprocess.run([sys.executable, "-m", "hybridtron", *argv], stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=120, env=environment)
    finally:
        os.close(write)
    assert done.returncode == 141 and done.stderr == "", done.stderr


def test_a_broken_pipe_of_the_commands_own_is_not_hidden(monkeypatch):
    """A BrokenPipeError while stdout's reader is still there (a worker process the command talks to died) is a
    failure, not `| head`: it propagates instead of ending quietly."""
    import hybridtron.distributed.plan

    def broken(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(hybridtron.distributed.plan, "run", broken)
    with pytest.raises(BrokenPipeError):
        main(["plan", "--preset", "tiny", "--gpus", "1"])
