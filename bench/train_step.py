"""Training-step speed of hybridtron against transformers' NemotronHForCausalLM: same config, same weights.

Forward + backward, fp32, on the CPU with a fixed thread count (2 by default), for:
  - the whole model: the 22.6M-parameter `bench22m` preset (vocab 32000, hidden 256, `MEMEM*EM`, LatentMoE with
    16 experts top-4), batch 4 x 512, loss = next-token cross entropy;
  - one Mamba-2 layer, one LatentMoE layer with 16 experts and one with 128 experts, on a [4, 512, 256] input.

transformers runs as `from_pretrained` configures it (experts: `grouped_mm`, attention: `sdpa`, Mamba: its torch
fallback since mamba_ssm has no CPU kernel); the `eager` rows run its per-expert loop instead (what the first
measurements in docs/LOG.md used). The weights are copied from our model into theirs and the two forwards are checked to agree
before anything is timed. Each repetition times ours and theirs back to back, so both see the same machine load;
the table reports the median over repetitions (and the ratio of medians).

    python bench/train_step.py                 # the table, markdown
    python bench/train_step.py --repeats 10 --threads 2 --batch 4 --seq 512
"""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import dataclass

import torch

from hybridtron.config import ModelConfig, bench22m
from hybridtron.model.lm import HybridLM

import clock
from clock import timed


@dataclass
class Row:
    name: str
    tokens: int
    ours_s: list[float]
    theirs_s: list[float]

    @property
    def ours(self) -> float:
        return statistics.median(self.ours_s)

    @property
    def theirs(self) -> float:
        return statistics.median(self.theirs_s)

    @property
    def speedup(self) -> float:
        return self.theirs / self.ours


@torch.no_grad()
def keep_dt_above_time_step_min(model: torch.nn.Module) -> None:
    """transformers clamps dt at time_step_min in prefill and training (its prefill's clamp; see ModelConfig.to_hf); shifting
    dt_bias up by 1 keeps every dt above it, so both sides compute the same function and the check below is tight.
    The values of dt do not change the cost of anything."""
    for module in model.modules():
        if hasattr(module, "dt_bias"):
            module.dt_bias.add_(1.0)


def their_config(config: ModelConfig, experts_implementation: str | None = None):
    from transformers import NemotronHConfig

    hf_config = NemotronHConfig(**config.to_hf())
    hf_config._attn_implementation = "sdpa"
    hf_config._experts_implementation = experts_implementation or "grouped_mm"
    return hf_config


def their_model(ours: HybridLM, experts_implementation: str | None = None):
    """transformers' model holding exactly our weights (names differ only by `backbone.` -> `model.`)."""
    from transformers import NemotronHForCausalLM

    theirs = NemotronHForCausalLM(their_config(ours.config, experts_implementation))
    state = {name.replace("backbone.", "model.", 1): tensor for name, tensor in ours.state_dict().items()}
    theirs.load_state_dict(state, strict=True)
    return theirs


def their_layer(kind: str, our_layer: torch.nn.Module, config: ModelConfig, experts_implementation=None):
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer, NemotronHMoE

    hf_config = their_config(config, experts_implementation)
    layer = NemotronHMamba2Mixer(hf_config, layer_idx=0) if kind == "mamba" else NemotronHMoE(hf_config)
    layer.load_state_dict(our_layer.state_dict(), strict=True)
    return layer


def interleaved_seconds(ours, theirs, repeats: int, warmup: int = 1) -> tuple[list[float], list[float]]:
    """Each repetition times ours then theirs back to back, so slow moments of a shared machine hit both."""
    for _ in range(warmup):
        ours()
        theirs()
    ours_s, theirs_s = [], []
    for _ in range(repeats):
        ours_s.append(timed(ours))
        theirs_s.append(timed(theirs))
    return ours_s, theirs_s


def model_step(model, ids, labels, hf: bool):
    def run():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss if hf else model(ids, labels).loss
        loss.backward()
    return run


def layer_step(layer, x, cotangent):
    def run():
        layer.zero_grad(set_to_none=True)
        leaf = x.detach().requires_grad_(True)
        (layer(leaf) * cotangent).sum().backward()
    return run


