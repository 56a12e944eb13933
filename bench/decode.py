"""Decode speed: hybridtron against transformers, MTP self-speculative decoding, and decode time against context.

Batch 1, greedy, fp32, on the CPU with a fixed thread count (2 by default). Three sections, one run:

1. `hf`: decode tokens/s of hybridtron's `generate` and transformers' `NemotronHForCausalLM.generate` on the same
   checkpoint (random weights saved with `save_pretrained`, loaded by both), for the `tiny` and `bench22m` presets.
   Decode time per token = (time for 1 + N tokens - time for 1 token) / N, so the prompt's prefill cancels out.
   dt_bias is shifted up so that transformers' prefill clamp at time_step_min (the README's
   note on dt) does not change the
   function; the two must emit the same greedy tokens before anything counts. hybridtron is timed twice: eager,
   and with the compiled decode step (`Decoder(compile=True)`), whose first run compiles (its elapsed time is
   printed apart; the per-token times are of runs after it). Every hybridtron model here is laid out for decoding
   first (`fastpath.lay_out_for_decoding`), as an engine does when it loads a checkpoint.
2. `speculative`: a tiny model trained here, briefly, from scratch (120 AdamW steps of 8 x 64 tokens, next-token
   loss only, so the MTP block keeps its random init) on a synthetic order-1 Markov chain (each token has one likely
   successor, p = 0.9, else a uniform token); then its MTP block is boosted (`hybridtron.post.mtp_boost`: backbone
   frozen, forward KL at T = 2 on the model's own samples, self-conditioned over 7 depths), which is what makes the
   drafts agree with the backbone. The data is easy on purpose (the next token depends on the current one only):
   the section measures what drafting costs and gains when drafts are good; the acceptance lengths are printed
   beside the speedups. The bench model has 16 backbone layers for the MTP block's 2, a ratio closer to real
   models (Nano: 52 layers, Ultra: 108) than the 8 of `tiny`. Plain and speculative greedy outputs must be
   identical. Sampling at temperature 1 is measured too (its speculative output differs from plain sampling's
   draw by draw, not in distribution).
2b. `checkpoint` (when asked): speculative against plain decoding on a trained checkpoint with real text (the
   quickstart's, `--checkpoint`): standard-library source as prompts, greedy, batch 1, by draft length 1..
   `--max-draft` and with the adaptive default (`draft_length=None`), eager and (`--compiled`) compiled, every
   variant's greedy tokens identical to plain decoding's; then where an eager step's time goes by phase, and what
   a T-token forward and the lm_head's M-row product cost against one token (why verification is not free).
2c. `layers` (when asked): each piece of that checkpoint's eager forward (every backbone layer, norm_f + lm_head,
   the MTP block) at 1 token and at k + 1 tokens (`--max-draft`), against the whole forward: what a verification
   and a draft cost, piece by piece.
2d. `threads` (when asked): plain decoding of that checkpoint at 1 and 2 intra-op threads, batch 1 and 8.
3. `context`: per-token decode time after a prompt of 1K and 16K tokens (`--contexts`), for the `tiny` hybrid (3 Mamba layers,
   1 attention) and an all-attention model of the same width and depth (every Mamba layer replaced by attention).
   The hybrid's time should stay nearly flat; attention reads a KV cache that grows with the context.
4. `drift` (only when asked): KL of a lower-precision SSM state to the fp32 state over a long teacher-forced
   decode of the trained bench model (`hybridtron.infer.fastpath.state_quant_drift`).

Each measurement is repeated, the variants of a section back to back in each repetition, and the tables report the
fastest repetition: on a shared machine other processes only ever add time, so the minimum is the estimate least
disturbed by them. On a busy machine even that is not enough: `--clock cpu --threads 1` times this process's own
CPU time instead of the elapsed time (BENCHMARKS.md's decode numbers were taken that way, 1 thread, CPU clock).

    python bench/decode.py                                   # sections hf, speculative, context; 2 threads, wall
    python bench/decode.py --clock cpu --threads 1 --trained /tmp/bench-model   # keep the trained model for reruns
    python bench/decode.py --sections drift --trained /tmp/bench-model
    OMP_NUM_THREADS=1 python bench/decode.py --sections checkpoint layers threads --checkpoint /tmp/quickstart/hf \
        --threads 1 --clock cpu --compiled
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import torch

from hybridtron.checkpoint import load_pretrained, save_pretrained
from hybridtron.config import ATTENTION, MAMBA, ModelConfig, bench22m, parse_pattern, tiny
from hybridtron.infer.decoder import Decoder
from hybridtron.infer.engine import generate_tokens
from hybridtron.infer.fastpath import lay_out_for_decoding, state_quant_drift
from hybridtron.infer.sampling import SamplingParams
from hybridtron.infer.speculative import SpeculativeDecoder
from hybridtron.infer.state_quant import MODES
from hybridtron.model.lm import HybridLM
from hybridtron.post.mtp_boost import BOOST_TRAIN
from hybridtron.post.mtp_boost.training import AcceptanceLength, BoostObjective, PoolBatches, on_policy_samples
from hybridtron.train.hooks import Hook
from hybridtron.train.loop import Trainer

import clock
from clock import timed



def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens)


def variant_label(variant) -> str:
    """A decoding variant's row label: None is plain decoding, an int a fixed draft length, "adaptive" the default."""
    return "plain" if variant is None else ("adaptive (the default)" if variant == "adaptive"
                                            else f"speculative, k = {variant}")


