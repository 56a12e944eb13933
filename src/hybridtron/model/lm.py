"""HybridLM: embed -> hybrid blocks -> norm_f -> lm_head, plus the shared MTP block applied D times.

    logits  = lm_head(norm_f(blocks(embed(ids))))          no positional encoding, no embedding scaling
    loss    = CE(logits) + mtp_loss_weight * mean_k CE(mtp_logits_k)

Labels are already shifted: `labels[b, t]` is the token position t must predict, -100 where nothing is to be
predicted (a document boundary, padding). Depth k at position t predicts `labels[t + k]`, and only where
`labels[t .. t+k]` are all valid, so no MTP target crosses a boundary the packer marked.

A depth with no valid target at all (a sequence of T <= k tokens, or documents all shorter than k + 1) has weight
zero: its CE is a zero with a zero gradient (`mean_or_zero`), and the mean over the depths keeps its divisor D, so
every depth weighs mtp_loss_weight / D whatever the other depths hold (the report's 0.05 per depth), as the token-mean
post-training losses do (`post.sft.sft_loss`). `LMOutput.mtp_target_counts` says which depths were empty. A
batch with no target at all (T = 1) has a next-token loss of zero too.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from hybridtron.config import MOE, ModelConfig
from hybridtron.model.block import Block, run_mixer
from hybridtron.model.documents import check_seq_idx
from hybridtron.model.mamba2 import Mamba2Mixer
from hybridtron.model.moe import MoE, Router, RoutedExperts
from hybridtron.model.mtp import MTPBlock
from hybridtron.model.norm import GatedGroupRMSNorm, RMSNorm
from hybridtron.ops.cross_entropy import IGNORE_INDEX, cross_entropy as ops_cross_entropy


@dataclass
class LMOutput:
    logits: torch.Tensor | None  # None under forward(logits=False)
    loss: torch.Tensor | None = None
    lm_loss: torch.Tensor | None = None
    mtp_losses: list[torch.Tensor] = field(default_factory=list)  # a depth with no target: a zero (`mean_or_zero`)
    mtp_target_counts: list[int] = field(default_factory=list)  # each depth's valid targets (0: it adds nothing)
    mtp_logits: list[torch.Tensor] = field(default_factory=list)
    expert_counts: torch.Tensor | None = None  # [backbone MoE layers, experts]
    mtp_expert_counts: torch.Tensor | None = None  # [MoE layers of the MTP block, experts], summed over the depths
    hidden: torch.Tensor | None = None
    mtp_hidden: list[torch.Tensor] = field(default_factory=list)  # each MTP depth's output, what lm_head reads


def _stacked_counts(layers: list[MoE], counted: torch.Tensor | None = None) -> torch.Tensor | None:
    """[layers, experts]: each layer's last routing, over the `counted` positions [B, T] only (None: all)."""
    if not layers or any(moe.last_expert_ids is None for moe in layers):
        return None
    return torch.stack([moe.last_expert_counts if counted is None else moe.counted_expert_counts(counted)
                        for moe in layers])


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, kind, config.attention_window(index))
                                    for index, kind in enumerate(config.layers_block_type))
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon)


# An id past the end of a sequence, among the ids that follow a window of it (`HybridLM.forward`'s following_ids):
# embedded as zeros, as the positions past the end of a whole sequence are padded.
PAST_END = -1


def embed_ahead(embedding: nn.Module, ids_BT: torch.Tensor) -> torch.Tensor:
    """The embeddings of `ids_BT` [B, T, D], zeros where an id is PAST_END."""
    past_end = ids_BT == PAST_END
    return embedding(ids_BT.masked_fill(past_end, 0)).masked_fill(past_end[..., None], 0.0)


def counted_at_depth(counted_BT: torch.Tensor, depth: int, length: int) -> torch.Tensor:
    """[B, length]: the positions t of a window of `length` whose MTP depth `depth` routing counts: t and t + depth
    both counted (`counted_BT` may run on past the window: the positions after a context-parallel share)."""
    ahead = F.pad(counted_BT[:, depth:depth + length], (0, max(0, length - counted_BT.shape[1] + depth)), value=False)
    return counted_BT[:, :length] & ahead


def mtp_targets(labels_BT: torch.Tensor, depth: int) -> torch.Tensor:
    """Depth-k targets [B, T]: labels[t+k] where labels[t..t+k] are all valid, else IGNORE_INDEX (all of them when
    T <= k)."""
    length = labels_BT.shape[1]
    valid = labels_BT != IGNORE_INDEX
    shifted = F.pad(labels_BT[:, depth:], (0, min(depth, length)), value=IGNORE_INDEX)
    chain_valid = valid.clone()
    for offset in range(1, depth + 1):
        chain_valid &= F.pad(valid[:, offset:], (0, min(offset, length)), value=False)
    return shifted.masked_fill(~chain_valid, IGNORE_INDEX)


