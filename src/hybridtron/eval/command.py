"""`hybridtron eval`: a checkpoint measured four ways, each a subcommand.

    hybridtron eval tasks --model runs/pipe/rlvr --env math --levels 1,2 --tasks 200
    hybridtron eval loss  --model runs/long --lengths 256,1k,2k --out runs/long/eval
    hybridtron eval ruler --model runs/long --lengths 256,1k,2k --samples 10 --out runs/long/eval
    hybridtron eval harness --model runs/long --tasks TASK [--include-path DIR] [--limit N]

`tasks`: pass@1 (pass@k with samples) on the held-out tasks of the environments (hybridtron.eval.tasks). `loss`: the
held-out next-token loss by position bucket on long documents, the standard long-context signal (does the loss keep
falling past the training length? hybridtron.eval.positions). `ruler`: RULER's synthetic tasks at each length,
scored as RULER scores them (hybridtron.eval.ruler). `harness`: lm-evaluation-harness with hybridtron's engine as
its model `hybridtron` (hybridtron.eval.lm_eval_adapter; the optional `eval` extra). Every subcommand reads any
`nemotron_h` checkpoint with its tokenizer (ours or one transformers wrote), or a run directory's `hf/` export
(`resolve_checkpoint_dir`). Every option is checked, and every output path found writable, before the model loads
(`hybridtron.eval.options`); while one runs, a progress line with an estimate goes to stderr (`--quiet`: none).
"""

from __future__ import annotations

import argparse
import json
from contextlib import ExitStack
from pathlib import Path

import torch

from hybridtron.checkpoint import load_pretrained
from hybridtron.checkpoint.hf import resolve_checkpoint_dir
from hybridtron.config import ModelConfig
from hybridtron.data.build import split_validation
from hybridtron.data.chat import THINKING_SWITCH, load_chat_tokenizer
from hybridtron.envs import env_names, get_env
from hybridtron.eval.options import check_device, check_output_path
from hybridtron.eval.positions import (DEFAULT_SOURCE, check_length, checkpoint_with_tokenizer,
                                       load_model_and_tokenizer, loss_by_position, parse_lengths, plot_position_loss,
                                       source_documents)
from hybridtron.eval.ruler import TASKS, Haystack, plot_ruler, run_ruler, task_spec
from hybridtron.eval.tasks import evaluate_env, task_prompts
from hybridtron.infer.decoder import check_max_tokens
from hybridtron.infer.engine import load_engine
from hybridtron.infer.memory import human_bytes, slot_bytes
from hybridtron.train.long_context import PHASE_DATA
from hybridtron.train.preflight import available_memory

# the share of a source's origins held out by default: the long-context phase's data.val_fraction, so that `eval
# loss` reads documents the phase never trained on
HELD_OUT = PHASE_DATA.val_fraction


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="eval_command", metavar="SUBCOMMAND", required=True)
    add_tasks_arguments(sub.add_parser("tasks", help="pass@k on the held-out tasks of environments (math, code, copy)",
                                       description="pass@1 (pass@k with --samples) on environments' test splits"))
    add_loss_arguments(sub.add_parser("loss", help="held-out loss by position bucket on long documents",
                                      description="held-out next-token loss by position bucket at each length"))
    add_ruler_arguments(sub.add_parser("ruler", help="RULER's synthetic long-context tasks, scored as RULER",
                                       description="RULER-style tasks (needles, variable tracking, common and "
                                                   "frequent words) at each length"))
    add_harness_arguments(sub.add_parser(
        "harness", help="lm-evaluation-harness tasks with hybridtron's engine as the model",
        description="lm-evaluation-harness (the optional `eval` extra: pip install -e .[eval]) on a checkpoint; "
                    "every lm_eval option: python -m hybridtron.eval.lm_eval_adapter --model hybridtron ..."))


def add_quiet(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quiet", action="store_true", help="no progress line on stderr (default: one, with an "
                                                             "estimate of the time left)")


def check_positive(**options: int) -> None:
    """ValueError naming the first option (`batch_size` is --batch-size) whose value is below 1."""
    for name, value in options.items():
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} {value}: expected an integer >= 1")


def run(args) -> int:
    return {"tasks": run_tasks, "loss": run_loss, "ruler": run_ruler_command, "harness": run_harness}[
        args.eval_command](args)


