"""`hybridtron generate`: stream a checkpoint's continuation of a prompt to the terminal.

    hybridtron generate --model runs/quickstart --prompt "def parse(" --max-tokens 128 --temperature 0

`--model` is a checkpoint directory (config.json, safetensors, tokenizer.json) or a run directory, whose HF export
(`hf/`) is used. The text streams to stdout; a summary line (tokens, time, tokens/s, and the acceptance of
speculative decoding) goes to stderr. `--max-tokens` must fit in the model's context with the prompt: asking for
more is an error that states the limit. With `--compile` a warm-up generation of the same prompt, cut after its
first decode step, compiles the decode step before the timed generation (seconds to tens of seconds on a CPU); the
summary reports that compile apart from the rate of the timed tokens, which is then the steady state.

The work is `hybridtron.infer.engine` (`load_engine`, `HybridEngine.stream_text`); this module keeps its imports
light so that `--help` is fast.
"""

from __future__ import annotations

import argparse
import sys
import time

from hybridtron.infer.decoder import check_max_tokens
from hybridtron.infer.engine import load_engine
from hybridtron.infer.sampling import ParamError, SamplingParams
from hybridtron.infer.speculative import why_no_drafting
from hybridtron.ops.compile_cache import use_compile_cache


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="checkpoint directory (config.json, safetensors, tokenizer.json), or a run directory "
                             "(its hf/ export is used); required")
    parser.add_argument("--prompt", required=True, help="the prompt text (required)")
    parser.add_argument("--max-tokens", type=int, default=128,
                        help="tokens to generate at most (default: %(default)s); prompt + max tokens must fit in "
                             "the model's context")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default: %(default)s)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass; 1 = off (default)")
    parser.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling (default: none)")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    parser.add_argument("--speculative", action=argparse.BooleanOptionalAction, default=None,
                        help="MTP self-speculative decoding (default: on when the model has an MTP block)")
    parser.add_argument("--draft-length", type=int, default=None,
                        help="draft tokens per verification step (default: adapted to the measured acceptance and "
                             "step times, drafting off where it does not pay)")
    parser.add_argument("--prefill-chunk", type=int, default=None,
                        help="prompt tokens per prefill forward (default: the decoder's, 512)")
    parser.add_argument("--state-quant", default="fp32",
                        help="SSM state storage: fp32 (default), fp16_sr, fp16_rtn, bf16_sr, bf16_rtn, int8_sr, "
                             "int8_rtn")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads (default: 1; one sequence's decode step is a chain of small ops, "
                             "where more threads cost more in synchronisation than they save: BENCHMARKS.md)")
    parser.add_argument("--compile", action="store_true",
                        help="the decode steps compiled by torch.compile (static shapes; a warm-up generation "
                             "compiles them first, tens of seconds on a CPU, which the summary reports; faster per "
                             "token after). Turns speculative decoding off unless --speculative is given (each draft "
                             "length it tries compiles its own step)")
    parser.add_argument("--compile-cache", metavar="DIR", default=None,
                        help="with --compile: keep torch.compile's caches in DIR, so that a later run compiling the "
                             "same steps loads them instead (default: torch's own cache directory)")


