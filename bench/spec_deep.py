"""Speculative against plain decoding by draft length, beside the bound that the measured costs allow.

For a trained checkpoint with an MTP block (the `deep` preset's, boosted with `hybridtron mtp-boost`, and the tiny
quickstart's), greedy, on standard-library source as prompts:

1. `speed`: tokens/s of plain decoding and of speculative decoding at draft lengths 1..`--max-draft` and the
   adaptive default, batch 1, eager and (`--compiled`) compiled; every variant's greedy tokens must equal plain
   decoding's (and compiled eager's). Beside each speedup, the bound that the measured acceptance and costs allow:

       bound(k) = acceptance length(k) / (verification(k + 1 tokens) + k * draft)

   in units of one plain step, the acceptance length being tokens per verification step over all prompts, each cost
   measured on its own (`costs`): the verification is the backbone's forward over k + 1 tokens keeping its Mamba
   states, a draft one depth of the MTP block with the lm_head and the token's choice. What a step spends beyond
   them (the drafter's catch-up over the kept positions, the rollback, the engine's bookkeeping) is what keeps the
   measured speedup below the bound.
2. `profile`: where a step's time goes, by phase (eager: catch-up, draft chain, verification, rollback, the step
   function's rest, the engine around it; compiled: the one graph against its pieces' costs).
3. `batch`: plain against speculative throughput at batch 1, 2, 4, 8, 16 (`SpeculativeDecoder` over that many
   prompts: the same batch API the engine's scheduler steps), fixed k and the adaptive controller, and at which
   batch sizes the adaptive controller turns drafting off.

Each measurement is the fastest of `--repeats`; `--clock cpu --threads 1` times this process's CPU time (the
machine is shared). Compiled graphs are compiled (and their first call dropped) before anything is timed.

    cd bench && OMP_NUM_THREADS=1 python spec_deep.py --checkpoint ../runs/deep-boost/hf --clock cpu --threads 1 \
        --compiled --sections speed profile batch
"""

from __future__ import annotations

import argparse
import importlib
import inspect

import torch

from hybridtron.checkpoint import load_pretrained
from hybridtron.data.tokenizer import Tokenizer
from hybridtron.infer import fastpath, speculative, steps
from hybridtron.infer.cache import HybridCache
from hybridtron.infer.decoder import Decoder
from hybridtron.infer.engine import resolve_checkpoint_dir
from hybridtron.infer.fastpath import lay_out_for_decoding
from hybridtron.infer.speculative import FastForms, SpeculativeDecoder
from hybridtron.infer.steps import compile_static

import clock
from clock import timed
from decode import TimedForms, greedy, variant_label

MODULES = ("json.decoder", "textwrap", "collections", "argparse", "functools", "string", "inspect", "difflib")


