"""Loss by position on long documents: does the per-token loss keep falling past the training length?

The standard long-context signal. For each window length L asked, `loss_by_position` takes up to `windows` long
documents (drawn in an order fixed by `seed`), reads each from its start as the packer lays it out for training
(`bos text eos`, hybridtron.data.packing), cuts the first L + 1 tokens, and in one forward over the first L
(`model(ids, logits=False, mtp=False)`: no MTP, no logits) scores the next token at every position t = 0 .. L - 1,
where the model has seen t + 1 tokens. Positions are grouped into buckets (powers of two by default: [0, 1),
[1, 2), [2, 4), ... [L/2, L); or a fixed width), and each bucket's mean cross entropy is taken over every window's
tokens in it. A model that uses its context shows a curve that keeps falling; one that cannot reach past its
training length flattens or rises there.

    from hybridtron.eval.positions import load_model_and_tokenizer, loss_by_position, parse_lengths, plot_position_loss
    model, tokenizer = load_model_and_tokenizer("runs/quickstart/hf")
    result = loss_by_position(model, tokenizer, parse_lengths("1k,4k"), windows=8)
    print(result.format_table()); json.dumps(result.to_dict()); plot_position_loss(result, "loss.png")

Memory: the logits of a window are [L, vocab] (16K tokens x a 131K vocabulary: 8 GiB in fp32), so lm_head and the
cross entropy run a block of rows at a time (`ops.linear_cross_entropy`, once per bucket, as pretraining's loss
does): what stays is the forward's own activations, which `forward_memory_bytes` estimates before anything is
allocated, so that a length the machine cannot hold is refused with its numbers. That CE also computes the
gradients of its rows as it goes (it was written for training), which costs two more lm_head-sized GEMMs a window:
small beside the forward of the layers.

Documents: by default the embedded corpus's long documents (`stdlib-repos`: the running Python's standard library,
each package's files stitched into one document), else any data source `hybridtron.data.build.load_documents`
reads (.jsonl, .parquet, a directory of text files). A document is read whole up to `MAX_DOCUMENT_CHARS`. The
default documents are the long-context phase's own training data and overlap pretraining's `stdlib` files, so on
a model trained on them this is a loss on seen text; for a strictly held-out number pass documents the model never
saw (`source=` a file or directory; `hybridtron eval loss --held-out` keeps the documents a run holds out). The
windows of every length start at the same documents' starts (those long enough): the model is causal (position t
reads only the t + 1 tokens before it), so on the documents they share a shorter length's curve is the start of a
longer one's, and the shorter lengths average over more documents. Fewer long documents than windows asked: their
later windows too, consecutive and non-overlapping (position t of such a window has t + 1 tokens of context, as in
a first window; only its first token is not a bos).
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from hybridtron.checkpoint import load_pretrained
from hybridtron.checkpoint.hf import resolve_checkpoint_dir
from hybridtron.config import ATTENTION, MAMBA, MLP, MOE, ModelConfig
from hybridtron.data.build import DataConfig, load_documents
from hybridtron.data.corpus import Document
from hybridtron.data.tokenizer import Tokenizer
from hybridtron.eval.progress import Progress
from hybridtron.ops.linear_cross_entropy import BLOCK_ELEMENTS, linear_cross_entropy
from hybridtron.train.objectives import local_head_weight
from hybridtron.train.preflight import available_memory, gib

DEFAULT_SOURCE = "stdlib-repos"
# Characters a document is read whole up to (longer ones are split at line ends into several documents): about
# 300K tokens of code, the longest window the default source can serve. Also `stdlib-repos`' own cut of a package.
MAX_DOCUMENT_CHARS = 1 << 20
LENGTH_SUFFIXES = {"k": 1024, "m": 1024 ** 2}
# A tokenizer writes at most this many tokens per UTF-8 byte of text (byte-level BPE: one; a SentencePiece-style
# word-start marker can add one more): a document with fewer bytes than length / this cannot fill a window, and
# is never tokenized.
MAX_TOKENS_PER_BYTE = 2
# Calibration of `forward_memory_bytes`: the peak memory of a forward (RSS over the weights) measured 1.2-1.5x the
# count of its widest layer's tensors (tiny preset: 20-24 KB a token at 4K-16K tokens; bench22m: 44 KB at 4K, on a
# CPU); twice the count covers it.
MEMORY_MARGIN = 2.0


# ------------------------------------------------------------------------------------------------- lengths
def parse_lengths(text: str) -> list[int]:
    """'1k,4k,16k' -> [1024, 4096, 16384] (k = 1024, m = 1024^2, as RULER's lengths; plain integers too), in the
    order given."""
    lengths = []
    for item in (part.strip().lower() for part in text.split(",")):
        multiplier = LENGTH_SUFFIXES.get(item[-1:], 1)
        number = item[:-1] if item[-1:] in LENGTH_SUFFIXES else item
        if not number.isdigit() or int(number) < 1:
            raise ValueError(f"lengths: {item!r} is not a length; expected positive token counts such as 1k,4k,16k "
                             f"(k = 1024, m = 1024^2) or 1000,5000")
        lengths.append(int(number) * multiplier)
    return lengths


def position_buckets(length: int, bucket_width: int | None = None) -> list[tuple[int, int]]:
    """The buckets [start, end) of positions 0 .. length - 1: powers of two ([0, 1), [1, 2), [2, 4), ...; the last
    ends at `length`), or consecutive buckets of `bucket_width` positions (the last may be shorter). Either way a
    shorter length's buckets are the longer's, up to its own last one, so the rows of lengths line up."""
    if length < 1:
        raise ValueError(f"length must be at least 1 token, got {length}")
    if bucket_width is not None:
        if bucket_width < 1:
            raise ValueError(f"bucket_width must be at least 1 position, got {bucket_width}")
        return [(start, min(start + bucket_width, length)) for start in range(0, length, bucket_width)]
    edges = [0] + [1 << k for k in range(length.bit_length()) if 1 << k < length] + [length]
    return list(zip(edges[:-1], edges[1:]))


# ------------------------------------------------------------------------------------------------- memory
def forward_memory_bytes(config: ModelConfig, length: int, dtype: torch.dtype = torch.float32) -> int:
    """Estimate of the memory one window's forward and loss take beyond the weights: the residual stream and the
    widest layer's tensors at `length` tokens (layers run one after another, and nothing is kept for a backward),
    in fp32 where the layer computes in it (the Mamba scan always does), times `MEMORY_MARGIN`; then what the
    blockwise loss keeps (the final hidden states and their gradient, the lm_head weight's gradient in fp32, one
    block of logits). An estimate, not a measurement: it is there to refuse a length far beyond the machine."""
    element = max(torch.finfo(dtype).bits // 8, 4)
    kinds = set(config.layers_block_type)
    mixer_widths = [3 * (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
                    if ATTENTION in kinds else 0,
                    3 * config.intermediate_size if MLP in kinds else 0,
                    3 * config.num_experts_per_tok * config.moe_intermediate_size
                    + 2 * config.moe_shared_expert_intermediate_size if MOE in kinds else 0]
    if MAMBA in kinds:
        # the in_proj output, its split and activated copies; the scan's [chunk, chunk] products per head and the
        # states each chunk passes on, per token
        d_inner = config.mamba_num_heads * config.mamba_head_dim
        in_proj = 2 * d_inner + 2 * config.n_groups * config.ssm_state_size + config.mamba_num_heads
        scan = config.mamba_num_heads * (3 * config.chunk_size
                                         + 2 * config.mamba_head_dim * config.ssm_state_size // config.chunk_size)
        mixer_widths.append(3 * in_proj + scan)
    per_token = element * (6 * config.hidden_size + max(mixer_widths))
    hidden_bytes = torch.finfo(dtype).bits // 8 * config.hidden_size
    loss = 2 * length * hidden_bytes + 4 * config.vocab_size * config.hidden_size + 4 * BLOCK_ELEMENTS
    return int(MEMORY_MARGIN * per_token * length) + loss


def check_length(model, length: int, device: torch.device | None = None) -> None:
    """ValueError (one line) when `model` cannot be scored on windows of `length` tokens: beyond its
    max_position_embeddings, or beyond the memory `device` has available (`forward_memory_bytes`)."""
    config = model.config
    if length < 1:
        raise ValueError(f"length {length}: expected at least 1 token")
    if length > config.max_position_embeddings:
        raise ValueError(f"length {length:,}: beyond the model's max_position_embeddings "
                         f"({config.max_position_embeddings:,}); ask for at most that")
    weight = model.lm_head.weight
    device = weight.device if device is None else device
    needed, available = forward_memory_bytes(config, length, weight.dtype), available_memory(device)
    if available is not None and needed > available:
        raise ValueError(f"length {length:,}: a forward over one window needs about {gib(needed)} (estimate: "
                         f"hidden size {config.hidden_size}, {length:,} tokens, the widest layer's activations), "
                         f"but {device} has {gib(available)} available; ask for shorter lengths")


# ---------------------------------------------------------------------------------------------- documents
def checkpoint_with_tokenizer(path: str | Path, option: str = "--model") -> Path:
    """The checkpoint directory of `path` (`resolve_checkpoint_dir`: itself, or a run directory's `hf/` export),
    which must hold the tokenizer the model was trained with; ValueError (one line) otherwise. Nothing is loaded."""
    directory, _ = resolve_checkpoint_dir(path, option)
    if not (directory / "tokenizer.json").is_file():
        raise ValueError(f"{option} {directory}: no tokenizer.json beside the model; an evaluation reads the model's "
                         f"own tokens, so the checkpoint must hold the tokenizer it was trained with")
    return directory


def load_model_and_tokenizer(directory: str | Path, *, dtype: torch.dtype | None = torch.float32,
                             device: str | torch.device = "cpu") -> tuple[torch.nn.Module, Tokenizer]:
    """A `nemotron_h` checkpoint (ours or one transformers wrote; a run directory's `hf/` export too) in eval
    mode, and its tokenizer; ValueError (one line) when the directory has no tokenizer.json. `dtype` None: the
    checkpoint's own."""
    directory = checkpoint_with_tokenizer(directory)
    model = load_pretrained(directory, dtype=dtype, device=device).eval()
    return model, Tokenizer.load(directory)


def source_documents(source: str | Sequence[str] = DEFAULT_SOURCE) -> list[Document]:
    """The documents of a data source (`stdlib-repos`, `stdlib`, a .jsonl / .parquet file, a directory of text
    files, or several), each read whole up to `MAX_DOCUMENT_CHARS`."""
    sources = (source,) if isinstance(source, str) else tuple(source)
    return load_documents(DataConfig(source=sources, max_document_chars=MAX_DOCUMENT_CHARS,
                                     max_repo_chars=MAX_DOCUMENT_CHARS))


class DocumentWindows:
    """The windows of every length over one list of documents, tokenized once: a document's tokens are those the
    packer gives it (`bos text eos`), and a window of L is the first L + 1 of them (L inputs, L targets).

    Documents are visited in an order fixed by `seed` (a hash of seed and document id, so not by the list's order);
    the windows of length L are the first `windows` documents of that order with at least L + 1 tokens."""

    def __init__(self, documents: Sequence[Document], tokenizer: Tokenizer, *, seed: int = 0, name: str = "documents"):
        if not documents:
            raise ValueError(f"{name}: no documents")
        self.name, self.tokenizer = name, tokenizer
        self.documents = sorted(documents, key=lambda d: hashlib.sha1(f"{seed}\0{d.doc_id}".encode()).digest())
        self.text_bytes = [len(d.text.encode()) for d in self.documents]
        # document index (in the drawn order) -> bos + text + eos, as int32 (a Python list of a 300K-token document
        # would take 30 bytes a token)
        self.tokens: dict[int, np.ndarray] = {}

    def windows(self, length: int, count: int, vocab_size: int) -> torch.Tensor:
        """[n, length + 1] token ids, n <= count windows: each document's first L + 1 tokens (from its bos), in the
        drawn order; when the documents long enough are fewer than `count`, their next windows (tokens L .. 2L,
        then 2L .. 3L, ...: mid-document, where position t has seen the window's t + 1 tokens) round after round
        until `count` or the documents run out. ValueError naming the source when none is long enough, or when a
        document holds a token the model does not have."""
        found, tokenized = [], 0
        candidates = [i for i, size in enumerate(self.text_bytes) if size * MAX_TOKENS_PER_BYTE + 2 >= length + 1]
        for start in range(0, len(candidates), count):
            batch = [i for i in candidates[start:start + count] if i not in self.tokens]
            for index, ids in zip(batch, self.tokenizer.encode_batch([self.documents[i].text for i in batch])):
                self.tokens[index] = np.array([self.tokenizer.bos_id, *ids, self.tokenizer.eos_id], dtype=np.int32)
            for index in candidates[start:start + count]:
                tokenized += 1
                if len(self.tokens[index]) >= length + 1 and len(found) < count:
                    found.append(self.tokens[index][:length + 1])
            if len(found) == count:
                break
        long_enough = [i for i in candidates if i in self.tokens and len(self.tokens[i]) >= length + 1]
        offset = length
        while len(found) < count and any(len(self.tokens[i]) >= offset + length + 1 for i in long_enough):
            for index in long_enough:
                if len(self.tokens[index]) >= offset + length + 1 and len(found) < count:
                    found.append(self.tokens[index][offset:offset + length + 1])
            offset += length
        if not found:
            longest = max((len(self.tokens[i]) for i in candidates), default=0)
            detail = (f"the longest of the {tokenized} long enough to try has {longest:,} tokens" if tokenized else
                      f"the longest is {max(self.text_bytes):,} bytes")
            raise ValueError(f"{self.name}: no document reaches {length + 1:,} tokens (a window of {length:,} and "
                             f"its last target; {detail}); ask for shorter lengths or give longer documents")
        ids = torch.from_numpy(np.stack(found)).long()
        if int(ids.max()) >= vocab_size:
            bad = int(ids.max())
            raise ValueError(f"{self.name}: token id {bad} ({self.tokenizer.decode([bad])!r}) is beyond the model's "
                             f"vocab_size {vocab_size}; the tokenizer and the model do not match")
        return ids


# ------------------------------------------------------------------------------------------------ scoring
@torch.inference_mode()
def bucket_ce_sums(model, window_ids: torch.Tensor, buckets: Sequence[tuple[int, int]]) -> torch.Tensor:
    """float64 [buckets]: the next-token CE summed over each bucket's positions of one window ([L + 1] ids: inputs
    ids[:-1], targets ids[1:]), from one forward without MTP or logits; lm_head and the CE run a block of rows at a
    time (`linear_cross_entropy`), so the [L, vocab] logits never exist."""
    weight = local_head_weight(model)
    if weight is None:
        raise ValueError("loss by position needs the model's whole lm_head weight on this process (a model loaded "
                         "with hybridtron.checkpoint.load_pretrained), not a sharded or converted head")
    ids = window_ids.to(weight.device)
    hidden_TD = model(ids[None, :-1], logits=False, mtp=False).hidden[0]
    targets_T = ids[1:]
    return torch.stack([linear_cross_entropy(hidden_TD[start:end], weight, targets_T[start:end]).double()
                        * (end - start) for start, end in buckets]).cpu()


@dataclass(frozen=True)
class LengthLoss:
    """The loss by position of one window length."""

    length: int
    windows: int  # windows scored (fewer than asked when fewer documents are long enough)
    buckets: tuple[tuple[int, int], ...]  # [start, end) positions; position t has seen t + 1 tokens
    mean_ce: tuple[float, ...]  # per bucket, over every window's tokens in it (nats)
    tokens: tuple[int, ...]  # per bucket: windows x its positions
    seconds: float

    @property
    def overall_ce(self) -> float:
        """The mean CE over every scored token."""
        return sum(ce * n for ce, n in zip(self.mean_ce, self.tokens)) / sum(self.tokens)

    def to_dict(self) -> dict:
        return {"length": self.length, "windows": self.windows, "mean_ce": self.overall_ce,
                "seconds": round(self.seconds, 3),
                "buckets": [{"start": start, "end": end, "mean_ce": ce, "tokens": n}
                            for (start, end), ce, n in zip(self.buckets, self.mean_ce, self.tokens)]}


@dataclass(frozen=True)
class PositionLoss:
    """`loss_by_position`'s result: one `LengthLoss` per length asked, in order."""

    lengths: tuple[LengthLoss, ...]
    source: str  # where the documents came from
    windows_asked: int
    bucket_width: int | None  # None: powers of two
    seed: int

    def to_dict(self) -> dict:
        """JSON-ready."""
        return {"source": self.source, "windows_asked": self.windows_asked, "seed": self.seed,
                "buckets": "powers of two" if self.bucket_width is None else f"width {self.bucket_width}",
                "lengths": [length.to_dict() for length in self.lengths]}

    def format_table(self) -> str:
        """Mean CE per position bucket (rows) and length (columns); a length's column is blank past its end."""
        rows = sorted({bucket for length in self.lengths for bucket in length.buckets})
        cells = [{bucket: f"{ce:.4f}" for bucket, ce in zip(length.buckets, length.mean_ce)}
                 for length in self.lengths]
        header = ["positions"] + [f"L={length.length:,}" for length in self.lengths]
        body = [[f"{start:,}" if end == start + 1 else f"{start:,}-{end - 1:,}"]
                + [column.get((start, end), "") for column in cells] for start, end in rows]
        body.append(["all"] + [f"{length.overall_ce:.4f}" for length in self.lengths])
        body.append(["windows"] + [str(length.windows) for length in self.lengths])
        widths = [max(len(row[i]) for row in [header] + body) for i in range(len(header))]
        lines = ["  ".join(cell.rjust(width) if i else cell.ljust(width) for i, (cell, width) in
                           enumerate(zip(row, widths))) for row in [header] + body]
        return (f"mean next-token CE (nats) by position, {self.source}\n" + "\n".join(lines))


def loss_by_position(model, tokenizer: Tokenizer, lengths: Sequence[int], *,
                     documents: Sequence[Document] | None = None, source: str | Sequence[str] = DEFAULT_SOURCE,
                     windows: int = 16, bucket_width: int | None = None, seed: int = 0,
                     progress: bool = False) -> PositionLoss:
    """The mean next-token CE of `model` by position bucket, for each window length in `lengths` (module
    docstring). `documents`: score these (`source` then only names them); else read `source`. `windows`: windows
    per length, at most (one per document long enough). `bucket_width`: None for powers of two. `progress`: a
    progress line on stderr (`hybridtron.eval.progress`). Every length is checked (`check_length`) before any is
    scored."""
    if windows < 1:
        raise ValueError(f"windows must be at least 1, got {windows}")
    if not lengths:
        raise ValueError("lengths: expected at least one window length")
    for length in lengths:
        check_length(model, length)
        position_buckets(length, bucket_width)  # a bad width fails before the documents load
    name = source if isinstance(source, str) else ",".join(source)
    documents = source_documents(source) if documents is None else documents
    drawn = DocumentWindows(documents, tokenizer, seed=seed, name=name)
    model.eval()
    # every length's windows before any is scored: a length no document reaches is refused before the work starts
    drawn_ids = [(length, drawn.windows(length, windows, model.config.vocab_size)) for length in lengths]
    # a window's forward costs about its length: the estimate weighs windows by it
    line = Progress("eval loss", sum(len(ids) for _, ids in drawn_ids), "windows",
                    work=sum(len(ids) * length for length, ids in drawn_ids), enabled=progress)
    results = []
    for length, window_ids in drawn_ids:
        started = time.perf_counter()
        buckets = position_buckets(length, bucket_width)
        sums = torch.zeros(len(buckets), dtype=torch.float64)
        for ids in window_ids:
            sums += bucket_ce_sums(model, ids, buckets)
            line.advance(work=length, note=f"length {length:,}")
        counts = [(end - start) * len(window_ids) for start, end in buckets]
        results.append(LengthLoss(length=length, windows=len(window_ids), buckets=tuple(buckets),
                                  mean_ce=tuple(float(s) / n for s, n in zip(sums, counts)), tokens=tuple(counts),
                                  seconds=time.perf_counter() - started))
    return PositionLoss(lengths=tuple(results), source=name, windows_asked=windows, bucket_width=bucket_width,
                        seed=seed)


# ------------------------------------------------------------------------------------------------ drawing
def plot_position_loss(result: PositionLoss, path: str | Path, *, training_length: int | None = None,
                       title: str | None = None) -> Path:
    """Draw mean CE against position (log2 x axis), one line per length, into a PNG at `path`; a dashed line at
    `training_length` (the length the model was trained at) when given. Returns the path."""
    import matplotlib  # optional dependency (the `plots` extra): only drawing needs it
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for length in result.lengths:
        # a bucket [start, end) holds the tokens that saw start + 1 .. end tokens: drawn at their geometric middle
        x = [math.sqrt((start + 1) * end) for start, end in length.buckets]
        axes.plot(x, length.mean_ce, marker="o", markersize=3, label=f"L = {length.length:,} ({length.windows} "
                                                                      f"windows)")
    if training_length is not None:
        axes.axvline(training_length, color="grey", linestyle="--", linewidth=1,
                     label=f"training length {training_length:,}")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("tokens seen (position + 1, log scale)")
    axes.set_ylabel("mean next-token CE (nats)")
    axes.set_title(title or f"loss by position, {result.source}")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