# ------------------------------------------------------------------------------------------------ 1. vs HF
@torch.no_grad()
def keep_dt_above_time_step_min(model: torch.nn.Module) -> None:
    for module in model.modules():
        if hasattr(module, "dt_bias"):
            module.dt_bias.add_(1.0)


def bench_against_transformers(name: str, config: ModelConfig, tokens: int, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ours = HybridLM(config).eval()
    keep_dt_above_time_step_min(ours)
    with tempfile.TemporaryDirectory() as directory:
        save_pretrained(ours, directory)
        ours = load_pretrained(directory).eval()
        theirs = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    lay_out_for_decoding(ours)
    prompt = torch.randint(3, config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1))

    def run_ours(n, compile=False):
        return generate_tokens(ours, prompt.tolist(), greedy(n), compile=compile)[0]

    @torch.no_grad()
    def run_theirs(n):
        out = theirs.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              pad_token_id=config.pad_token_id)
        return out[0, prompt.shape[1]:].tolist()

    expected = run_theirs(tokens + 1)
    if run_ours(tokens + 1) != expected:
        raise RuntimeError(f"{name}: hybridtron and transformers emit different greedy tokens; not timing")
    started = time.perf_counter()  # elapsed time: the compiler's C++ builds run in child processes
    compiled_tokens = run_ours(tokens + 1, compile=True)
    compile_s = time.perf_counter() - started
    if compiled_tokens != expected:
        raise RuntimeError(f"{name}: compiled hybridtron and transformers emit different greedy tokens; not timing")
    ours_s, compiled_s, theirs_s = [], [], []
    for _ in range(repeats):  # back to back, so a slow moment of the machine hits all three
        ours_s.append((timed(lambda: run_ours(tokens + 1)) - timed(lambda: run_ours(1))) / tokens)
        compiled_s.append((timed(lambda: run_ours(tokens + 1, True)) - timed(lambda: run_ours(1, True))) / tokens)
        theirs_s.append((timed(lambda: run_theirs(tokens + 1)) - timed(lambda: run_theirs(1))) / tokens)
    ours_t, compiled_t, theirs_t = min(ours_s), min(compiled_s), min(theirs_s)
    return dict(name=name, ours_ms=ours_t * 1e3, compiled_ms=compiled_t * 1e3, theirs_ms=theirs_t * 1e3,
                speedup=theirs_t / ours_t, compiled_speedup=theirs_t / compiled_t, compile_s=compile_s)