@torch.no_grad()
def check_same_function(ours, theirs, x, atol, what):
    difference = (ours(x) - theirs(x)).abs().max().item()
    if difference > atol:
        raise RuntimeError(f"{what}: ours and transformers disagree by {difference:.3g} (> {atol}); not timing")


def bench_model(config, batch, seq, repeats, experts_implementation=None) -> Row:
    torch.manual_seed(0)
    ours = HybridLM(config).train()
    keep_dt_above_time_step_min(ours)
    theirs = their_model(ours, experts_implementation).train()
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    check_same_function(lambda x: ours(x).logits, lambda x: theirs(input_ids=x).logits, ids[:1, :128], 1e-4,
                        "whole model")
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)  # ours takes shifted labels
    seconds = interleaved_seconds(model_step(ours, ids, labels, hf=False), model_step(theirs, ids, None, hf=True),
                                  repeats)
    name = "whole model (bench22m)" + (f", transformers {experts_implementation}" if experts_implementation else "")
    return Row(name, batch * seq, *seconds)


def bench_layer(kind, config, batch, seq, repeats, experts_implementation=None) -> Row:
    torch.manual_seed(0)
    our_model = HybridLM(config.replace(layers_block_type=("linear_attention" if kind == "mamba" else "moe",)))
    ours = our_model.backbone.layers[0].mixer.train()
    keep_dt_above_time_step_min(ours)
    theirs = their_layer(kind, ours, config, experts_implementation).train()
    x = torch.randn(batch, seq, config.hidden_size)
    check_same_function(ours, theirs, x[:1, :128], 1e-5, f"{kind} layer")
    cotangent = torch.randn(batch, seq, config.hidden_size)
    seconds = interleaved_seconds(layer_step(ours, x, cotangent), layer_step(theirs, x, cotangent), repeats)
    name = "Mamba-2 layer" if kind == "mamba" else f"LatentMoE layer, {config.n_routed_experts} experts"
    if experts_implementation:
        name += f", transformers {experts_implementation}"
    return Row(name, batch * seq, *seconds)


def markdown(rows: list[Row], batch: int, seq: int, threads: int, clock_name: str) -> str:
    load = f", load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs" if hasattr(os, "getloadavg") else ""
    lines = [f"Forward + backward, fp32, batch {batch} x {seq}, torch.set_num_threads({threads}), "
             f"torch {torch.__version__}, {clock_name} clock{load}; median of the repetitions.", "",
             "| case | hybridtron ms | transformers ms | speedup | hybridtron tok/s | transformers tok/s |",
             "|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row.name} | {row.ours * 1e3:.1f} | {row.theirs * 1e3:.1f} | {row.speedup:.2f}x | "
                     f"{row.tokens / row.ours:,.0f} | {row.tokens / row.theirs:,.0f} |")
    return "\n".join(lines)


def main(argv=None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-eager", action="store_true", help="skip the rows with transformers' eager experts")
    clock.add_clock_argument(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock.select(args.clock)

    config = bench22m()
    many_experts = config.replace(n_routed_experts=128)
    shape = (args.batch, args.seq, args.repeats)
    rows = [bench_model(config, *shape)]
    if not args.no_eager:
        rows.append(bench_model(config, *shape, "eager"))
    rows.append(bench_layer("mamba", config, *shape))
    for moe_config in (config, many_experts):
        rows.append(bench_layer("moe", moe_config, *shape))
        if not args.no_eager:
            rows.append(bench_layer("moe", moe_config, *shape, "eager"))
    print(markdown(rows, args.batch, args.seq, args.threads, args.clock))
    whole, mamba = rows[0], next(r for r in rows if r.name.startswith("Mamba"))
    print(f"\ngoals: whole step {whole.speedup:.2f}x (>= 2x: {'met' if whole.speedup >= 2 else 'MISSED'}), "
          f"Mamba layer {mamba.speedup:.2f}x (>= 4x: {'met' if mamba.speedup >= 4 else 'MISSED'})")
    return rows


if __name__ == "__main__":
    main()