def cross_entropy(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    return ops_cross_entropy(logits_BTV.flatten(0, 1), targets_BT.flatten(), IGNORE_INDEX)


def mean_or_zero(mean_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], output: torch.Tensor,
                 targets: torch.Tensor) -> torch.Tensor:
    """`mean_loss(output, targets)` (a mean over the valid targets), or where there is none a zero whose gradient is
    zero: a mean over nothing is 0 / 0, NaN in the value and the gradient. The zero stays in `output`'s graph, so a
    backward still runs through every module that made it (context parallelism's collectives need every rank to)."""
    if not bool((targets != IGNORE_INDEX).any()):
        return output.sum() * 0.0 + 0.0  # + 0.0: a positive zero
    return mean_loss(output, targets)


class HybridLM(nn.Module):
    def __init__(self, config: ModelConfig, *, init: bool = True):
        """`init`: the weights of `init_weights`, drawn from torch's global generator; the modules are built on the
        meta device first, so that those draws are all the generator gives (a sharded build replays them, see
        `initializers`). Built inside `with torch.device("meta")` the model stays there, uninitialized.
        `init=False`: the modules' own default weights, for a caller that loads its weights next."""
        super().__init__()
        self.config = config
        device = torch.empty(0).device  # the device in effect: the default one, or a `with torch.device(...)`
        with torch.device("meta") if init else contextlib.nullcontext():
            self.backbone = Backbone(config)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.mtp = MTPBlock(config) if config.has_mtp else None
        if init and device.type != "meta":
            self.to_empty(device=device)
            self.init_weights()

    # ------------------------------------------------------------------------------------------------ init
    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Every parameter and buffer set by `initializers`, in their order."""
        tensors = {**dict(self.named_parameters()), **dict(self.named_buffers())}
        for name, initialize in self.initializers():
            initialize(tensors[name], generator)

    def initializers(self) -> list[tuple[str, Callable[[torch.Tensor, torch.Generator | None], object]]]:
        """(name, fill in place) of every parameter and buffer, in the order they draw from the generator.
        N(0, initializer_range) linears, embedding, routers and experts; norms 1; biases 0; Mamba's A_log =
        log(1..heads), D = 1, dt_bias = softplus^-1(dt) with dt log-uniform in [time_step_min, time_step_max]
        floored at time_step_floor, conv1d U(+-1/sqrt(kernel)), and out_proj scaled by 1/sqrt(n_layers) so the
        residual stream does not grow with depth. Each fill reads only its own tensor's shape: a sharded build
        (`hybridtron.distributed.materialize`) runs them one whole tensor at a time, in this order, and keeps its shard,
        so every layout starts from the weights one process draws from the same seed."""
        cfg, std = self.config, self.config.initializer_range
        mamba = [(name, module) for name, module in self.named_modules() if isinstance(module, Mamba2Mixer)]
        rescaled = {f"{name}.out_proj" for name, _ in mamba} if cfg.rescale_prenorm_residual else set()
        residual_divisor = math.sqrt(cfg.num_hidden_layers)

        def normal(tensor, generator):
            return tensor.normal_(0.0, std, generator=generator)

        def zero(tensor, generator):
            return tensor.zero_()

        def one(tensor, generator):
            return tensor.fill_(1.0)

        plan = []
        for name, module in self.named_modules():
            prefix = f"{name}." if name else ""
            if isinstance(module, (nn.Linear, nn.Embedding)):
                plan.append((prefix + "weight", (lambda t, g: normal(t, g).div_(residual_divisor))
                             if name in rescaled else normal))
                if getattr(module, "bias", None) is not None:
                    plan.append((prefix + "bias", zero))
            elif isinstance(module, (RMSNorm, GatedGroupRMSNorm)):
                plan.append((prefix + "weight", one))
            elif isinstance(module, Router):
                plan += [(prefix + "weight", normal), (prefix + "e_score_correction_bias", zero)]
            elif isinstance(module, RoutedExperts):
                plan += [(prefix + "up_proj", normal), (prefix + "down_proj", normal)]

        def dt_bias(tensor, generator):
            dt = torch.exp(torch.rand(tensor.shape, generator=generator)
                           * (math.log(cfg.time_step_max) - math.log(cfg.time_step_min))
                           + math.log(cfg.time_step_min)).clamp(min=cfg.time_step_floor)
            return tensor.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus

        def a_log(tensor, generator):
            return tensor.copy_(torch.log(torch.arange(1, len(tensor) + 1, dtype=torch.float32)))

        def conv_weight(tensor, generator):
            bound = tensor.shape[-1] ** -0.5  # fan in: the depthwise kernel's width
            return tensor.uniform_(-bound, bound, generator=generator)

        for name, module in mamba:
            plan += [(f"{name}.A_log", a_log), (f"{name}.D", one), (f"{name}.dt_bias", dt_bias),
                     (f"{name}.conv1d.weight", conv_weight)]
            if module.conv1d.bias is not None:
                plan.append((f"{name}.conv1d.bias", zero))
        return plan

    # -------------------------------------------------------------------------------------------- forward
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *, cache=None,
                mtp: bool = True, expert_ids: dict[str, torch.Tensor] | None = None,
                mixer_fn=run_mixer, logits: bool = True, following_ids: torch.Tensor | None = None,
                counted: torch.Tensor | None = None, seq_idx: torch.Tensor | None = None) -> LMOutput:
        """`cache`: continue from a `model.state.LayerStates` (or its serving subclass `infer.cache.HybridCache`)
        and advance it (no MTP logits, no expert counts). `expert_ids`: routing replay for the backbone's MoE layers,
        {router name (`routers()`): chosen experts [B, T, k]}; a layer not named routes itself (the MTP block always
        does). `mixer_fn`: how each block's mixer runs (`block.run_mixer`, the reference; decoders pass their fast
        paths, `hybridtron.infer.fastpath`). `logits=False`: stop before lm_head (`logits` None, `mtp_logits` empty):
        `hidden` and `mtp_hidden` are what it would read, for a loss that applies it itself (no `labels` then).
        `following_ids` [B, <= mtp_num_depths]: the tokens after `input_ids` when they are a window of a longer
        sequence (a context-parallel chunk, `hybridtron.distributed.context_parallel`): MTP depth k at the window's last
        positions reads their embeddings instead of the padding past an end; PAST_END where the sequence ends.
        `counted` [B, T] bool (with `following_ids`: [B, T + following]): the real positions, not padding (whose
        amount depends on how ragged rows were batched); the expert counts then include the backbone's routing at
        counted positions t and MTP depth k's where t + k is counted too (it reads token t + k); None: everywhere.
        `seq_idx` [B, T] int: packed documents (`model.documents`): each position's document within its row,
        non-decreasing; every document is computed as if alone in its row (training forwards: no `cache`)."""
        self._check_ids(input_ids)
        if seq_idx is not None:
            check_seq_idx(seq_idx, input_ids)
            if cache is not None:
                raise ValueError("HybridLM.forward: seq_idx (packed documents) is for training forwards, not a cache")
        length, ids_ahead = input_ids.shape[1], input_ids
        if following_ids is not None:
            self._check_ids(following_ids, "following_ids", past_end=True)
            ids_ahead = torch.cat([input_ids, following_ids], dim=1)
        if labels is not None and not logits:
            raise ValueError("HybridLM.forward: labels need the logits (logits=False leaves the loss to the caller)")
        # one call: the following ids' rows are MTP's alone (no slice of a whole window: a view would change the
        # order autograd sums the embeddings' gradient in)
        embeddings_ahead = self.backbone.embeddings(ids_ahead) if following_ids is None else \
            embed_ahead(self.backbone.embeddings, ids_ahead)
        hidden = embeddings_ahead if following_ids is None else embeddings_ahead[:, :length]
        layer_states = cache.layers if cache is not None else [None] * len(self.backbone.layers)
        lengths = cache.lengths if cache is not None else None
        for index, (layer, layer_cache) in enumerate(zip(self.backbone.layers, layer_states)):
            replay = expert_ids.get(str(index)) if expert_ids else None
            hidden = layer(hidden, layer_cache, lengths, replay, mixer_fn, seq_idx)
        if cache is not None:
            cache.lengths += length
        hidden = self.backbone.norm_f(hidden)
        out = LMOutput(logits=self.lm_head(hidden) if logits else None, hidden=hidden,
                       expert_counts=_stacked_counts(self.moe_layers(), None if counted is None else
                                                     counted[:, :length]) if cache is None else None)

        if mtp and self.mtp is not None and cache is None:
            previous = hidden
            for depth in range(1, self.config.mtp_num_depths + 1):
                # the embedding of token t+k; positions past the end see padding and are never scored
                ahead = embeddings_ahead[:, depth:depth + length]
                next_embedding = F.pad(ahead, (0, 0, 0, length - ahead.shape[1]))
                previous = self.mtp(previous, next_embedding, seq_idx=seq_idx)
                out.mtp_hidden.append(previous)
                if logits:
                    out.mtp_logits.append(self.lm_head(previous))
                # the shared block routes once per depth: its routers balance over every token they saw
                counts = _stacked_counts(self.mtp_moe_layers(), None if counted is None else
                                         counted_at_depth(counted, depth, length))
                if counts is not None:
                    out.mtp_expert_counts = counts if out.mtp_expert_counts is None else out.mtp_expert_counts + counts

        if labels is not None:
            if labels.shape != input_ids.shape:
                raise ValueError(f"labels shape {tuple(labels.shape)} != input_ids shape {tuple(input_ids.shape)}")
            out.lm_loss = mean_or_zero(cross_entropy, out.logits, labels)
            depth_targets = [mtp_targets(labels, depth) for depth in range(1, len(out.mtp_logits) + 1)]
            out.mtp_losses = [mean_or_zero(cross_entropy, mtp_logits, targets)
                              for mtp_logits, targets in zip(out.mtp_logits, depth_targets)]
            out.mtp_target_counts = [int((targets != IGNORE_INDEX).sum()) for targets in depth_targets]
            out.loss = out.lm_loss
            if out.mtp_losses:
                out.loss = out.loss + self.config.mtp_loss_weight * torch.stack(out.mtp_losses).mean()
        return out

    def decode_step(self, ids_B: torch.Tensor, cache) -> torch.Tensor:
        """One token per sequence on a `LayerStates` -> next-token logits [B, V]; the states are advanced in place.

        The static-shape form of `forward(ids[:, None], cache=cache)`, for compiling (`torch.compile(fullgraph=True,
        dynamic=False)`, see `hybridtron.infer.decoder.Decoder`): every shape follows from the batch and the
        cache's size, nothing is read back to Python and no branch depends on a value, so one graph serves every
        step. The ids are not checked (that reads them back); decoders feed the model's own sampled tokens.
        """
        hidden_BD = self.backbone.embeddings(ids_B)
        for layer, layer_cache in zip(self.backbone.layers, cache.layers):
            hidden_BD = layer.decode_step(hidden_BD, layer_cache, cache.lengths)
        cache.lengths.add_(1)
        return self.lm_head(self.backbone.norm_f(hidden_BD))

    def _check_ids(self, input_ids: torch.Tensor, name: str = "input_ids", past_end: bool = False) -> None:
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int32):
            raise ValueError(f"{name} must be an integer tensor [batch, time], got {input_ids.dtype} "
                             f"{tuple(input_ids.shape)}")
        if input_ids.numel():
            low, high = (int(v) for v in torch.aminmax(input_ids))
            if low < (PAST_END if past_end else 0) or high >= self.config.vocab_size:
                allowed = f" or PAST_END ({PAST_END})" if past_end else ""
                raise ValueError(f"{name} must lie in [0, vocab_size={self.config.vocab_size}){allowed}, "
                                 f"got [{low}, {high}]")

    # ---------------------------------------------------------------------------------------- introspection
    def moe_layers(self) -> list[MoE]:
        """The backbone's MoE layers, in order (the rows of `LMOutput.expert_counts`)."""
        return [layer.mixer for layer in self.backbone.layers if layer.kind == MOE]

    def mtp_moe_layers(self) -> list[MoE]:
        """The MoE layers of the MTP block (the rows of `LMOutput.mtp_expert_counts`)."""
        if self.mtp is None:
            return []
        return [layer.mixer for layer in self.mtp.layers if layer.kind == MOE]

    def routers(self) -> dict[str, MoE]:
        """Every MoE layer with a router, by the name its signals are logged under: the backbone layer index
        ("3"), then the MTP block's layer ("mtp.1"). Balancing and MaxVio cover all of them (as Megatron does)."""
        named = {str(i): layer.mixer for i, layer in enumerate(self.backbone.layers) if layer.kind == MOE}
        if self.mtp is not None:
            named.update({f"mtp.{i}": layer.mixer for i, layer in enumerate(self.mtp.layers) if layer.kind == MOE})
        return named

    def router_biases(self) -> list[torch.Tensor]:
        """The fp32 correction biases of every router, in `routers()` order."""
        return [moe.gate.e_score_correction_bias for moe in self.routers().values()]

    def num_parameters(self, active: bool = False, include_mtp: bool = False) -> int:
        """Parameters of the backbone and lm_head (the MTP block apart). `active`: what one token uses: the top-k
        routed experts of each MoE layer, the shared expert and all other layers and lm_head, not the embedding
        table. Works on a model built on the meta device."""
        total = 0
        for name, param in self.named_parameters():
            if name.startswith("mtp.") and not include_mtp:
                continue
            count = param.numel()
            if active:
                if name == "backbone.embeddings.weight":
                    continue
                if ".experts.up_proj" in name or ".experts.down_proj" in name:
                    count = count // self.config.n_routed_experts * self.config.num_experts_per_tok
            total += count
        return total

    @classmethod
    def on_meta(cls, config: ModelConfig) -> "HybridLM":
        """The model's structure without memory: for counting parameters of large presets."""
        with torch.device("meta"):
            return cls(config, init=False)