# -------------------------------------------------------------------------------------------------- tasks
def add_tasks_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="an HF checkpoint directory with its tokenizer files and chat "
                                                       "template, or a run directory with an hf/ export (required)")
    parser.add_argument("--env", default="math", help="environments, comma-separated: math, code, copy (default: math)")
    parser.add_argument("--levels", help="difficulty levels, e.g. 1,2 (default: each environment's own)")
    parser.add_argument("--tasks", type=int, default=200, help="test-split tasks per environment (default: 200)")
    parser.add_argument("--samples", type=int, default=1, help="completions per task; above 1 needs --temperature "
                                                               "(default: 1)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    parser.add_argument("--max-tokens", type=int, default=256, help="completion length cap; the longest prompt and "
                                                                    "it must fit in the model's context (default: "
                                                                    "256)")
    parser.add_argument("--batch-size", type=int, default=32, help="prompts decoded together (default: 32)")
    parser.add_argument("--thinking", choices=tuple(THINKING_SWITCH), default="auto",
                        help="the generation prompt's thinking switch: auto (the model decides), on (opens <think>), "
                             "off (an empty <think></think>) (default: auto)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the task draw and of sampling (default: 0)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: 0, torch's)")
    parser.add_argument("--json", help="also write the results (and 5 sample completions per environment) to this "
                                       "file, in a directory that exists (default: none)")
    add_quiet(parser)


def parse_levels(text: str | None) -> dict:
    """--levels 1,2 as get_env's keyword."""
    if not text:
        return {}
    items = [item.strip() for item in text.split(",")]
    if not all(item.isdigit() for item in items):
        raise ValueError(f"--levels {text}: expected difficulty levels, comma-separated integers such as 1,2")
    return {"levels": tuple(int(item) for item in items)}


def run_tasks(args) -> int:
    names = [n.strip() for n in args.env.split(",") if n.strip()]
    for name in names or [args.env]:
        if name not in env_names():
            raise ValueError(f"--env {name!r}: unknown environment; known: {', '.join(env_names())}")
    levels = parse_levels(args.levels)
    check_positive(tasks=args.tasks, samples=args.samples, max_tokens=args.max_tokens, batch_size=args.batch_size)
    if args.temperature < 0:
        raise ValueError(f"--temperature {args.temperature}: expected >= 0 (0 = greedy)")
    if args.samples > 1 and args.temperature == 0:
        raise ValueError(f"--samples {args.samples} needs a --temperature above 0 (greedy samples are all the same)")
    if args.threads < 0:
        raise ValueError(f"--threads {args.threads}: expected >= 1, or 0 for torch's default")
    if args.json:
        check_output_path(args.json, "--json", directory=False)
    directory, _ = resolve_checkpoint_dir(args.model)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_pretrained(directory, dtype=torch.float32)
    tokenizer = load_chat_tokenizer(directory, vocab_size=model.config.vocab_size, require_template=True)
    thinking = THINKING_SWITCH[args.thinking]
    results = {}
    with ExitStack() as stack:
        envs = {}
        for name in names:
            try:
                envs[name] = stack.enter_context(get_env(name, **levels))
            except ValueError as error:
                if not levels:
                    raise
                raise ValueError(f"--levels {args.levels}: {error}") from None  # the name is known: not its levels
        drawn = {name: env.tasks("test", args.tasks, args.seed) for name, env in envs.items()}
        for name, env in envs.items():  # every environment's before any is evaluated
            longest = max(len(ids) for ids in task_prompts(tokenizer, env, drawn[name], thinking))
            check_max_tokens(args.max_tokens, longest, model.config.max_position_embeddings, option="--max-tokens",
                             prompt=f"the longest {name} prompt")
        for name, env in envs.items():
            result = evaluate_env(model, tokenizer, env, drawn[name], samples=args.samples,
                                  max_tokens=args.max_tokens, batch_size=args.batch_size,
                                  temperature=args.temperature, seed=args.seed, enable_thinking=thinking,
                                  progress=not args.quiet)
            print(f"{name} test ({args.levels or 'all levels'}): {result.format()}", flush=True)
            results[name] = result.to_dict(samples=5)
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "levels": args.levels, **results}, indent=2))
        print(f"written: {args.json}")
    return 0


# --------------------------------------------------------------------------------------------------- loss
def add_model_and_lengths(parser: argparse.ArgumentParser, lengths_help: str) -> None:
    """The two options every long-context evaluation takes."""
    parser.add_argument("--model", required=True, help="a checkpoint directory with its tokenizer.json, or a run "
                                                       "directory with an hf/ export (required)")
    parser.add_argument("--lengths", required=True, help=f"{lengths_help} (required)")


