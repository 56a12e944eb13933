"""`hybridtron <command>`: one entry point; each command lives beside the code it drives.

Every command module defines `add_arguments(parser)` and `run(args) -> int | None` (the training commands through
the run scaffold, hybridtron.train.run). The registry below is lazy: a command's module, with torch and everything
it imports, loads only when that command runs or shows its help, so `hybridtron --help` stays fast.

How every command ends (`main`): a user's mistake (ValueError, FileNotFoundError) is one line `hybridtron CMD:
error: ...` and exit 2; an interruption or a deliberate stop says so; output piped to a reader that went away
(`hybridtron plan ... | head -2`) ends quietly with exit 141. tests/test_cli_contract.py holds every command to it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import select
import sys

from hybridtron import __version__
from hybridtron.errors import RunInterrupted, RunStopped

COMMANDS = {
    "pretrain": ("hybridtron.train.pretrain", "train a hybrid model from scratch on a bucketed data mixture"),
    "precision": ("hybridtron.numerics.policy", "show which module runs in which number format, and FLOP shares"),
    "branch": ("hybridtron.experiments.branch", "continue a checkpoint in NVFP4 and in BF16; report the loss gap"),
    "ladder": ("hybridtron.experiments.ladder.command", "a scaling ladder: isoFLOP rungs, trained and fitted"),
    "report": ("hybridtron.train.report", "write an HTML stability report of a run (works while it runs)"),
    "eval": ("hybridtron.eval.command", "evaluate a checkpoint: pass@k on tasks, loss by position, RULER, lm-eval"),
    "generate": ("hybridtron.infer.generate", "generate text from a checkpoint, streaming to the terminal"),
    "serve": ("hybridtron.infer.server.command", "serve a checkpoint with an OpenAI-compatible HTTP API"),
    "memory": ("hybridtron.infer.memory", "KV cache and Mamba state memory of a model at a context and batch"),
    "sft": ("hybridtron.post.sft", "fine-tune a model on conversations, with the loss on the assistant's tokens"),
    "grpo": ("hybridtron.post.grpo", "reinforcement learning with verifiable rewards (GRPO) on an environment"),
    "mopd": ("hybridtron.post.mopd", "multi-teacher on-policy distillation: each domain's teacher scores the student"),
    "mtp-boost": ("hybridtron.post.mtp_boost", "train only the MTP block to raise speculative acceptance"),
    "pipeline": ("hybridtron.recipe.pipeline", "the whole recipe, pretraining to MTP boosting, resumable stage by stage"),
    "plan": ("hybridtron.distributed.plan", "rank parallel layouts (DP, TP, PP, CP, EP) by memory and step time"),
    "convert": ("hybridtron.distributed.convert", "convert a sharded (DCP) training checkpoint to HF, or HF to DCP"),
    "slice": ("hybridtron.deploy.slice", "an N-layer slice of a checkpoint (or of a preset's config) for smoke tests"),
    "quantize": ("hybridtron.deploy.quantize", "post-training quantization to NVFP4 or FP8 in ModelOpt's format"),
}


def build_parser(load: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridtron", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"hybridtron {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, summary) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=summary, description=summary)
        if name == load:
            importlib.import_module(module_name).add_arguments(command_parser)
    return parser


def stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reading end is closed (poll reports an error on it)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
    except (OSError, ValueError, AttributeError):  # not a file descriptor (a test's capture), or no poll here
        return False
    return any(events & select.POLLERR for _, events in poller.poll(0))


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            status = run_command(sys.argv[1:] if argv is None else argv)
        except SystemExit:  # argparse's --help and usage errors: their text may still wait in stdout's buffer
            sys.stdout.flush()
            raise
        sys.stdout.flush()  # here, not in the interpreter's flush at exit, a closed pipe is seen by the handler below
        return status
    except BrokenPipeError:
        if not stdout_reader_gone():  # a pipe of the command's own broke (a worker process died): a real failure
            raise
        # the reader went away (`hybridtron plan ... | head -2`): what it wanted, it has. Python ignores SIGPIPE, so
        # a write raises instead; point stdout at devnull, or the interpreter's flush at exit raises again (Python's
        # docs, "Note on SIGPIPE"). 141 = 128 + SIGPIPE, what the shell reports for a command the pipe stopped.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141


def run_command(argv: list[str]) -> int:
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(load=command if command in COMMANDS else None)
    args = parser.parse_args(argv)
    # under torchrun every rank ends the same way; global rank 0 alone says so
    say = (lambda line: print(line, file=sys.stderr)) if int(os.environ.get("RANK", "0")) == 0 else (lambda line: None)
    try:
        module = importlib.import_module(COMMANDS[args.command][0])
        return int(module.run(args) or 0)
    except (ValueError, FileNotFoundError) as exc:  # a user's mistake: one clear line, no traceback
        say(f"hybridtron {args.command}: error: {exc}")
        return 2
    except RunInterrupted as exc:  # Ctrl-C or SIGTERM: the step finished and a checkpoint holds it
        say(f"hybridtron {args.command}: interrupted: {exc}"
            + (f"; resume with: {exc.resume_command}" if exc.resume_command else ""))
        return exc.exit_code
    except RunStopped as exc:  # the run ended itself on purpose; what it wrote is intact
        say(f"hybridtron {args.command}: stopped: {exc}")
        return exc.exit_code
    except KeyboardInterrupt:  # a second Ctrl-C, or one before training began: stop at once
        say(f"hybridtron {args.command}: interrupted at once; the latest complete checkpoint (if any) is intact "
            f"and --resume continues from it")
        return 130


if __name__ == "__main__":
    sys.exit(main())
