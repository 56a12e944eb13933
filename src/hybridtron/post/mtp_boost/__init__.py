"""MTP boosting: train only the MTP block, so that its drafts agree with the backbone more often.

The recipe (the Nemotron 3 Ultra report, the last post-training stage):

- Backbone, embedding and lm_head frozen; only the MTP block's weights train.
- Loss: forward KL from the backbone's next-token distribution to the block's, both at temperature T = 2, scaled
  by T^2 (distillation's usual factor, which keeps the gradient's size independent of T); no gold-token CE.
- Self-conditioned inputs: the block is unrolled for `depths` steps (7 in the report) exactly as the drafter runs
  it. Depth 1 at anchor a reads the backbone's hidden state h_a and the token x_{a+1}; depth j > 1 reads the
  block's own output of depth j-1 and the token x_{a+j}, and predicts x_{a+j+1}, whose target is the backbone's
  distribution at position a+j. Its attention sees the depth-1 entries of positions 0..a and the chain's own
  entries of depths 2..j, the same keys the drafter's cache holds (`hybridtron.infer.speculative`).
- Data: on-policy samples of the model itself at temperature 1 (the backbone is frozen, so a pool drawn once stays
  on-policy).
- Departure from the report: the tokens fed at depths > 1 are the sample's (teacher forcing), not the drafter's own
  draft tokens; under greedy verification only drafts equal to the target's tokens matter, and the sample's tokens
  are what the target produced.

`mtp_chain` computes every anchor's chain in parallel, one depth at a time, with the model's own MTP block
(`model.mtp`); only its attention layers read a different set of keys (`ChainAttention`: the depth-1 keys of every
position up to the anchor and the anchor's own chain keys), which is what the drafter's cache holds. `mtp_chain_ref`
runs the drafter's cached code path (`MTPBlock.forward` with a KV cache), one position per depth, and is the
reference it is tested against. Acceptance is measured with greedy self-speculative decoding on fixed prompts,
before and after.

`hybridtron mtp-boost --model DIR [--steps N --lr LR --out DIR]` writes the boosted checkpoint (and its tokenizer
files). This module is the command and its configuration (light to import, so `--help` is fast); the training is
`hybridtron.post.mtp_boost.training`.

Shapes: B batch, T time (anchors), H hidden, V vocabulary, Hq / Hkv query / key-value heads, D head dim.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class BoostConfig:
    """steps / lr / batch_size: the AdamW run over the MTP block. depths: self-conditioned depths unrolled (7 in
    the report). kl_temperature: T of the KL (2 in the report). num_samples x sample_length: the on-policy pool,
    sampled at sample_temperature from `prompts`. draft_length / eval_tokens: the greedy acceptance measurement."""

    steps: int = 200
    lr: float = 3e-4
    batch_size: int = 8
    depths: int = 7
    kl_temperature: float = 2.0
    num_samples: int = 256
    sample_length: int = 64
    sample_temperature: float = 1.0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    draft_length: int = 7
    eval_tokens: int = 64
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "batch_size", "depths", "num_samples", "sample_length", "draft_length", "eval_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("lr", "kl_temperature", "sample_temperature", "grad_clip"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")


# ------------------------------------------------------------------------------------------------ command
def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = BoostConfig()
    parser.add_argument("--model", required=True,
                        help="checkpoint directory (config.json, safetensors, tokenizer.json) (required)")
    parser.add_argument("--out", default=None,
                        help="where to write the boosted checkpoint (default: MODEL-mtp-boosted, beside MODEL)")
    parser.add_argument("--steps", type=int, default=defaults.steps,
                        help=f"optimizer steps over the MTP block (default: {defaults.steps})")
    parser.add_argument("--lr", type=float, default=defaults.lr,
                        help=f"AdamW learning rate (default: {defaults.lr:g})")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size,
                        help=f"sampled sequences per step (default: {defaults.batch_size})")
    parser.add_argument("--depths", type=int, default=defaults.depths,
                        help=f"self-conditioned depths unrolled (default: {defaults.depths}, as in the report)")
    parser.add_argument("--num-samples", type=int, default=defaults.num_samples,
                        help=f"on-policy sequences sampled once, the training pool (default: {defaults.num_samples})")
    parser.add_argument("--sample-length", type=int, default=defaults.sample_length,
                        help=f"tokens per sample (default: {defaults.sample_length})")
    parser.add_argument("--draft-length", type=int, default=defaults.draft_length,
                        help=f"draft length of the acceptance measurement before and after (default: "
                             f"{defaults.draft_length})")
    parser.add_argument("--prompts", default=None,
                        help="prompts to sample from and measure acceptance on: a text file, one prompt per line, or "
                             "a .jsonl file of conversations ({\"messages\": [...]} a line, rendered with the "
                             "model's chat template and the generation prompt) (default: the bos token alone)")
    parser.add_argument("--seed", type=int, default=defaults.seed,
                        help=f"seed of the sampling and the batch order (default: {defaults.seed})")


def _prompts(args, model_dir: Path, bos_id: int) -> tuple[list[list[int]], list[list[int]] | None]:
    """(sampling prompts, acceptance prompts). From a prompt file: each line's tokens (a .jsonl line's conversation in
    the chat format, ending with the assistant's generation prompt), the same prompts for both. Without a file: bos
    alone to sample from, and None (the caller samples held-out prompts)."""
    if args.prompts is None:
        return [[bos_id]], None
    path = Path(args.prompts)
    if path.suffix == ".jsonl":
        from hybridtron.data.chat import load_chat_tokenizer, tokenize_chat
        from hybridtron.data.sft import read_conversations

        tokenizer = load_chat_tokenizer(model_dir, require_template=True)
        encoded = []
        # a reply that ends a conversation is dropped: the model writes its own
        for conversation in read_conversations(path, require_reply=False):
            messages = conversation["messages"]
            messages = messages[:-1] if messages[-1]["role"] == "assistant" else messages
            encoded.append(tokenize_chat(tokenizer, messages, add_generation_prompt=True).ids.tolist())
    else:
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"--prompts needs {tokenizer_file} to encode the prompts, and it is missing")
        from hybridtron.data.tokenizer import Tokenizer
        tokenizer = Tokenizer.load(tokenizer_file)
        encoded = [[bos_id] + tokenizer.encode(line) for line in path.read_text().splitlines() if line.strip()]
    if not encoded:
        raise ValueError(f"--prompts {args.prompts}: no prompts in it")
    return encoded, encoded


def run(args) -> int:
    from hybridtron.checkpoint import load_pretrained, save_pretrained
    from hybridtron.data.chat import TOKENIZER_FILES
    from hybridtron.infer.speculative import check_drafter
    from hybridtron.post.mtp_boost.training import boost_mtp, on_policy_samples
    from hybridtron.train.run import refuse_torchrun

    refuse_torchrun("mtp-boost")
    config = BoostConfig(steps=args.steps, lr=args.lr, batch_size=args.batch_size, depths=args.depths,
                         num_samples=args.num_samples, sample_length=args.sample_length,
                         draft_length=args.draft_length, seed=args.seed)
    model_dir = Path(args.model)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{model_dir}: no such checkpoint directory")
    out_dir = Path(args.out) if args.out else model_dir.with_name(model_dir.name + "-mtp-boosted")
    if out_dir.resolve() == model_dir.resolve():
        raise ValueError(f"--out {out_dir} is the input checkpoint; write the boosted model elsewhere")
    model = load_pretrained(model_dir)
    check_drafter(model, config.draft_length)
    bos = model.config.bos_token_id if model.config.bos_token_id is not None else 0
    prompts, eval_prompts = _prompts(args, model_dir, bos)
    if eval_prompts is None:
        held_out = on_policy_samples(model, prompts, 8, 8, config.sample_temperature, config.seed + 1)
        eval_prompts = held_out.tolist()
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    result = boost_mtp(model, prompts, eval_prompts, config, log=log)
    save_pretrained(model, out_dir)
    for name in TOKENIZER_FILES:  # the boosted model speaks with the same tokenizer and chat template
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, out_dir / name)
    (out_dir / "mtp_boost.json").write_text(json.dumps({"config": asdict(config), **asdict(result)}, indent=2))
    print(f"mean acceptance length (greedy, draft length {config.draft_length}): "
          f"{result.acceptance_before:.3f} -> {result.acceptance_after:.3f}; loss {result.losses[0]:.4f} -> "
          f"{result.losses[-1]:.4f} in {result.seconds:.0f}s; saved {out_dir}")
    return 0