def hf_table(rows: list[dict], tokens: int) -> str:
    lines = [f"Decode, batch 1, greedy, fp32, {tokens} tokens after a 32-token prompt; same checkpoint, same tokens "
             f"(eager, compiled and transformers). Compile: elapsed time of the first compiled run, excluded from "
             f"the per-token times (seconds when inductor's on-disk cache already holds the graph).", "",
             "| model | hybridtron eager ms/token | hybridtron compiled ms/token | transformers ms/token "
             "| eager tok/s | compiled tok/s | transformers tok/s | eager speedup | compiled speedup | compile s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['ours_ms']:.2f} | {r['compiled_ms']:.2f} | {r['theirs_ms']:.2f} | "
                     f"{1e3 / r['ours_ms']:.1f} | {1e3 / r['compiled_ms']:.1f} | {1e3 / r['theirs_ms']:.1f} | "
                     f"{r['speedup']:.2f}x | {r['compiled_speedup']:.2f}x | {r['compile_s']:.1f} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------- 2. speculative
def bench_model_config() -> ModelConfig:
    """`tiny` with a 512-token vocabulary and 16 backbone layers (the MTP block keeps its 2)."""
    return tiny(vocab_size=512, layers_block_type=parse_pattern("ME*EM-MEME*EM-ME"), max_position_embeddings=2048)


def markov_chain(vocab: int, rows: int, length: int, follow: float, seed: int) -> torch.Tensor:
    """Token t+1 is successor[token t] with probability `follow`, else uniform (token ids from 3: 0-2 special)."""
    g = torch.Generator().manual_seed(seed)
    successor = torch.randint(3, vocab, (vocab,), generator=torch.Generator().manual_seed(1234))
    out = torch.empty(rows, length, dtype=torch.long)
    out[:, 0] = torch.randint(3, vocab, (rows,), generator=g)
    for t in range(1, length):
        noise = torch.randint(3, vocab, (rows,), generator=g)
        keep = torch.rand(rows, generator=g) < follow
        out[:, t] = torch.where(keep, successor[out[:, t - 1]], noise)
    return out


def train_briefly(model: HybridLM, steps: int, batch: int, length: int, lr: float, log) -> float:
    """AdamW from scratch on the Markov chain, next-token CE only (the MTP block is left to boosting); returns the
    last loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    loss = torch.tensor(0.0)
    for step in range(steps):
        ids = markov_chain(model.config.vocab_size, batch, length + 1, 0.9, seed=step)
        loss = model(ids[:, :-1], ids[:, 1:], mtp=False).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for group in optimizer.param_groups:  # linear warmup over the first 10% of the steps
            group["lr"] = lr * min(1.0, (step + 1) / max(1, steps // 10))
        optimizer.step()
        if step % max(1, steps // 5) == 0 or step == steps - 1:
            log(f"  train step {step + 1}/{steps}: loss {loss.item():.3f}")
    model.eval()
    return loss.item()


def decode_seconds(model, prompt: list[int], params: SamplingParams, draft_length: int | None):
    """(seconds, tokens, mean acceptance length or None) of one decode, plain or speculative."""
    if draft_length is None:
        decoder = Decoder(model, [prompt], params)
    else:
        decoder = SpeculativeDecoder(model, [prompt], params, draft_length=draft_length)

    def run():
        for _ in decoder:
            pass
    seconds = timed(run)
    stats = getattr(decoder, "stats", None)
    return seconds, decoder.sequences[0].tokens, stats.mean_acceptance_length if stats is not None else None


class LossRecord(Hook):
    def __init__(self):
        self.losses: list[float] = []

    def on_step_end(self, trainer, stats, decision):
        self.losses.append(stats.losses["loss"])


def boost_in_memory(model, prompts, eval_prompts, steps: int) -> tuple[list[tuple[int, float]], list[float]]:
    """MTP boosting of a model that lives only here (no checkpoint directory, so not `hybridtron mtp-boost`): the
    command's objective, pool and acceptance evaluator on the one Trainer, at the LR the bench model was measured
    with (3e-3), 64 on-policy samples of 48 tokens, 7 depths. Returns (acceptance history, losses per step)."""
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith("mtp."))
    pool = on_policy_samples(model, prompts, 64, 48, 1.0, seed=0)
    acceptance = AcceptanceLength(eval_prompts, draft_length=7, max_tokens=64, every=steps)
    record = LossRecord()
    train = dataclasses.replace(BOOST_TRAIN, steps=steps, lr=3e-3)
    Trainer(model, BoostObjective(depths=7, temperature=2.0), PoolBatches(pool, 8, 1, seed=0), train, None,
            hooks=[record], evaluators=[acceptance]).train()
    model.requires_grad_(True)  # as built
    return acceptance.history, record.losses


def trained_bench_model(args, log) -> tuple[HybridLM, str]:
    """The speculative section's model, trained and boosted here (or loaded from `--trained` if it is there)."""
    if args.trained and (Path(args.trained) / "config.json").is_file():
        model = load_pretrained(args.trained).eval()
        record = (Path(args.trained) / "bench_model.txt").read_text()
        return model, record + f" Loaded from {args.trained}."
    config = bench_model_config()
    torch.manual_seed(0)
    model = HybridLM(config)
    started = time.perf_counter()
    final_loss = train_briefly(model, args.train_steps, batch=8, length=64, lr=3e-3, log=log)
    trained_s = time.perf_counter() - started
    held_out = markov_chain(config.vocab_size, 8, 16, 0.9, seed=10_000)
    started = time.perf_counter()
    acceptance, losses = boost_in_memory(model, [[t] for t in range(3, 67)], held_out.tolist(), args.boost_steps)
    boosted_s = time.perf_counter() - started
    record = (f"Bench model: `tiny` with vocab 512 and 16 layers (`ME*EM-MEME*EM-ME`), trained from scratch for "
              f"{args.train_steps} steps with no MTP loss on a synthetic Markov chain (final loss {final_loss:.3f}, "
              f"{trained_s:.0f}s), then its MTP block boosted from its random init for {args.boost_steps} steps "
              f"({boosted_s:.0f}s; boosting loss {losses[0]:.3f} -> {losses[-1]:.3f}; greedy "
              f"acceptance length at k = 7 {acceptance[0][1]:.2f} -> {acceptance[-1][1]:.2f}).")
    if args.trained:
        save_pretrained(model, args.trained)
        (Path(args.trained) / "bench_model.txt").write_text(record)
    return model, record


def bench_speculative(args, log) -> tuple[str, HybridLM]:
    model, record = trained_bench_model(args, log)
    lay_out_for_decoding(model)
    prompt = markov_chain(model.config.vocab_size, 1, 16, 0.9, seed=30_000)[0].tolist()
    modes = {"greedy": greedy(args.tokens), "T = 1": SamplingParams(temperature=1.0, max_tokens=args.tokens, seed=0)}
    variants = [None, *range(1, 8)]  # plain, then k = 1..7
    seconds = {(mode, k): [] for mode in modes for k in variants}
    acceptance = {}
    for repeat in range(args.repeats):
        log(f"  repeat {repeat + 1}/{args.repeats}")
        for mode, params in modes.items():
            plain_tokens = None
            for k in variants:  # back to back, so a slow moment of the machine hits all of them alike
                s, tokens, acceptance[mode, k] = decode_seconds(model, prompt, params, k)
                seconds[mode, k].append(s)
                if k is None:
                    plain_tokens = tokens
                elif mode == "greedy" and tokens != plain_tokens:
                    raise RuntimeError(f"draft length {k}: speculative greedy output differs from plain decoding")
    best_seconds = {key: min(value) for key, value in seconds.items()}
    speedup = {(mode, k): best_seconds[mode, None] / best_seconds[mode, k] for mode in modes for k in variants}
    rate = {key: args.tokens / value for key, value in best_seconds.items()}
    lines = [record + f" Batch 1, {args.tokens} tokens, {args.repeats} repetitions; greedy speculative output "
             f"identical to plain.", "",
             "| decoding | " + " | ".join(f"{m} tok/s | {m} speedup | {m} acceptance" for m in modes) + " |",
             "|---|" + "---:|" * (3 * len(modes))]
    for k in variants:
        name = "plain" if k is None else f"speculative, k = {k}"
        cells = []
        for mode in modes:
            acc = "-" if k is None else f"{acceptance[mode, k]:.2f}"
            cells.append(f"{rate[mode, k]:.1f} | {speedup[mode, k]:.2f}x | {acc}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    for mode in modes:
        best = max(variants[1:], key=lambda k: speedup[mode, k])
        lines.append(f"best, {mode}: k = {best}, {speedup[mode, best]:.2f}x (goal >= 2x: "
                     f"{'met' if speedup[mode, best] >= 2 else 'MISSED'})")
    return "\n".join(lines), model


# ------------------------------------------------------------------------------- 2b. real text on a checkpoint
STDLIB_MODULES = ("json.decoder", "textwrap", "collections", "argparse", "functools", "string")


def stdlib_prompts(tokenizer, count: int, tokens: int) -> list[list[int]]:
    """The first `tokens` tokens of the source of `count` standard-library modules."""
    import importlib
    import inspect

    prompts = []
    for name in STDLIB_MODULES[:count]:
        source = inspect.getsource(importlib.import_module(name))
        prompts.append(tokenizer.encode(source[:tokens * 8])[:tokens])
    return prompts


def timed_decode(model, prompt: list[int], params: SamplingParams, variant, compile: bool, max_draft: int):
    """(seconds of the decode after the prefill, tokens, the decoder) for variant None (plain), an int k, or
    "adaptive"."""
    if variant is None:
        decoder = Decoder(model, [prompt], params, compile=compile)
    else:
        draft = None if variant == "adaptive" else variant
        decoder = SpeculativeDecoder(model, [prompt], params, draft_length=draft, max_draft_length=max_draft,
                                     compile=compile)

    def run():
        for _ in decoder:
            pass
    seconds = timed(run)
    return seconds, decoder.sequences[0].tokens, decoder


def verification_costs(model, max_tokens: int, compiled: bool, repeats: int) -> list[float]:
    """Time of one backbone forward over T = 1..max_tokens tokens (batch 1, 200 positions cached), relative to T = 1:
    what verifying k drafts costs against one plain step, eager or compiled (the static forms)."""
    from hybridtron.infer import fastpath, steps
    from hybridtron.infer.cache import HybridCache
    from hybridtron.infer.steps import compile_static

    cache = HybridCache.allocate(model.config, 1, 512)
    cache.lengths += 200
    times = []
    with torch.inference_mode():
        for tokens in range(1, max_tokens + 1):
            ids = torch.full((1, tokens), 5, dtype=torch.long)
            if compiled:
                fn = compile_static(steps.forward_tokens)

                def step():
                    fn(model, ids, cache, [])
                    cache.lengths -= tokens
            else:
                def step():
                    fastpath.forward(model, ids, cache, record=tokens > 1)
                    cache.recorded.clear()
                    cache.lengths -= tokens
            step()
            times.append(min(timed(lambda: [step() for _ in range(20)]) / 20 for _ in range(repeats)))
    return [t / times[0] for t in times]


def lm_head_costs(model, max_rows: int, repeats: int) -> tuple[list[float], list[float] | None]:
    """Time of the lm_head's product for M = 1..max_rows rows relative to MKL's M = 1 (the decoders' path): by MKL's
    fp32 GEMM, and by oneDNN's with the weight prepacked once (None where oneDNN is absent): whether a product of a
    few rows costs about one row's time, as it does when reading the weight dominates."""
    weight = model.lm_head.weight.detach()
    times, onednn = [], []
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None) if torch.backends.mkldnn.is_available() else None
    with torch.inference_mode():
        for rows in range(1, max_rows + 1):
            x = torch.randn(rows, model.config.hidden_size)
            times.append(min(timed(lambda: [model.lm_head(x) for _ in range(50)]) / 50 for _ in range(repeats)))
            if packed is not None:
                product = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # noqa: E731
                onednn.append(min(timed(lambda: [product() for _ in range(50)]) / 50 for _ in range(repeats)))
    return [t / times[0] for t in times], ([t / times[0] for t in onednn] if packed is not None else None)


class TimedForms:
    """`FastForms` whose calls are timed by phase (the `profile` table of the checkpoint section)."""

    def __init__(self, forms, totals):
        self.forms, self.totals = forms, totals

    def __getattr__(self, name):
        method = getattr(self.forms, name)
        phase = {"catch_up": "catch-up", "chain": "draft chain", "end_chain": "draft chain",
                 "verify": "verification forward", "rewind": "rollback"}[name]

        def timed_call(*args, **kwargs):
            started = clock._selected()
            out = method(*args, **kwargs)
            self.totals[phase] = self.totals.get(phase, 0.0) + clock._selected() - started
            return out
        return timed_call


def phase_profile(model, prompt: list[int], params: SamplingParams, k: int
                  ) -> tuple[dict[str, float], float, float, float]:
    """Where a speculative step's time goes, eager: ms per step by phase, the ms of a whole step, of a plain step
    (the drafts' lm_head and token choice, acceptance and bookkeeping are the step's rest), and the acceptance
    length."""
    totals: dict[str, float] = {}
    decoder = SpeculativeDecoder(model, [prompt], params, draft_length=k)
    decoder.batch.forms = TimedForms(decoder.batch.forms, totals)
    whole = timed(lambda: [None for _ in decoder])
    steps_run = decoder.stats.steps
    plain = Decoder(model, [prompt], params)
    plain_s = timed(lambda: [None for _ in plain]) / max(len(plain.sequences[0].tokens) - 1, 1)
    return ({name: value / steps_run * 1e3 for name, value in totals.items()}, whole / steps_run * 1e3, plain_s * 1e3,
            decoder.stats.mean_acceptance_length)


def bench_checkpoint(args, log) -> str:
    """Plain against speculative decoding by draft length, and the adaptive default, on a trained checkpoint with
    real text: standard-library source as prompts, greedy, batch 1, eager and (with --compiled) compiled."""
    from hybridtron.data.tokenizer import Tokenizer
    from hybridtron.infer.engine import resolve_checkpoint_dir

    directory, name = resolve_checkpoint_dir(args.checkpoint)
    model = load_pretrained(directory).eval()
    lay_out_for_decoding(model)
    prompts = stdlib_prompts(Tokenizer.load(directory / "tokenizer.json"), args.prompts, args.prompt_tokens)
    params = greedy(args.checkpoint_tokens)
    variants = [None, *range(1, args.max_draft + 1), "adaptive"]
    modes = ["eager", "compiled"] if args.compiled else ["eager"]
    best = {(mode, v, p): float("inf") for mode in modes for v in variants for p in range(len(prompts))}
    tokens, acceptance, chosen = {}, {}, {}
    for mode in modes:
        if mode == "compiled":  # compile every graph before anything is timed
            log("  compiling ...")
            for variant in variants:
                timed_decode(model, prompts[0], params, variant, True, args.max_draft)
    for repeat in range(args.repeats):
        log(f"  repeat {repeat + 1}/{args.repeats}")
        for p, prompt in enumerate(prompts):
            for mode in modes:
                for variant in variants:  # back to back, so a slow moment of the machine hits all of them alike
                    seconds, out, decoder = timed_decode(model, prompt, params, variant, mode == "compiled",
                                                         args.max_draft)
                    best[mode, variant, p] = min(best[mode, variant, p], seconds)
                    if variant is None:
                        tokens[mode, p] = out
                        if mode == "compiled" and out != tokens["eager", p]:
                            raise RuntimeError(f"prompt {p}: compiled greedy output differs from eager")
                    elif out != tokens[mode, p]:
                        raise RuntimeError(f"{mode} {variant}, prompt {p}: speculative greedy output differs from "
                                           f"plain decoding")
                    if variant is not None:
                        acceptance[mode, variant, p] = decoder.stats.mean_acceptance_length
                        if variant == "adaptive":
                            chosen[mode, p] = dict(sorted(decoder.batch.controller.current.items()))
    total = sum(len(tokens["eager", p]) for p in range(len(prompts)))
    lines = [f"Checkpoint `{name}` ({directory}); {len(prompts)} prompts of {args.prompt_tokens} tokens of standard-"
             f"library source ({', '.join(STDLIB_MODULES[:len(prompts)])}), greedy, batch 1, "
             f"{args.checkpoint_tokens} tokens each; fastest of {args.repeats} repetitions per prompt, all variants "
             f"back to back; greedy speculative output identical to plain for every variant"
             + (" and compiled identical to eager." if args.compiled else "."), "",
             "| decoding | " + " | ".join(f"{m} tok/s | {m} speedup | {m} acceptance" for m in modes) + " |",
             "|---|" + "---:|" * (3 * len(modes))]
    rates = {}
    for variant in variants:
        label = variant_label(variant)
        cells = []
        for mode in modes:
            seconds = sum(best[mode, variant, p] for p in range(len(prompts)))
            rates[mode, variant] = total / seconds
            speedup = rates[mode, variant] / rates.get((mode, None), rates[mode, variant])
            acc = "-" if variant is None else \
                f"{sum(acceptance[mode, variant, p] for p in range(len(prompts))) / len(prompts):.2f}"
            cells.append(f"{rates[mode, variant]:.1f} | {speedup:.2f}x | {acc}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
    for mode in modes:
        fixed = [v for v in variants if isinstance(v, int)]
        top = max(fixed, key=lambda v: rates[mode, v])
        goal = 1.8 if mode == "eager" else 1.5
        speedup = rates[mode, top] / rates[mode, None]
        lines.append(f"best, {mode}: k = {top}, {speedup:.2f}x over {mode} plain (goal >= {goal}x: "
                     f"{'met' if speedup >= goal else 'MISSED'}); adaptive {rates[mode, 'adaptive'] / rates[mode, None]:.2f}x, "
                     f"its last draft length per prompt: {[chosen[mode, p].get(1) for p in range(len(prompts))]}")
    per_prompt = [f"{p}: " + ", ".join(f"k={v} {acceptance['eager', v, p]:.2f}" for v in variants[1:-1])
                  for p in range(len(prompts))]
    lines += ["", "Acceptance length by prompt (eager): " + "; ".join(per_prompt)]
    lines += ["", "Where an eager speculative step's time goes (ms per step, the first prompt; the rest is the drafts' "
              "lm_head and token choice, acceptance and bookkeeping). The last column bounds what any verification "
              "could give: the speedup if the verification forward cost no more than one plain step, drafting and "
              "the rest as measured (acceptance length x plain step / (step - verification + plain step)):", "",
              "| k | catch-up | draft chain | verification forward | rollback | rest | whole step | plain step | "
              "step / plain | acceptance | speedup | bound, verification = 1 plain step |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for k in sorted({1, 2, 3, args.max_draft}):
        phases, whole, plain, accepted = min((phase_profile(model, prompts[0], params, k)
                                              for _ in range(args.repeats)), key=lambda r: r[1])
        rest = whole - sum(phases.values())
        verification = phases.get('verification forward', 0)
        bound = accepted * plain / (whole - verification + plain)
        lines.append(f"| {k} | {phases.get('catch-up', 0):.2f} | {phases.get('draft chain', 0):.2f} | "
                     f"{verification:.2f} | {phases.get('rollback', 0):.2f} | {rest:.2f} | "
                     f"{whole:.2f} | {plain:.2f} | {whole / plain:.2f}x | {accepted:.2f} | "
                     f"{accepted * plain / whole:.2f}x | {bound:.2f}x |")
    eager_costs = verification_costs(model, args.max_draft + 1, False, args.repeats)
    head, head_onednn = lm_head_costs(model, args.max_draft + 1, args.repeats)
    lines += ["", "What a verification costs: one backbone forward over T tokens against one token (batch 1), and the "
              "lm_head's product alone for M rows against MKL's one row (MKL's fp32 GEMM, which the decoders run; "
              "oneDNN's with the weight prepacked, for comparison):", "",
              "| T | " + " | ".join(str(t) for t in range(1, args.max_draft + 2)) + " |",
              "|---|" + "---:|" * (args.max_draft + 1),
              "| eager forward | " + " | ".join(f"{c:.2f}x" for c in eager_costs) + " |"]
    if args.compiled:
        compiled_costs = verification_costs(model, args.max_draft + 1, True, args.repeats)
        lines.append("| compiled forward | " + " | ".join(f"{c:.2f}x" for c in compiled_costs) + " |")
    lines.append("| lm_head GEMM (MKL) | " + " | ".join(f"{c:.2f}x" for c in head) + " |")
    if head_onednn is not None:
        lines.append("| lm_head GEMM (oneDNN, prepacked) | " + " | ".join(f"{c:.2f}x" for c in head_onednn) + " |")
    return "\n".join(lines)


def bench_layers(args, log) -> str:
    """What each piece of a verification costs against one token, eager: every backbone layer (T tokens, Mamba
    layers recording their states), norm_f + lm_head, and the MTP block (one drafting depth), on the checkpoint at
    200 cached positions; the sum of the layers against a whole forward shows the model's own per-forward cost."""
    from functools import partial

    from hybridtron.infer import fastpath
    from hybridtron.infer.cache import HybridCache
    from hybridtron.infer.engine import resolve_checkpoint_dir

    directory, name = resolve_checkpoint_dir(args.checkpoint)
    model = load_pretrained(directory).eval()
    lay_out_for_decoding(model)
    config, width = model.config, args.max_draft + 1
    cache = HybridCache.allocate(config, 1, 512)
    mtp_cache = HybridCache.allocate(config, 1, 512, kinds=config.mtp_layers_block_type)
    cache.lengths += 200
    mtp_cache.lengths += 200

    def cost(fn) -> float:  # us per call, fastest of the repetitions
        fn()
        return min(timed(lambda: [fn() for _ in range(50)]) / 50 for _ in range(args.repeats)) * 1e6

    rows = []
    with torch.inference_mode():
        for index, (layer, layer_cache) in enumerate(zip(model.backbone.layers, cache.layers)):
            times = []
            for tokens in (1, width):
                hidden = torch.randn(1, tokens, config.hidden_size)
                mixer_fn = partial(fastpath.fast_mixer, recording=cache) if tokens > 1 else fastpath.fast_mixer

                def run_layer():
                    layer(hidden, layer_cache, cache.lengths, None, mixer_fn)
                    cache.recorded.clear()
                times.append(cost(run_layer))
            rows.append((f"layer {index} ({layer.kind})", *times))
        head = [cost(lambda h=torch.randn(1, t, config.hidden_size): model.lm_head(model.backbone.norm_f(h)))
                for t in (1, width)]
        rows.append(("norm_f + lm_head", *head))

        def mtp_depth(tokens):
            hidden, embedding = torch.randn(1, tokens, config.hidden_size), torch.randn(1, tokens, config.hidden_size)

            def run():
                fastpath.mtp_forward(model, hidden, embedding, mtp_cache)
                mtp_cache.lengths -= tokens
            return run
        rows.append(("MTP block (one depth)", cost(mtp_depth(1)), cost(mtp_depth(width))))

        def whole(tokens):
            ids = torch.full((1, tokens), 5, dtype=torch.long)

            def run():
                fastpath.forward(model, ids, cache, record=tokens > 1)
                cache.recorded.clear()
                cache.lengths -= tokens
            return run
        forward = (cost(whole(1)), cost(whole(width)))
    backbone = [sum(r[i] for r in rows[:-1]) for i in (1, 2)]
    lines = [f"Eager cost of each piece of a forward of `{name}`, us per call at T = 1 and T = {width} tokens "
             f"(batch 1, 200 positions cached; T > 1 records the Mamba states, as a verification does):", "",
             f"| piece | T = 1 | T = {width} | ratio |", "|---|---:|---:|---:|"]
    for label, one, many in rows:
        lines.append(f"| {label} | {one:.0f} | {many:.0f} | {many / one:.2f}x |")
    lines.append(f"| sum of the layers and the head | {backbone[0]:.0f} | {backbone[1]:.0f} | "
                 f"{backbone[1] / backbone[0]:.2f}x |")
    lines.append(f"| whole forward (`fastpath.forward`) | {forward[0]:.0f} | {forward[1]:.0f} | "
                 f"{forward[1] / forward[0]:.2f}x |")
    return "\n".join(lines)


def bench_threads(args, log) -> str:
    """Plain greedy decoding on the checkpoint at 1 and 2 intra-op threads, batch 1 and 8, elapsed time (threads
    only help a clock that counts elapsed time): whether a small batch should decode on one thread."""
    from hybridtron.data.tokenizer import Tokenizer
    from hybridtron.infer.engine import resolve_checkpoint_dir

    directory, name = resolve_checkpoint_dir(args.checkpoint)
    model = load_pretrained(directory).eval()
    lay_out_for_decoding(model)
    prompts = stdlib_prompts(Tokenizer.load(directory / "tokenizer.json"), 4, args.prompt_tokens)
    params = greedy(args.checkpoint_tokens)
    best = {}
    threads = sorted({1, 2, torch.get_num_threads()})
    for repeat in range(args.repeats):
        log(f"  threads, repeat {repeat + 1}/{args.repeats}")
        for batch in (1, 8):
            rows = [prompts[b % len(prompts)] for b in range(batch)]
            for count in threads:
                torch.set_num_threads(count)
                decoder = Decoder(model, rows, params)
                started = time.perf_counter()
                for _ in decoder:
                    pass
                rate = sum(len(s.tokens) for s in decoder.sequences) / (time.perf_counter() - started)
                best[batch, count] = max(best.get((batch, count), 0.0), rate)
    torch.set_num_threads(args.threads)
    lines = [f"Plain greedy decoding of `{name}`, {args.checkpoint_tokens} tokens per sequence, elapsed time, best of "
             f"{args.repeats}: tokens/s by intra-op threads.", "", "| batch | " +
             " | ".join(f"{c} thread{'s' if c > 1 else ''}" for c in threads) + " |", "|---|" + "---:|" * len(threads)]
    for batch in (1, 8):
        lines.append(f"| {batch} | " + " | ".join(f"{best[batch, c]:.1f}" for c in threads) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- 3. context
def all_attention(config: ModelConfig) -> ModelConfig:
    return config.replace(layers_block_type=tuple(ATTENTION if k == MAMBA else k for k in config.layers_block_type))


@torch.no_grad()
def per_token_ms(model: HybridLM, context: int, steps: int, repeats: int, chunk: int) -> float:
    prompt = torch.randint(3, model.config.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
    decoder = Decoder(model, [prompt.tolist()], greedy(steps * repeats + 2), prefill_chunk=chunk)
    decoder.step()
    decoder.step()  # warm up the one-token path
    samples = [timed(lambda: [decoder.step() for _ in range(steps)]) / steps for _ in range(repeats)]
    return min(samples) * 1e3


def bench_context(args, log) -> str:
    steps = 16
    hybrid = tiny(max_position_embeddings=max(args.contexts) + steps * args.repeats + 2)
    rows = []
    for name, config in (("hybrid `ME*EM-ME` (3 Mamba, 1 attention)", hybrid),
                         ("all-attention `*E*E*-*E` (4 attention)", all_attention(hybrid))):
        torch.manual_seed(0)
        model = HybridLM(config).eval()
        lay_out_for_decoding(model)
        times = []
        for context in args.contexts:
            log(f"  {name}: context {context}")
            times.append(per_token_ms(model, context, steps=steps, repeats=args.repeats, chunk=512))
        rows.append((name, times))
    header = " | ".join(f"ms/token at {c:,}" for c in args.contexts)
    lines = [f"Decode time per token after a prompt of each length (batch 1, fp32, KV cache preallocated; width "
             f"{hybrid.hidden_size}, 8 layers).", "", f"| model | {header} | ratio last/first |",
             "|---|" + "---:|" * (len(args.contexts) + 1)]
    for name, times in rows:
        lines.append(f"| {name} | " + " | ".join(f"{t:.2f}" for t in times) + f" | {times[-1] / times[0]:.2f}x |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ 4. drift
def bench_drift(model: HybridLM, args, log) -> str:
    tokens = markov_chain(model.config.vocab_size, 4, args.drift_tokens, 0.9, seed=20_000)
    modes = [m for m in MODES if m != "fp32"]
    log(f"  drift: {len(modes)} modes x {args.drift_tokens} tokens")
    drift = state_quant_drift(model, tokens, modes, seed=0)
    lines = [f"KL(fp32 state || stored state) per token, teacher-forced decode of {args.drift_tokens} tokens x 4 "
             f"sequences of the trained bench model.", "", "| SSM state | mean KL | mean KL, last quarter |",
             "|---|---:|---:|"]
    for mode in modes:
        lines.append(f"| {mode} | {drift[mode].mean_kl:.3e} | {drift[mode].last_quarter_kl:.3e} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", default=["hf", "speculative", "context"],
                        choices=["hf", "speculative", "checkpoint", "layers", "threads", "context", "drift"])
    parser.add_argument("--checkpoint", default="/tmp/quickstart/hf",
                        help="section checkpoint: a trained checkpoint or run directory (the quickstart's)")
    parser.add_argument("--prompts", type=int, default=4, help="section checkpoint: standard-library prompts")
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--checkpoint-tokens", type=int, default=256, help="section checkpoint: tokens per decode")
    parser.add_argument("--max-draft", type=int, default=4, help="section checkpoint: draft lengths 1..max timed")
    parser.add_argument("--compiled", action="store_true", help="section checkpoint: compiled decoding too")
    parser.add_argument("--threads", type=int, default=2)
    clock.add_clock_argument(parser)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128, help="tokens decoded per speculative measurement")
    parser.add_argument("--hf-tokens", type=int, default=64, help="tokens decoded per transformers comparison")
    parser.add_argument("--train-steps", type=int, default=120)
    parser.add_argument("--boost-steps", type=int, default=60)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 16384])
    parser.add_argument("--drift-tokens", type=int, default=1024)
    parser.add_argument("--trained", default=None,
                        help="directory to keep the trained bench model in (reused by later runs when it is there)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock.select(args.clock)
    log = lambda line: print(line, flush=True)  # noqa: E731
    out = [f"torch {torch.__version__}, torch.set_num_threads({args.threads}), {args.clock} clock"]
    if "hf" in args.sections:
        log("hybridtron vs transformers ...")
        rows = [bench_against_transformers(name, config, args.hf_tokens, args.repeats)
                for name, config in (("tiny", tiny()), ("bench22m", bench22m()))]
        out.append(hf_table(rows, args.hf_tokens))
        goals = []
        for label, key in (("eager", "speedup"), ("compiled", "compiled_speedup")):
            worst = min(r[key] for r in rows)
            goals.append(f"goal >= 3x, {label}: {'met' if worst >= 3 else 'MISSED'} (lowest {worst:.2f}x)")
        out.append("\n".join(goals))
    trained = None
    if "speculative" in args.sections:
        log("speculative decoding ...")
        table, trained = bench_speculative(args, log)
        out.append(table)
    elif "drift" in args.sections:
        trained, _ = trained_bench_model(args, log)
    if "checkpoint" in args.sections:
        log("speculative decoding on a checkpoint ...")
        out.append(bench_checkpoint(args, log))
    if "layers" in args.sections:
        log("cost of a verification's pieces ...")
        out.append(bench_layers(args, log))
    if "threads" in args.sections:
        log("intra-op threads ...")
        out.append(bench_threads(args, log))
    if "context" in args.sections:
        log("decode time against context ...")
        out.append(bench_context(args, log))
    if "drift" in args.sections:
        out.append(bench_drift(trained, args, log))
    print("\n\n".join(out))


if __name__ == "__main__":
    main()