def add_loss_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_and_lengths(parser, "window lengths in tokens, e.g. 256,1k,2k (k = 1024)")
    parser.add_argument("--data", default=DEFAULT_SOURCE,
                        help=f"the documents: stdlib-repos (each stdlib package one long document), stdlib, a .jsonl "
                             f"or .parquet file (a `text` field) or a directory of text files (default: "
                             f"{DEFAULT_SOURCE})")
    parser.add_argument("--held-out", type=float, default=HELD_OUT,
                        help=f"read only the documents a training run with data.val_fraction = this holds out (the "
                             f"same hash of their origins), 0 = every document (default: {HELD_OUT}, the "
                             f"long-context phase's)")
    parser.add_argument("--windows", type=int, default=16, help="windows per length, at most: one per document long "
                                                                "enough (default: 16)")
    parser.add_argument("--bucket-width", type=int, help="position buckets of this many tokens (default: powers of "
                                                         "two)")
    parser.add_argument("--training-length", type=int, help="mark this length on the plot (the model's training "
                                                            "length)")
    parser.add_argument("--seed", type=int, default=0, help="the order documents are drawn in (default: 0)")
    parser.add_argument("--out", help="write loss_by_position.json and .png here (default: print the table only)")
    add_quiet(parser)


def run_loss(args) -> int:
    lengths = parse_lengths(args.lengths)
    check_positive(windows=args.windows, **({} if args.bucket_width is None else {"bucket_width": args.bucket_width}))
    if args.held_out and not 0 < args.held_out < 1:
        raise ValueError(f"--held-out {args.held_out}: expected a fraction in (0, 1), or 0")
    if args.out:
        check_output_path(args.out, "--out", directory=True)
    model, tokenizer = load_model_and_tokenizer(args.model)
    for length in lengths:  # before the documents load
        check_length(model, length)
    documents = source_documents(args.data)
    if args.held_out:
        documents = [documents[i] for i in split_validation(documents, args.held_out)[1]]
        if not documents:
            raise ValueError(f"--data {args.data}: --held-out {args.held_out} holds out none of its documents; raise "
                             f"it, or give --held-out 0 to read them all")
    result = loss_by_position(model, tokenizer, lengths, documents=documents, source=args.data,
                              windows=args.windows, bucket_width=args.bucket_width, seed=args.seed,
                              progress=not args.quiet)
    print(result.format_table())
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        report = {"model": args.model, "held_out": args.held_out, **result.to_dict()}
        (out / "loss_by_position.json").write_text(json.dumps(report, indent=2) + "\n")
        plot_position_loss(result, out / "loss_by_position.png", training_length=args.training_length)
        print(f"written: {out / 'loss_by_position.json'}, {out / 'loss_by_position.png'}")
    return 0


# -------------------------------------------------------------------------------------------------- ruler
def add_ruler_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_and_lengths(parser, "context lengths in tokens (prompt + answer), e.g. 1k,4k,16k")
    parser.add_argument("--tasks", default=",".join(TASKS),
                        help=f"tasks, comma-separated (default: all of RULER's synthetic ones: {', '.join(TASKS)})")
    parser.add_argument("--samples", type=int, default=10, help="prompts per task and length (default: 10)")
    parser.add_argument("--batch-size", type=int, default=4, help="prompts decoded together (default: 4)")
    parser.add_argument("--seed", type=int, default=0, help="the samples' seed (default: 0)")
    parser.add_argument("--speculative", action="store_true", help="decode with the MTP drafter (the same greedy "
                                                                   "text; default: plain decoding)")
    parser.add_argument("--out", help="write ruler.json and ruler.png here (default: print the table only)")
    add_quiet(parser)


def check_ruler_memory(config, context: int, slots: int) -> None:
    """The engine's cache for `slots` sequences of `context` tokens, against the memory this machine has: one line
    with the estimate when it does not fit."""
    needed = slot_bytes(config, context) * (slots + 1)  # one more row stages the prefills
    available = available_memory(torch.device("cpu"))
    if available is not None and needed > available:
        raise ValueError(f"--lengths {context:,} with --batch-size {slots}: the KV cache and Mamba state need about "
                         f"{human_bytes(needed)} (hybridtron memory), but {human_bytes(available)} is available; "
                         f"ask for shorter lengths or a smaller --batch-size")


def run_ruler_command(args) -> int:
    lengths = parse_lengths(args.lengths)
    tasks = [name.strip() for name in args.tasks.split(",") if name.strip()]
    for task in tasks:
        task_spec(task)  # an unknown task: one line naming the known ones
    check_positive(samples=args.samples, batch_size=args.batch_size)
    if args.out:
        check_output_path(args.out, "--out", directory=True)
    directory = checkpoint_with_tokenizer(args.model)
    config = ModelConfig.from_hf(directory)
    for length in lengths:
        if length > config.max_position_embeddings:
            raise ValueError(f"--lengths {length:,}: beyond the model's max_position_embeddings "
                             f"({config.max_position_embeddings:,}); ask for at most that")
    check_ruler_memory(config, max(lengths), args.batch_size)
    engine = load_engine(directory, speculative=args.speculative, max_slots=args.batch_size,
                         max_context=max(lengths))
    haystack = Haystack.stdlib() if any(task_spec(task).haystack == "text" for task in tasks) else None
    result = run_ruler(engine, tasks, lengths, samples=args.samples, seed=args.seed, haystack=haystack,
                       progress=not args.quiet)
    print(result.table())
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "ruler.json").write_text(json.dumps({"model": args.model, **result.to_dict()}, indent=2) + "\n")
        plot_ruler(result, out / "ruler.png")
        print(f"written: {out / 'ruler.json'}, {out / 'ruler.png'}")
    return 0


