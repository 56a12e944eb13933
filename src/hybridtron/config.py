"""Model configuration: the `nemotron_h` config.json fields, validated, with presets.

`ModelConfig` keeps the exact field names of Hugging Face's `NemotronHConfig` so that `to_hf()` writes a
config.json that transformers, vLLM and Megatron-Bridge read, and `from_hf()` reads theirs. Two fields are
hybridtron's own (`mtp_num_depths`, `mtp_loss_weight`): how many times the one stored MTP block is applied,
and the total weight of the MTP loss. Other readers ignore them. The architecture options of the Marin hero run
(`moe_latent_norm`, `moe_output_norm`, `sliding_window` with `sliding_window_layers`; docs/model.md) are ours too,
all off by default; `nemotron_h` readers cannot express them (`nemotron_h_blocker`), so an HF export refuses a model
that sets one, and `to_hf` writes them only when set, under hybridtron's own `model_type` ("hybridtron_h"), which
only hybridtron loads: a training run's own export of such a model (its `hf/`), never misread as `nemotron_h`.

Presets are plain functions: `tiny()` trains on a laptop CPU; `nano3()`, `super3()`, `ultra3()` carry the
published numbers of Nemotron 3 Nano / Super / Ultra.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Block kinds, as `layers_block_type` names them, and the legacy pattern characters.
MAMBA, ATTENTION, MOE, MLP = "linear_attention", "full_attention", "moe", "mlp"
LAYER_KINDS = (MAMBA, ATTENTION, MOE, MLP)
PATTERN_CHAR_TO_KIND = {"M": MAMBA, "*": ATTENTION, "E": MOE, "-": MLP}
KIND_TO_PATTERN_CHAR = {v: k for k, v in PATTERN_CHAR_TO_KIND.items()}
LEGACY_KIND_NAMES = {"mamba": MAMBA, "attention": ATTENTION}

# transformers' prefill (up to 5.24) clamps dt at config.time_step_min (see ModelConfig.to_hf); an HF export moves the
# init value aside and writes the smallest normal fp32 there, where the clamp changes nothing.
INIT_TIME_STEP_MIN_KEY = "hybridtron_init_time_step_min"
TRANSFORMERS_DT_CLAMP = 1.1754943508222875e-38  # torch.finfo(torch.float32).tiny

# Older NVIDIA configs spell some Mamba fields with a `mamba_` prefix.
MAMBA_ALIASES = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_dt_min": "time_step_min",
    "mamba_dt_max": "time_step_max",
    "mamba_dt_limit": "time_step_limit",
    "mamba_dt_init_floor": "time_step_floor",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_chunk_size": "chunk_size",
    "mamba_d_state": "ssm_state_size",
    "mamba_state_size": "ssm_state_size",
}

NEMOTRON_H = "nemotron_h"
HYBRIDTRON_H = "hybridtron_h"  # the model_type of a model with options nemotron_h cannot express
# what `hybridtron slice` cut a checkpoint from (source, its layer count, the kept layers): provenance only
SLICED_FROM_KEY = "hybridtron_sliced_from"

# config.json keys we understand but do not model (transformers writes them; they do not change the math here).
IGNORED_HF_KEYS = {
    "architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "use_cache",
    "num_logits_to_keep", "use_mamba_kernels", "output_router_logits", "attention_dropout", "hidden_dropout",
    "expand", "mamba_expand", "mamba_ssm_cache_dtype", "n_shared_experts",
    "moe_shared_expert_overlap", "residual_in_fp32", "num_hidden_layers", "auto_map", "_name_or_path",
    "rope_theta", "rope_scaling", "partial_rotary_factor",
    "quantization_config", "output_attentions", "output_hidden_states", "return_dict", "chunk_size_feed_forward",
    "id2label", "label2id", "is_encoder_decoder", "problem_type",  # PreTrainedConfig.to_dict() writes these too
    SLICED_FROM_KEY,
}


def parse_pattern(pattern: str, field_name: str = "hybrid_override_pattern") -> tuple[str, ...]:
    """`"M*E-"` -> ("linear_attention", "full_attention", "moe", "mlp")."""
    kinds = []
    for position, char in enumerate(pattern):
        if char not in PATTERN_CHAR_TO_KIND:
            raise ValueError(
                f"{field_name}: unknown layer character {char!r} at position {position}; "
                f"expected one of {''.join(PATTERN_CHAR_TO_KIND)} (M=Mamba-2, *=attention, E=MoE, -=dense MLP)"
            )
        kinds.append(PATTERN_CHAR_TO_KIND[char])
    return tuple(kinds)


def to_pattern(kinds: tuple[str, ...]) -> str:
    return "".join(KIND_TO_PATTERN_CHAR[k] for k in kinds)


def _normalize_kinds(kinds, field_name: str) -> tuple[str, ...]:
    if isinstance(kinds, str):
        return parse_pattern(kinds, field_name)
    out = []
    for position, kind in enumerate(kinds):
        kind = LEGACY_KIND_NAMES.get(kind, kind)
        if kind not in LAYER_KINDS:
            raise ValueError(
                f"{field_name}[{position}]: unknown layer kind {kind!r}; expected one of {', '.join(LAYER_KINDS)}"
            )
        out.append(kind)
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Every field of transformers' `NemotronHConfig`, with its names and defaults."""

    vocab_size: int = 131072
    hidden_size: int = 4096
    layers_block_type: tuple[str, ...] = (MAMBA, MOE, ATTENTION, MLP)
    tie_word_embeddings: bool = False  # transformers never ties; kept for the config.json round trip
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    rescale_prenorm_residual: bool = True  # Mamba out_proj init scaled by 1/sqrt(n_layers)
    max_position_embeddings: int = 4096  # no positional encoding; only bounds generation
    # attention (GQA, no positional encoding)
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    attention_bias: bool = False
    # dense MLP layers ('-')
    intermediate_size: int = 21504
    mlp_hidden_act: str = "relu2"
    mlp_bias: bool = False
    # Mamba-2 mixer ('M'); inner width = mamba_num_heads * mamba_head_dim
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    mamba_hidden_act: str = "silu"
    n_groups: int = 8
    ssm_state_size: int = 128
    conv_kernel: int = 4
    use_conv_bias: bool = True
    chunk_size: int = 128
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_floor: float = 1e-4
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    use_bias: bool = False
    mamba_proj_bias: bool = False
    # MoE ('E'); LatentMoE when moe_latent_size is set
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 7688
    moe_shared_expert_intermediate_size: int = 7688
    moe_latent_size: int | None = None
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    # Marin options (hybridtron's own, off by default; docs/model.md "Architecture options (Marin)")
    moe_latent_norm: bool = False  # RMSNorm on the latent the routed experts read (LatentMoE only)
    moe_output_norm: bool = False  # RMSNorm on the MoE block's output, before the residual add
    sliding_window: int | None = None  # tokens an attention layer of sliding_window_layers sees, itself included
    # backbone layer indices of the windowed attention layers; None: 3 of every 4 attention layers (every 4th full)
    sliding_window_layers: tuple[int, ...] | None = None
    # multi-token prediction: one stored block, applied mtp_num_depths times with shared weights
    num_nextn_predict_layers: int = 0
    mtp_layers_block_type: tuple[str, ...] = (ATTENTION, MOE)
    mtp_num_depths: int = 2
    mtp_loss_weight: float = 0.1  # total over all depths (the report: 0.05 per depth, D = 2)
    # special tokens
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen dataclass)
        set_("layers_block_type", _normalize_kinds(self.layers_block_type, "layers_block_type"))
        set_("mtp_layers_block_type", _normalize_kinds(self.mtp_layers_block_type, "mtp_layers_block_type"))
        set_("time_step_limit", tuple(float(v) for v in self.time_step_limit))
        if self.sliding_window_layers is not None and not isinstance(self.sliding_window_layers, (str, bytes)):
            set_("sliding_window_layers", tuple(self.sliding_window_layers))
        self.validate()

    # ----------------------------------------------------------------------------------------- validation
    def validate(self) -> None:
        def positive(*names):
            for name in names:
                value = getattr(self, name)
                if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                    raise ValueError(f"{name} must be a positive number, got {value!r}")

        positive("vocab_size", "hidden_size", "layer_norm_epsilon", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "intermediate_size", "mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size",
                 "conv_kernel", "chunk_size", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                 "moe_shared_expert_intermediate_size", "routed_scaling_factor", "n_group", "topk_group",
                 "mtp_num_depths", "max_position_embeddings")
        if self.moe_latent_size is not None:
            positive("moe_latent_size")
        if not self.layers_block_type:
            raise ValueError("layers_block_type must name at least one layer")
        if self.mamba_num_heads % self.n_groups:
            raise ValueError(f"mamba_num_heads ({self.mamba_num_heads}) must be divisible by n_groups "
                             f"({self.n_groups})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= n_routed_experts "
                             f"({self.n_routed_experts})")
        if self.n_routed_experts % self.n_group:
            raise ValueError(f"n_routed_experts ({self.n_routed_experts}) must be divisible by n_group "
                             f"({self.n_group})")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) must be <= n_group ({self.n_group})")
        if self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
            raise ValueError(f"n_group ({self.n_group}) leaves fewer than 2 experts per group; group scores sum the "
                             f"top-2 experts of each group")
        if self.n_group > 1 and self.topk_group * (self.n_routed_experts // self.n_group) < self.num_experts_per_tok:
            raise ValueError(f"topk_group ({self.topk_group}) groups of {self.n_routed_experts // self.n_group} "
                             f"experts hold fewer than num_experts_per_tok ({self.num_experts_per_tok})")
        if self.num_nextn_predict_layers not in (0, 1):
            raise ValueError(f"num_nextn_predict_layers must be 0 or 1 (one stored MTP block, applied "
                             f"mtp_num_depths times), got {self.num_nextn_predict_layers}")
        if self.mlp_hidden_act != "relu2":
            raise ValueError(f"mlp_hidden_act: only 'relu2' is supported, got {self.mlp_hidden_act!r}")
        if self.mamba_hidden_act != "silu":
            raise ValueError(f"mamba_hidden_act: only 'silu' is supported, got {self.mamba_hidden_act!r}")
        lo, hi = self.time_step_limit
        if not (0.0 <= lo <= hi):
            raise ValueError(f"time_step_limit must be (low, high) with 0 <= low <= high, got {self.time_step_limit}")
        if not (0 < self.time_step_min <= self.time_step_max):
            raise ValueError(f"time_step_min ({self.time_step_min}) must be in (0, time_step_max={self.time_step_max}]")
        if self.mtp_loss_weight < 0:
            raise ValueError(f"mtp_loss_weight must be >= 0, got {self.mtp_loss_weight}")
        self._validate_marin_options()
        if self.tie_word_embeddings:
            raise ValueError("tie_word_embeddings: nemotron_h never ties the embedding and lm_head (transformers "
                             "ignores the flag); set it to false")

    def _validate_marin_options(self) -> None:
        for name in ("moe_latent_norm", "moe_output_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.moe_latent_norm and self.moe_latent_size is None:
            raise ValueError("moe_latent_norm: normalises the LatentMoE latent, but moe_latent_size is None "
                             "(plain MoE has no latent)")
        window = self.sliding_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
            raise ValueError(f"sliding_window must be a positive number of tokens or None, got {window!r}")
        layers = self.sliding_window_layers
        if layers is None:
            return
        if window is None:
            raise ValueError(f"sliding_window_layers is {list(layers) if isinstance(layers, tuple) else layers!r} "
                             "but sliding_window is None; set the window or drop the layers")
        if not isinstance(layers, tuple):
            raise ValueError(f"sliding_window_layers must be a list of layer indices, got {layers!r}")
        for index in layers:
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.num_hidden_layers:
                raise ValueError(f"sliding_window_layers: {index!r} is not a layer index in "
                                 f"[0, {self.num_hidden_layers})")
            if self.layers_block_type[index] != ATTENTION:
                raise ValueError(f"sliding_window_layers: layer {index} is {self.layers_block_type[index]!r}, "
                                 f"not an attention layer ({ATTENTION})")
        if len(set(layers)) != len(layers):
            raise ValueError(f"sliding_window_layers: {list(layers)} names a layer twice")

    # ------------------------------------------------------------------------------------- derived sizes
    @property
    def num_hidden_layers(self) -> int:
        return len(self.layers_block_type)

    @property
    def hybrid_override_pattern(self) -> str:
        return to_pattern(self.layers_block_type)

    @property
    def mamba_inner_size(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_channels(self) -> int:
        """Channels of the Mamba conv (and of its decoding state): x (inner width) and the B and C of every group."""
        return self.mamba_inner_size + 2 * self.n_groups * self.ssm_state_size

    @property
    def has_mtp(self) -> bool:
        return self.num_nextn_predict_layers > 0

    @property
    def mtp_depths(self) -> int:
        """The MTP depths a forward computes: mtp_num_depths with an MTP block, else none."""
        return self.mtp_num_depths if self.has_mtp else 0

    @property
    def expert_width(self) -> int:
        """Width the routed experts read and write: the latent size for LatentMoE, else hidden_size."""
        return self.moe_latent_size or self.hidden_size


    @property
    def windowed_layers(self) -> tuple[int, ...]:
        """Backbone layer indices whose attention sees only the last `sliding_window` tokens: `sliding_window_layers`,
        or by default 3 of every 4 attention layers (Marin's local:global ratio; the 4th, 8th, ... stay full, so
        information still crosses the whole context every few layers). The MTP block's attention is always full."""
        if self.sliding_window is None:
            return ()
        if self.sliding_window_layers is not None:
            return tuple(sorted(self.sliding_window_layers))
        attention = [i for i, kind in enumerate(self.layers_block_type) if kind == ATTENTION]
        return tuple(index for ordinal, index in enumerate(attention) if ordinal % 4 != 3)

    def nemotron_h_blocker(self) -> str | None:
        """Why a `nemotron_h` reader (transformers' NemotronHConfig) would misread this model, naming the field; None
        when it would not."""
        for name in ("moe_latent_norm", "moe_output_norm"):
            if getattr(self, name):
                return f"{name} = true has no nemotron_h equivalent (transformers would drop its norm weights)"
        if self.sliding_window is not None:
            return (f"sliding_window = {self.sliding_window} has no nemotron_h equivalent (transformers' NemotronH "
                    f"attends in full on every layer)")
        return None

    def attention_window(self, layer_index: int) -> int | None:
        """The window of backbone layer `layer_index`'s attention: `sliding_window` if it is windowed, else None."""
        return self.sliding_window if layer_index in self.windowed_layers else None

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------------------------- HF interchange
    @classmethod
    def from_hf(cls, source: dict | str | Path) -> "ModelConfig":
        """Read a `nemotron_h` config: a dict, a config.json path, or a checkpoint directory."""
        origin = "config dict"
        if not isinstance(source, dict):
            path = Path(source)
            if path.is_dir():
                path = path / "config.json"
            origin = str(path)
            if not path.is_file():
                raise FileNotFoundError(f"{path}: no config.json here (expected an HF checkpoint directory or file)")
            try:
                source = json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: not valid JSON ({exc})") from None
        raw = dict(source)
        model_type = raw.get("model_type", NEMOTRON_H)
        if model_type not in (NEMOTRON_H, HYBRIDTRON_H):
            raise ValueError(f"{origin}: model_type is {model_type!r}, expected {NEMOTRON_H!r} (or hybridtron's own "
                             f"{HYBRIDTRON_H!r})")
        for alias, name in MAMBA_ALIASES.items():
            if alias in raw:
                value = raw.pop(alias)
                raw.setdefault(name, value)
        pattern = raw.pop("hybrid_override_pattern", None)
        if raw.get("layers_block_type") is None:
            if pattern is None:
                raise ValueError(f"{origin}: neither layers_block_type nor hybrid_override_pattern is set")
            raw["layers_block_type"] = parse_pattern(pattern)
        mtp_pattern = raw.pop("mtp_hybrid_override_pattern", None)
        if raw.get("mtp_layers_block_type") is None:
            raw["mtp_layers_block_type"] = parse_pattern(mtp_pattern, "mtp_hybrid_override_pattern") \
                if mtp_pattern else (ATTENTION, MOE)
        if "time_step_limit" in raw:  # transformers writes inf as {"__float__": "Infinity"}
            raw["time_step_limit"] = [float(v["__float__"]) if isinstance(v, dict) else v
                                      for v in raw["time_step_limit"]]
        if isinstance(raw.get("eos_token_id"), list):
            raw["eos_token_id"] = raw["eos_token_id"][0]
        if INIT_TIME_STEP_MIN_KEY in raw:  # an HF export: time_step_min there is transformers' dt clamp
            raw["time_step_min"] = raw.pop(INIT_TIME_STEP_MIN_KEY)
        if raw.get("sliding_window") is not None and "sliding_window_layers" not in raw:
            # transformers' NemotronH keeps the field but runs every attention layer in full; which layers a
            # foreign config meant to window is unknowable, so honouring it would be a guess either way
            raise ValueError(f"{origin}: sliding_window is {raw['sliding_window']!r} without sliding_window_layers "
                             "(hybridtron's field); nemotron_h readers ignore it and attend in full, so it is refused "
                             "rather than guessed; set it to null, or add sliding_window_layers")
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in raw.items() if k in known}
        unknown = sorted(k for k in raw if k not in known and k not in IGNORED_HF_KEYS)
        if unknown:
            raise ValueError(f"{origin}: unknown nemotron_h fields {unknown}")
        if raw.get("tie_word_embeddings"):
            kwargs["tie_word_embeddings"] = False  # transformers never ties nemotron_h; neither do we
        return cls(**kwargs)

    def to_hf(self, *, export: bool = False) -> dict[str, Any]:
        """The config.json that transformers' NemotronHConfig (and NVIDIA's checkpoints) use.

        `export`: the config.json of a checkpoint published for other readers. Every `nemotron_h` reader but one
        computes dt = softplus(.) clamped to `time_step_limit` = (0, inf): vLLM, Megatron (mamba_ssm's kernels),
        NVIDIA's reference code, transformers' own one-token decode step, and hybridtron. transformers' prefill up to
        5.24 alone clamps at `time_step_min` (an init hyperparameter everywhere else; 5.25 reads `time_step_limit`
        as the rest do), so a trained model whose dt falls
        below it gives other logits there. The export therefore writes the smallest normal fp32 as
        `time_step_min` (transformers' clamp then changes nothing but denormals) and keeps the init value under
        `hybridtron_init_time_step_min`, which `from_hf` restores."""
        out: dict[str, Any] = {"architectures": ["NemotronHForCausalLM"], "model_type": NEMOTRON_H}
        if self.nemotron_h_blocker() is not None:  # transformers must refuse it, not compute another model
            out.update(architectures=["HybridtronForCausalLM"], model_type=HYBRIDTRON_H)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        if export:
            out[INIT_TIME_STEP_MIN_KEY] = self.time_step_min
            out["time_step_min"] = TRANSFORMERS_DT_CLAMP
        # the Marin options only when set: a config without them writes the same config.json as before them
        for name in ("moe_latent_norm", "moe_output_norm"):
            if not getattr(self, name):
                del out[name]
        if self.sliding_window is None:
            del out["sliding_window"], out["sliding_window_layers"]
        out["time_step_limit"] = [self.time_step_limit[0], self.time_step_limit[1]]
        out["num_hidden_layers"] = self.num_hidden_layers
        out["hybrid_override_pattern"] = self.hybrid_override_pattern
        return out

    def to_json(self) -> str:
        # json writes inf as Infinity, which Python's json and transformers read back.
        return json.dumps(self.to_hf(), indent=2)


# ------------------------------------------------------------------------------------------------ presets
def tiny(**overrides) -> ModelConfig:
    """A few million parameters, all four layer kinds, LatentMoE, MTP: trains on a laptop CPU in minutes."""
    base = dict(
        vocab_size=4096, hidden_size=192, layers_block_type=parse_pattern("ME*EM-ME"),
        num_attention_heads=6, num_key_value_heads=2, head_dim=32, intermediate_size=384,
        mamba_num_heads=6, mamba_head_dim=32, n_groups=2, ssm_state_size=32, chunk_size=64,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=192, moe_shared_expert_intermediate_size=384,
        moe_latent_size=96, routed_scaling_factor=2.5, n_group=2, topk_group=2,
        num_nextn_predict_layers=1, max_position_embeddings=8192,
    )
    base.update(overrides)
    return ModelConfig(**base)


def tiny_dense(**overrides) -> ModelConfig:
    """`tiny` without MoE: Mamba-2, attention and dense MLP layers, and an attention-only MTP block. What vLLM's CPU
    backend runs (it has no kernel for relu2 routed experts, and vLLM's nemotron_h MTP takes attention and MoE layers
    only), so the vLLM rollouts and exports are tested and measured on it (docs/deployment.md#serving-with-vllm)."""
    return tiny(**{"layers_block_type": parse_pattern("M-*-M-M-"), "mtp_layers_block_type": (ATTENTION,),
                   **overrides})


def bench22m(**overrides) -> ModelConfig:
    """The 22.6M-parameter benchmark config: bench/train_step.py and bench/decode.py time it against transformers."""
    base = dict(
        vocab_size=32000, hidden_size=256, layers_block_type=parse_pattern("MEMEM*EM"),
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=1024,
        mamba_num_heads=8, mamba_head_dim=64, n_groups=1, ssm_state_size=64, chunk_size=128,
        n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=256, moe_shared_expert_intermediate_size=512,
        moe_latent_size=128,
    )
    base.update(overrides)
    return ModelConfig(**base)


DEEP_PATTERN = "MEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEME"


def deep(**overrides) -> ModelConfig:
    """39 narrow layers against one MTP block: Ultra's backbone-to-drafter cost ratio, small enough for a CPU.

    Speculative decoding pays when a draft costs a small share of a plain step; tiny's 8 layers against its
    2-layer MTP block cap the speedup near 1.5x (BENCHMARKS.md), so this preset exists to measure it where it pays.
    """
    base = dict(
        vocab_size=4096, hidden_size=96, layers_block_type=parse_pattern(DEEP_PATTERN),
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, intermediate_size=192,
        mamba_num_heads=4, mamba_head_dim=24, n_groups=1, ssm_state_size=16, chunk_size=64,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=96, moe_shared_expert_intermediate_size=192,
        moe_latent_size=48, routed_scaling_factor=2.5,
        num_nextn_predict_layers=1, max_position_embeddings=8192,
    )
    base.update(overrides)
    return ModelConfig(**base)


NANO3_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
SUPER3_PATTERN = ("MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME")
ULTRA3_ATTENTION_LAYERS = (7, 14, 23, 32, 39, 48, 57, 64, 73, 82, 89, 98)


def _ultra3_pattern() -> str:
    chars, next_is_mamba = [], True
    for i in range(108):
        if i in ULTRA3_ATTENTION_LAYERS:
            chars.append("*")
        else:
            chars.append("M" if next_is_mamba else "E")
            next_is_mamba = not next_is_mamba
    return "".join(chars)


ULTRA3_PATTERN = _ultra3_pattern()


def nano3(**overrides) -> ModelConfig:
    """Nemotron 3 Nano 30B-A3B."""
    base = dict(
        vocab_size=131072, hidden_size=2688, layers_block_type=parse_pattern(NANO3_PATTERN),
        mamba_num_heads=64, mamba_head_dim=64, n_groups=8, ssm_state_size=128, conv_kernel=4, chunk_size=128,
        num_attention_heads=32, num_key_value_heads=2, head_dim=128,
        n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=1856,
        moe_shared_expert_intermediate_size=3712, moe_latent_size=None, routed_scaling_factor=2.5,
        intermediate_size=1856, num_nextn_predict_layers=0, max_position_embeddings=262144,
    )
    base.update(overrides)
    return ModelConfig(**base)


def super3(**overrides) -> ModelConfig:
    """Nemotron 3 Super 120B-A12B (LatentMoE, one MTP block applied twice)."""
    base = dict(
        vocab_size=131072, hidden_size=4096, layers_block_type=parse_pattern(SUPER3_PATTERN),
        mamba_num_heads=128, mamba_head_dim=64, n_groups=8, ssm_state_size=128, conv_kernel=4, chunk_size=128,
        num_attention_heads=32, num_key_value_heads=2, head_dim=128,
        n_routed_experts=512, num_experts_per_tok=22, moe_intermediate_size=2688,
        moe_shared_expert_intermediate_size=5376, moe_latent_size=1024, routed_scaling_factor=5.0,
        intermediate_size=2688, num_nextn_predict_layers=1, max_position_embeddings=262144,
    )
    base.update(overrides)
    return ModelConfig(**base)


def ultra3(**overrides) -> ModelConfig:
    """Nemotron 3 Ultra 550B-A55B (LatentMoE, one MTP block applied twice)."""
    base = dict(
        vocab_size=131072, hidden_size=8192, layers_block_type=parse_pattern(ULTRA3_PATTERN),
        mamba_num_heads=256, mamba_head_dim=64, n_groups=8, ssm_state_size=128, conv_kernel=4, chunk_size=128,
        num_attention_heads=64, num_key_value_heads=2, head_dim=128,
        n_routed_experts=512, num_experts_per_tok=22, moe_intermediate_size=5120,
        moe_shared_expert_intermediate_size=10240, moe_latent_size=2048, routed_scaling_factor=5.0,
        intermediate_size=5120, num_nextn_predict_layers=1, max_position_embeddings=1048576,
    )
    base.update(overrides)
    return ModelConfig(**base)


PRESETS = {"tiny": tiny, "tiny-dense": tiny_dense, "bench22m": bench22m, "deep": deep, "nano3": nano3,
           "super3": super3, "ultra3": ultra3}


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; expected one of {', '.join(PRESETS)}")
    return PRESETS[name](**overrides)
