"""The SSM cache stored in fp32, fp16, bf16 and int8: bytes per sequence and decode speed, side by side.

1. `bytes`: a sequence's SSM state (and its whole Mamba state, conv included) in each format, as the memory model
   counts it (`hybridtron.model.memory`, what `hybridtron memory --state-dtype` and the engine's slots read), for
   the `tiny` preset, the checkpoint's config and `ultra3`; for the models small enough to allocate, the bytes
   that a serving cache (`infer.cache.HybridCache`) of that format really holds per row, which must be the same.
2. `speed`: decode tokens/s of the checkpoint (the quickstart's; a random `tiny` model without one), greedy, batch
   1 and 8, with the SSM state stored in fp32, fp16_sr, bf16_sr and int8_sr, eager (and compiled with
   `--compiled`), and with `--reference` each format's reference too: an fp32 buffer rounded in place (what the
   cache did before it stored the format; `HybridCache.allocate(reference_quant=True)`). Time per token = (time
   for 1 + N tokens - time for 1 token) / N, so the prefill cancels out; the fastest of `--repeats` repetitions,
   the formats back to back in each (see bench/decode.py on the clocks).

    python bench/ssm_cache_dtype.py --checkpoint runs/quickstart/hf
    python bench/ssm_cache_dtype.py --checkpoint runs/quickstart/hf --threads 1 --clock cpu --compiled
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from unittest import mock

import torch

from hybridtron.checkpoint import load_pretrained
from hybridtron.config import ModelConfig, tiny, ultra3
from hybridtron.infer.cache import HybridCache
from hybridtron.infer.engine import generate_tokens
from hybridtron.infer.fastpath import lay_out_for_decoding
from hybridtron.infer.sampling import SamplingParams
from hybridtron.model.lm import HybridLM
from hybridtron.model.memory import mamba_state_bytes, ssm_state_bytes
from hybridtron.model.state import MambaState

import clock
from clock import timed

FORMATS = (("fp32", "fp32"), ("fp16", "fp16_sr"), ("bf16", "bf16_sr"), ("int8", "int8_sr"))  # (stored, state_quant)
ALLOCATABLE = 1 << 30  # a cache row of more Mamba state than this is only counted


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024


def held_bytes(config: ModelConfig, state_quant: str) -> int:
    """The Mamba-state bytes a one-row serving cache of `state_quant` holds (conv state in bf16)."""
    cache = HybridCache.allocate(config, 1, 1, dtype=torch.bfloat16, state_quant=state_quant)
    return sum(tensor.nbytes for layer in cache.layers if isinstance(layer, MambaState)
               for tensor in layer.tensors().values())


def bytes_table(configs: dict[str, ModelConfig]) -> str:
    lines = ["SSM state per sequence (and the whole Mamba state, bf16 conv state), by stored format; 'held': the "
             "bytes a serving cache of that format allocates per row",
             f"{'model':<12} {'format':<6} {'SSM state':>14} {'Mamba state':>14} {'vs fp32':>8} {'held':>14}"]
    for name, config in configs.items():
        fp32 = ssm_state_bytes(config, "fp32")
        for stored, state_quant in FORMATS:
            mamba = mamba_state_bytes(config, stored, "bf16")
            held = "-"
            if mamba < ALLOCATABLE:
                measured = held_bytes(config, state_quant)
                assert measured == mamba, (name, stored, measured, mamba)  # the memory model is the real bytes
                held = human(measured)
            lines.append(f"{name:<12} {stored:<6} {human(ssm_state_bytes(config, stored)):>14} {human(mamba):>14} "
                         f"{ssm_state_bytes(config, stored) / fp32:>7.1%} {held:>14}")
    return "\n".join(lines)


def decode_model(checkpoint: str | None) -> tuple[str, HybridLM]:
    if checkpoint and (Path(checkpoint) / "config.json").exists():
        model, name = load_pretrained(checkpoint).eval(), checkpoint
    else:
        torch.manual_seed(0)
        model, name = HybridLM(tiny()).eval(), "tiny (random weights)"
    lay_out_for_decoding(model)
    return name, model


def reference_caches():
    """Every cache allocated inside is the reference (fp32 buffers rounded in place)."""
    allocate = HybridCache.allocate.__func__
    return mock.patch.object(HybridCache, "allocate", classmethod(
        lambda cls, *a, **kw: allocate(cls, *a, reference_quant=True, **kw)))


def speed_table(name: str, model: HybridLM, args) -> str:
    vocab = model.config.vocab_size
    variants = [(state_quant, compile, reference) for _, state_quant in FORMATS
                for compile in ((False, True) if args.compiled else (False,))
                for reference in ((False, True) if args.reference and state_quant != "fp32" else (False,))]
    lines = [f"decode tokens/s of {name}, greedy, {args.tokens} tokens after a {args.prompt_tokens}-token prompt "
             f"(fastest of {args.repeats})",
             f"{'state':<13} {'step':<9} " + " ".join(f"{f'batch {b}':>12}" for b in args.batches)]
    results = {}
    for batch in args.batches:
        prompts = torch.randint(3, vocab, (batch, args.prompt_tokens),
                                generator=torch.Generator().manual_seed(batch)).tolist()

        def run(n, state_quant, compile, reference):
            with reference_caches() if reference else contextlib.nullcontext():
                return generate_tokens(model, prompts, SamplingParams(temperature=0, max_tokens=n),
                                       state_quant=state_quant, compile=compile)

        for variant in variants:
            run(args.tokens + 1, *variant)  # warm up (and compile)
        best = {variant: float("inf") for variant in variants}
        for _ in range(args.repeats):
            for variant in variants:
                seconds = timed(lambda: run(args.tokens + 1, *variant)) - timed(lambda: run(1, *variant))
                best[variant] = min(best[variant], seconds / args.tokens)
        for variant, seconds in best.items():
            results.setdefault(variant, {})[batch] = batch / seconds
    for (state_quant, compile, reference), per_batch in results.items():
        label = f"{state_quant}{' ref' if reference else ''}"
        lines.append(f"{label:<13} {'compiled' if compile else 'eager':<9} "
                     + " ".join(f"{per_batch[b]:>12,.1f}" for b in args.batches))
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", default=["bytes", "speed"], choices=["bytes", "speed"])
    parser.add_argument("--checkpoint", default="runs/quickstart/hf",
                        help="the model to decode (an HF checkpoint directory; a random tiny model if absent)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=64, help="tokens decoded per measurement")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compiled", action="store_true", help="the compiled decode step too")
    parser.add_argument("--reference", action="store_true",
                        help="each format's reference too (an fp32 buffer rounded in place)")
    parser.add_argument("--threads", type=int, default=2)
    clock.add_clock_argument(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock.select(args.clock)
    out = [f"torch {torch.__version__}, torch.set_num_threads({args.threads}), {args.clock} clock"]
    if "bytes" in args.sections:
        configs = {"tiny": tiny()}
        if args.checkpoint and (Path(args.checkpoint) / "config.json").exists():
            configs["checkpoint"] = ModelConfig.from_hf(args.checkpoint)
        configs["ultra3"] = ultra3()
        out.append(bytes_table(configs))
    if "speed" in args.sections:
        print("decoding ...", flush=True)
        out.append(speed_table(*decode_model(args.checkpoint), args))
    print("\n\n".join(out))


if __name__ == "__main__":
    main()