# ------------------------------------------------------------------------------------------------ harness
def add_harness_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="a checkpoint directory with its tokenizer.json, or a run "
                                                       "directory with an hf/ export (required)")
    parser.add_argument("--tasks", required=True, help="lm_eval task names or YAML files, comma-separated (required)")
    parser.add_argument("--include-path", help="a directory of your own task YAMLs (default: none)")
    parser.add_argument("--num-fewshot", type=int, help="few-shot examples (default: each task's)")
    parser.add_argument("--limit", type=float, help="examples per task, or a fraction of them (default: all)")
    parser.add_argument("--batch-size", type=int, default=8, help="requests scored or decoded together (default: 8)")
    parser.add_argument("--device", default="cpu", help="where the model runs: cpu, cuda, cuda:N (default: cpu)")
    parser.add_argument("--output-path", help="lm_eval's results directory (default: none)")
    add_quiet(parser)


def check_harness_arguments(args) -> Path:
    """Every `eval harness` option that lm_eval would refuse late (after indexing its tasks: seconds) or with a
    traceback, refused first in one line; returns the checkpoint directory."""
    tasks = [task.strip() for task in args.tasks.split(",") if task.strip()]
    if not tasks:
        raise ValueError(f"--tasks {args.tasks!r}: expected lm_eval task names or YAML files, comma-separated")
    for task in tasks:
        if task.endswith((".yaml", ".yml")) and not Path(task).is_file():
            raise ValueError(f"--tasks {task}: no such task file")
    if args.include_path is not None and not Path(args.include_path).is_dir():
        raise ValueError(f"--include-path {args.include_path}: no such directory (expected a directory of task "
                         f"YAMLs)")
    if args.limit is not None and not (0 < args.limit < 1 or (args.limit >= 1 and args.limit.is_integer())):
        raise ValueError(f"--limit {args.limit:g}: expected a number of examples per task (an integer >= 1) or a "
                         f"fraction of them in (0, 1)")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise ValueError(f"--num-fewshot {args.num_fewshot}: expected an integer >= 0")
    check_positive(batch_size=args.batch_size)
    check_device(args.device)
    if args.output_path:
        check_output_path(args.output_path, "--output-path", directory=None)
    return checkpoint_with_tokenizer(args.model)


def run_harness(args) -> int:
    directory = check_harness_arguments(args)
    try:  # the optional `eval` extra: lm-evaluation-harness, which the adapter plugs into (only `eval harness` needs
        # it, once its arguments are known to be good)
        from hybridtron.eval import lm_eval_adapter
    except ImportError as missing:
        raise ValueError(f"eval harness needs lm-evaluation-harness ({missing}); install it with "
                         f"`pip install -e .[eval]`") from None
    options = {"--include_path": args.include_path, "--num_fewshot": args.num_fewshot, "--limit": args.limit,
               "--output_path": args.output_path}
    model_args = f"pretrained={directory}" + (",progress=False" if args.quiet else "")
    argv = ["--model", lm_eval_adapter.MODEL_NAME, "--model_args", model_args, "--tasks", args.tasks,
            "--batch_size", str(args.batch_size), "--device", args.device]
    for flag, value in options.items():
        if value is not None:
            argv += [flag, str(value)]
    try:
        lm_eval_adapter.main(argv)
    except ConnectionError as error:  # datasets' "Couldn't reach 'NAME' on the Hub (...)", after its retries
        raise ValueError(f"--tasks {args.tasks}: a task's dataset could not be downloaded ({error}): no network, or "
                         f"the Hugging Face Hub is unreachable. Fill the datasets cache where there is a network and "
                         f"set HF_DATASETS_OFFLINE=1 here, or write a task YAML over local files (dataset_path: "
                         f"json, data_files) and pass its directory with --include-path") from None
    except ValueError as error:
        if str(error).startswith("Tasks not found"):  # lm_eval's
            where = f" nor in --include-path {args.include_path}" if args.include_path else ""
            raise ValueError(f"--tasks {args.tasks}: {error} (not among lm_eval's tasks{where}; list them with "
                             f"`python -m hybridtron.eval.lm_eval_adapter ls tasks`)") from None
        raise
    return 0