def source_prompts(tokenizer, count: int, tokens: int) -> list[list[int]]:
    """`count` prompts of `tokens` tokens of standard-library source: the start of each module, then later
    stretches of each, a third of the module further each time (for batches of more prompts than modules)."""
    prompts = []
    for index in range(count):
        source = inspect.getsource(importlib.import_module(MODULES[index % len(MODULES)]))
        start = (index // len(MODULES)) * len(source) // 3 % max(len(source) - tokens * 8, 1)
        prompts.append(tokenizer.encode(source[start:start + tokens * 8])[:tokens])
    return prompts


def make_decoder(model, prompts, params, variant, compile: bool, max_draft: int):
    """variant None: plain decoding; an int: that draft length; "adaptive": the default controller."""
    if variant is None:
        return Decoder(model, prompts, params, compile=compile)
    return SpeculativeDecoder(model, prompts, params, draft_length=None if variant == "adaptive" else variant,
                              max_draft_length=max_draft, compile=compile)


def run_decoder(decoder) -> float:
    def run():
        for _ in decoder:
            pass
    return timed(run)


def fastest(fn, calls: int, repeats: int) -> float:
    """Seconds per call of `fn`, fastest of `repeats` runs of `calls` calls (after one untimed call)."""
    fn()
    return min(timed(lambda: [fn() for _ in range(calls)]) / calls for _ in range(repeats))


# ---------------------------------------------------------------------------------------------------- costs
def step_costs(model, context: int, draft_lengths, compiled: bool, repeats: int) -> dict:
    """Seconds of one plain forward (one token), of a verification of T = k + 1 tokens for each k (its Mamba states
    kept, then rolled back by nothing), and of one drafting depth (the MTP block on one position, the lm_head, the
    greedy choice), batch 1 with `context` positions cached, eager (the fast paths) or compiled (the static
    forms)."""
    repeats = max(repeats, 5)  # cheap to measure, and the bound rests on them
    config = model.config
    cache = HybridCache.allocate(config, 1, max(256, 1 << (context + max(draft_lengths) + 1).bit_length()))
    mtp_cache = HybridCache.allocate(config, 1, cache.max_len, kinds=config.mtp_layers_block_type)
    cache.lengths += context
    mtp_cache.lengths += context
    hidden = torch.randn(1, config.hidden_size)
    token = torch.full((1,), 5, dtype=torch.long)
    forms = FastForms(True)

    def draft_eager():
        out = forms.chain(model, hidden, token, mtp_cache, 2)
        mtp_cache.lengths -= 1
        return model.lm_head(out).argmax(-1)

    def draft_static(model, hidden, token, mtp_cache):
        out = steps_mtp_decode(model, hidden, token, mtp_cache)
        return model.lm_head(out).argmax(-1)

    costs = {}
    with torch.inference_mode():
        if not compiled:
            def verify(tokens):
                ids = torch.full((1, tokens), 5, dtype=torch.long)

                def run():
                    forms.verify(model, ids, cache)
                    cache.recorded.clear()
                    cache.lengths -= tokens
                return run
            costs["plain"] = fastest(lambda: (fastpath.forward(model, token[:, None], cache), cache.store_states(),
                                              cache.lengths.sub_(1)), 20, repeats)
            costs["draft"] = fastest(draft_eager, 20, repeats)
        else:
            one = compile_static(steps.decode_tokens)
            many = compile_static(steps.forward_tokens)
            draft = compile_static(draft_static)
            costs["plain"] = fastest(lambda: (one(model, token, cache), cache.lengths.sub_(1)), 20, repeats)
            costs["draft"] = fastest(lambda: draft(model, hidden, token, mtp_cache), 20, repeats)

            def verify(tokens):
                ids = torch.full((1, tokens), 5, dtype=torch.long)
                return lambda: (many(model, ids, cache, []), cache.lengths.sub_(tokens))
        for k in draft_lengths:
            costs[k + 1] = fastest(verify(k + 1), 10, repeats)
    return costs


def steps_mtp_decode(model, hidden_BH, token_B, mtp_cache):
    """One drafting depth in the compiled step's form (`StaticForms.chain`)."""
    return speculative.STATIC.chain(model, hidden_BH, token_B, mtp_cache, 2)


def bound(acceptance: float, costs: dict, k: int) -> float:
    return acceptance / ((costs[k + 1] + k * costs["draft"]) / costs["plain"])


# ---------------------------------------------------------------------------------------------------- speed
def distinct_share(tokens: list[int], n: int = 4) -> float:
    """Distinct n-grams over all n-grams of a continuation: 1.0 never repeats itself, near 0 loops on a few tokens
    (where a drafter's acceptance nears k + 1 whatever it learned)."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / max(len(grams), 1)


def bench_speed(model, prompts, args, log, tokenizer) -> tuple[str, dict]:
    params = greedy(args.tokens)
    variants = [None, *args.draft_lengths] + (["adaptive"] if args.adaptive else [])
    modes = ["eager", "compiled"] if args.compiled else ["eager"]
    best = {}
    tokens, acceptance, steps_run = {}, {}, {}
    if args.compiled:
        log("  compiling the decoders' graphs ...")
        for variant in variants:
            run_decoder(make_decoder(model, prompts[:1], params, variant, True, args.max_draft))
    for repeat in range(args.repeats):
        log(f"  speed: repeat {repeat + 1}/{args.repeats}")
        for p, prompt in enumerate(prompts):
            for mode in modes:
                for variant in variants:  # back to back, so a slow moment of the machine hits all of them alike
                    decoder = make_decoder(model, [prompt], params, variant, mode == "compiled", args.max_draft)
                    seconds = run_decoder(decoder)
                    key = (mode, variant, p)
                    best[key] = min(best.get(key, float("inf")), seconds)
                    out = decoder.sequences[0].tokens
                    if variant is None:
                        if mode == "compiled" and out != tokens["eager", p]:
                            raise RuntimeError(f"prompt {p}: compiled greedy output differs from eager")
                        tokens[mode, p] = out
                    elif out != tokens[mode, p]:
                        raise RuntimeError(f"{mode} {variant}, prompt {p}: speculative greedy output differs from "
                                           "plain decoding's")
                    if variant is not None:
                        acceptance[key] = decoder.stats.mean_acceptance_length
                        steps_run[key] = decoder.stats.steps
    context = len(prompts[0]) + args.tokens // 2
    costs = {mode: step_costs(model, context, args.draft_lengths, mode == "compiled", args.repeats)
             for mode in modes}
    total = sum(len(tokens["eager", p]) for p in range(len(prompts)))
    results = {"costs": costs, "rates": {}, "acceptance": {}, "bounds": {}, "steps": {}, "best": best,
               "plain steps": len(tokens["eager", 0]) - 1}  # the first token comes from the prompt's logits
    lines = ["| decoding | " + " | ".join(f"{m} tok/s | {m} speedup | {m} acceptance | {m} bound | {m} speedup / "
                                         f"bound" for m in modes) + " |",
             "|---|" + "---:|" * (5 * len(modes))]
    for variant in variants:
        label = variant_label(variant)
        cells = []
        for mode in modes:
            seconds = sum(best[mode, variant, p] for p in range(len(prompts)))
            rate = results["rates"][mode, variant] = total / seconds
            speedup = rate / results["rates"][mode, None]
            if variant is None:
                cells.append(f"{rate:.1f} | 1.00x | - | - | -")
                continue
            # tokens per verification step over all prompts (each prompt's mean weighted by its steps): a prompt
            # with low acceptance takes more steps, which a plain mean of the prompts' means would undercount
            steps_all = [steps_run[mode, variant, p] for p in range(len(prompts))]
            acc = sum(acceptance[mode, variant, p] * n for p, n in enumerate(steps_all)) / sum(steps_all)
            results["acceptance"][mode, variant] = acc
            results["steps"][mode, variant] = steps_run[mode, variant, 0]
            if variant == "adaptive":
                cells.append(f"{rate:.1f} | {speedup:.2f}x | {acc:.2f} | - | -")
                continue
            limit = results["bounds"][mode, variant] = bound(acc, costs[mode], variant)
            cells.append(f"{rate:.1f} | {speedup:.2f}x | {acc:.2f} | {limit:.2f}x | {speedup / limit:.2f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "Costs measured on their own (batch 1, " + str(context) + " positions cached), in plain steps: the "
              "verification of T = k + 1 tokens and one drafting depth:", "",
              "| mode | plain step ms | draft | " + " | ".join(f"verify T={k + 1}" for k in args.draft_lengths)
              + " |", "|---|---:|---:|" + "---:|" * len(args.draft_lengths)]
    for mode in modes:
        c = costs[mode]
        lines.append(f"| {mode} | {c['plain'] * 1e3:.2f} | {c['draft'] / c['plain']:.3f} | "
                     + " | ".join(f"{c[k + 1] / c['plain']:.2f}" for k in args.draft_lengths) + " |")
    for mode in modes:
        fixed = args.draft_lengths
        top = max(fixed, key=lambda v: results["rates"][mode, v])
        speedup = results["rates"][mode, top] / results["rates"][mode, None]
        limit = results["bounds"][mode, top]
        lines.append(f"\nbest, {mode}: k = {top}, {speedup:.2f}x over plain, bound {limit:.2f}x "
                     f"({speedup / limit:.0%} of it)")
    per_prompt = [f"{p}: " + ", ".join(f"{acceptance['eager', v, p]:.2f}" for v in args.draft_lengths)
                  for p in range(len(prompts))]
    lines += ["", f"Acceptance length by prompt (eager, k = {', '.join(map(str, args.draft_lengths))}): "
              + "; ".join(per_prompt)]
    lines += ["", "The greedy continuations (distinct 4-grams of all; the first 160 characters):"]
    for p in range(len(prompts)):
        continuation = tokens["eager", p]
        text = tokenizer.decode(continuation)[:160].replace("\n", "\\n")
        lines.append(f"- {MODULES[p]}: {distinct_share(continuation):.2f} `{text}`")
    return "\n".join(lines), results


# -------------------------------------------------------------------------------------------------- profile
def eager_phases(model, prompt, params, k: int) -> tuple[dict, float, int]:
    """ms per step by phase of an eager decode at draft length k; (phases, whole step ms, steps)."""
    totals: dict[str, float] = {}
    decoder = SpeculativeDecoder(model, [prompt], params, draft_length=k)
    decoder.batch.forms = TimedForms(decoder.batch.forms, totals)
    step_function = speculative.speculative_step

    def timed_step(*args, **kwargs):
        started = clock._selected()
        out = step_function(*args, **kwargs)
        totals["step function"] = totals.get("step function", 0.0) + clock._selected() - started
        return out
    speculative.speculative_step = timed_step
    try:
        whole = run_decoder(decoder)
    finally:
        speculative.speculative_step = step_function
    steps_run = decoder.stats.steps
    return {name: value / steps_run * 1e3 for name, value in totals.items()}, whole / steps_run * 1e3, steps_run


def bench_profile(model, prompts, args, results, log) -> str:
    params = greedy(args.tokens)
    lines = ["Where an eager step's time goes, ms per step (the first prompt; \"drafts' head\" is the step function's "
             "rest: the drafts' lm_head and choice, acceptance, buffer updates; \"engine\" is what the batch does "
             "around the step function: host reads, emitting, statistics, the controller):", "",
             "| k | catch-up | draft chain | drafts' head | verification | rollback | engine | whole step | "
             "plain step | step / plain | acceptance | speedup |", "|---|" + "---:|" * 11]
    plain_ms = results["best"]["eager", None, 0] / results["plain steps"] * 1e3
    for k in args.draft_lengths:
        log(f"  profile k = {k}")
        phases, whole, _ = min((eager_phases(model, prompts[0], params, k) for _ in range(args.repeats)),
                               key=lambda r: r[1])
        inner = phases.pop("step function")
        head = inner - sum(phases.values())
        engine = whole - inner
        acc = results["acceptance"].get(("eager", k), float("nan"))
        lines.append(f"| {k} | {phases.get('catch-up', 0):.2f} | {phases.get('draft chain', 0):.2f} | {head:.2f} | "
                     f"{phases.get('verification forward', 0):.2f} | {phases.get('rollback', 0):.2f} | {engine:.2f} | "
                     f"{whole:.2f} | {plain_ms:.2f} | {whole / plain_ms:.2f}x | {acc:.2f} | "
                     f"{acc * plain_ms / whole:.2f}x |")
    if args.compiled:
        c = results["costs"]["compiled"]
        lines += ["", "Compiled: a step is one graph; its measured time per step against what its pieces cost "
                  "alone (ms; \"other\" = catch-up, rollback, acceptance and the engine's host work):", "",
                  "| k | whole step | verification | k drafts | other | other / plain step |",
                  "|---|---:|---:|---:|---:|---:|"]
        plain_c = results["best"]["compiled", None, 0] / results["plain steps"] * 1e3
        for k in args.draft_lengths:
            whole = results["best"]["compiled", k, 0] * 1e3 / results["steps"]["compiled", k]
            verify, drafts = c[k + 1] * 1e3, k * c["draft"] * 1e3
            lines.append(f"| {k} | {whole:.2f} | {verify:.2f} | {drafts:.2f} | {whole - verify - drafts:.2f} | "
                         f"{(whole - verify - drafts) / plain_c:.2f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- batch
def bench_batch(model, tokenizer, args, log) -> str:
    sizes = args.batch_sizes
    prompts = source_prompts(tokenizer, max(sizes), args.prompt_tokens)
    params = greedy(args.batch_tokens)
    variants = [None, args.batch_k, "adaptive"]
    modes = ["eager", "compiled"] if args.compiled else ["eager"]
    lines = [f"Throughput at batch B ({args.batch_tokens} greedy tokens per sequence, {args.prompt_tokens}-token "
             f"prompts; tok/s of generated tokens, fastest of {args.repeats}):", "",
             "| B | mode | plain tok/s | k = " + str(args.batch_k) + " tok/s | speedup | adaptive tok/s | speedup | "
             "adaptive: steps drafting / all | adaptive: off at the end |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for size in sizes:
        for mode in modes:
            best, drafting = {}, ""
            for repeat in range(args.repeats + (mode == "compiled")):  # compiled: the first round compiles
                for variant in variants:
                    decoder = make_decoder(model, prompts[:size], params, variant, mode == "compiled",
                                           args.max_draft)
                    ks = []

                    def run():
                        for _ in decoder:
                            if variant is not None:
                                ks.append(decoder.batch.last_draft_length)
                    seconds = timed(run)
                    if mode == "compiled" and repeat == 0:
                        continue
                    generated = sum(len(s.tokens) for s in decoder.sequences)
                    best[variant] = max(best.get(variant, 0.0), generated / seconds)
                    if variant == "adaptive":
                        controller = decoder.batch.controller
                        bucket = controller.bucket(size)
                        drafting = (f"{sum(k > 0 for k in ks)} / {len(ks)} | "
                                    f"{'yes' if controller.off.get(bucket) else 'no'}")
            log(f"  batch {size} {mode}: {best}")
            plain = best[None]
            lines.append(f"| {size} | {mode} | {plain:.1f} | {best[args.batch_k]:.1f} | "
                         f"{best[args.batch_k] / plain:.2f}x | {best['adaptive']:.1f} | "
                         f"{best['adaptive'] / plain:.2f}x | {drafting} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="an HF checkpoint directory (or a run directory)")
    parser.add_argument("--sections", nargs="+", default=["speed", "profile"], choices=["speed", "profile", "batch"])
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=192, help="greedy tokens per decode")
    parser.add_argument("--max-draft", type=int, default=6, help="the longest draft (the adaptive controller's too)")
    parser.add_argument("--draft-lengths", type=int, nargs="+",
                        help="the fixed draft lengths to measure, leaving out the adaptive controller (compiled, "
                             "each is a graph of its own: 39-layer `deep` compiles for minutes each); default "
                             "1..--max-draft and the adaptive controller")
    parser.add_argument("--compiled", action="store_true")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--batch-tokens", type=int, default=64)
    parser.add_argument("--batch-k", type=int, default=3, help="section batch: the fixed draft length")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    clock.add_clock_argument(parser)
    args = parser.parse_args(argv)
    args.adaptive = args.draft_lengths is None
    args.draft_lengths = args.draft_lengths or list(range(1, args.max_draft + 1))
    if max(args.draft_lengths) > args.max_draft or min(args.draft_lengths) < 1:
        parser.error(f"--draft-lengths {args.draft_lengths}: each must be 1..--max-draft ({args.max_draft})")
    torch.set_num_threads(args.threads)
    clock.select(args.clock)
    log = lambda line: print(line, flush=True)  # noqa: E731
    directory, name = resolve_checkpoint_dir(args.checkpoint)
    model = load_pretrained(directory).eval()
    lay_out_for_decoding(model)
    tokenizer = Tokenizer.load(directory / "tokenizer.json")
    prompts = source_prompts(tokenizer, args.prompts, args.prompt_tokens)
    out = [f"`{name}` ({directory}): {len(model.backbone.layers)} backbone layers, MTP block "
           f"{model.config.mtp_layers_block_type}; torch {torch.__version__}, {args.threads} thread(s), {args.clock} "
           f"clock."]
    results = None
    if "speed" in args.sections or "profile" in args.sections:
        table, results = bench_speed(model, prompts, args, log, tokenizer)
        out.append(f"{len(prompts)} prompts of {args.prompt_tokens} tokens ({', '.join(MODULES[:len(prompts)])}), "
                   f"{args.tokens} greedy tokens each, batch 1, fastest of {args.repeats}; every speculative "
                   "variant's tokens identical to plain decoding's"
                   + (", compiled identical to eager." if args.compiled else ".") + "\n\n" + table)
    if "profile" in args.sections:
        out.append(bench_profile(model, prompts, args, results, log))
    if "batch" in args.sections:
        out.append(bench_batch(model, tokenizer, args, log))
    print("\n\n".join(out))


if __name__ == "__main__":
    main()