def summary(count: int, seconds: float, compile_seconds: float | None, stats) -> str:
    """The stderr line: tokens and rate, the compile time (None: not compiled), and what decoding did (`stats`: the
    engine's `last_stats`, None without speculative decoding). It claims only what was measured: the draft lengths
    the verification steps used (their mean acceptance length is at most the longest + 1), and that drafting did not
    pay only where the adaptive controller turned it off at its measured step times."""
    line = f"[{count} token{'' if count == 1 else 's'} in {seconds:.2f}s, {count / max(seconds, 1e-9):.1f} tokens/s"
    if compile_seconds is not None and stats is None:
        line += f" (steady state); decode step compiled in {compile_seconds:.2f}s before them"
    elif compile_seconds is not None:
        line += f"; plain decode step compiled in {compile_seconds:.2f}s before them (each draft length compiles " \
                f"its own step when first tried, within these tokens)"
    if stats is None:
        return line + "; plain decode]"
    off = "drafting off: it did not pay at the measured acceptance and step times" if stats.drafting_off else ""
    if not stats.steps:
        if count < 2:  # the first token comes from the prompt's forward
            return line + "; no decode step, nothing drafted]"
        return line + "; plain decode, no step drafted" + (f" ({off})" if off else "") + "]"
    lengths = sorted(stats.draft_lengths) or [stats.draft_length]
    chosen = f"draft length {lengths[0]}" if len(lengths) == 1 else f"draft lengths {lengths[0]}..{lengths[-1]}"
    if stats.adaptive:  # the controller times its steps: the same seed gives the same text (drafts never change
        # it) but may draft differently from run to run
        chosen += " (adapted to the measured acceptance and step times: they vary run to run)"
    steps = f"{stats.steps} verification step{'' if stats.steps == 1 else 's'}"
    line += f"; speculative, {chosen}: mean acceptance length {stats.mean_acceptance_length:.2f} over {steps}"
    if stats.drafted:
        line += f", {stats.accepted} of {stats.drafted} drafts accepted"
    return line + (f"; then {off}" if off else "") + "]"


def warm_up(engine, prompt_ids: list[int], params) -> float:
    """Seconds of a generation of the timed one's prompt and parameters cut after its first decode step: the
    prompt's prefill, the compile of the decode step (at the cache size and sampling flags the timed generation
    uses, so it compiles nothing again) and one step. Tokens 1 and 2 come out of the same engine step."""
    start = time.perf_counter()
    tokens = engine.stream(prompt_ids, params)
    for count, _ in enumerate(tokens, start=1):
        if count == 2:
            break
    tokens.close()  # cancels the rest
    return time.perf_counter() - start


def run(args) -> int:

    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                max_tokens=args.max_tokens, stop=tuple(args.stop))
    except ParamError as exc:
        raise ValueError(f"--{exc.param.replace('_', '-')}: {exc}") from None
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if args.compile_cache and not args.compile:
        raise ValueError("--compile-cache applies to --compile (nothing is compiled without it)")
    import torch

    torch.set_num_threads(args.threads)
    if args.compile_cache and (warning := use_compile_cache(args.compile_cache)):
        print(warning, file=sys.stderr)
    chunk = {} if args.prefill_chunk is None else {"prefill_chunk": args.prefill_chunk}
    speculative = (not args.compile) if args.speculative is None else args.speculative
    engine = load_engine(args.model, speculative=speculative, draft_length=args.draft_length,
                         state_quant=args.state_quant, compile=args.compile, **chunk)
    if args.speculative and not engine.speculative:
        raise ValueError(f"--speculative: {args.model}: {why_no_drafting(engine.model)}")
    prompt_ids = engine.encode(args.prompt)
    room = engine.max_context - len(prompt_ids)
    if room < 1:
        raise ValueError(f"--prompt has {len(prompt_ids)} tokens; the model's context is {engine.max_context}, so a "
                         f"prompt may have at most {engine.max_context - 1}")
    check_max_tokens(args.max_tokens, len(prompt_ids), engine.max_context, option="--max-tokens")
    warm_up_seconds = None
    if args.compile and args.max_tokens >= 2:  # one token comes from the prefill alone: no decode step to compile
        print("[compiling the decode step: a warm-up generation...]", file=sys.stderr, flush=True)
        warm_up_seconds = warm_up(engine, prompt_ids, params)
    start = time.perf_counter()
    token_times = []
    for _, delta in engine.stream_text(prompt_ids, params):
        token_times.append(time.perf_counter())
        sys.stdout.write(delta)
        sys.stdout.flush()
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    compile_seconds = None
    if warm_up_seconds is not None:
        # the warm-up less what its two tokens take compiled: the compile alone
        compiled_two = token_times[min(1, len(token_times) - 1)] - start if token_times else 0.0
        compile_seconds = max(warm_up_seconds - compiled_two, 0.0)
    print(summary(len(token_times), elapsed, compile_seconds, engine.last_stats), file=sys.stderr)
    return 0
