"""Run configuration: `[model]`, `[data]`, `[train]`, `[monitor]` and `[dist]` sections, from a preset, a TOML file and
`--set` overrides (`[monitor]`: the stability monitor's thresholds and responses, hybridtron.train.monitor.MonitorConfig;
`[dist]`: the parallel layout under torchrun, hybridtron.dist.config.DistConfig).

Every section is a frozen dataclass; an override `train.lr=3e-4` is parsed by the type of the field it names, and an
unknown section or field is an error that lists what exists.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import json
import math
import textwrap
import tokenize
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridtron.config import ModelConfig, preset
from hybridtron.data import DataConfig
from hybridtron.dist.config import DistConfig
from hybridtron.train.monitor.config import MonitorConfig

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 400  # optimizer steps
    grad_accum: int = 1  # micro-batches per optimizer step (gradients summed in fp32)
    lr: float = 3e-3  # peak learning rate
    min_lr_ratio: float = 0.0  # the decay ends at lr * min_lr_ratio
    warmup_steps: int = 40  # linear warmup
    decay_fraction: float = 0.3  # warmup-stable-decay: the last share of steps decays linearly
    weight_decay: float = 0.1  # AdamW's, on every weight of 2 or more dimensions (not on norms and biases)
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.95  # AdamW's second-moment decay
    eps: float = 1e-8  # AdamW's epsilon
    grad_clip: float = 1.0  # max global gradient L2 norm (0 = off)
    precision: str = "fp32"  # fp32 | bf16 (autocast) | nvfp4 | mxfp8 (emulated, by the precision policy)
    precision_policy: str = "ultra"  # nvfp4/mxfp8: "ultra" (Nemotron 3 Ultra's mixed policy) or "all" (ablation)
    nvfp4_stochastic_rounding: bool = True  # nvfp4 ablation switches: SR on gradients,
    nvfp4_rht: bool = True  # the Random Hadamard Transform on wgrad operands,
    nvfp4_2d_weights: bool = True  # 16x16 weight blocks
    grad_accum_dtype: str = "fp32"  # dtype of the output layer's gradient accumulation across micro-batches
    mtp_loss_weight: float | None = None  # None: the model config's (0.1 in total over the depths)
    router_bias_rate: float = 1e-3  # aux-loss-free balancing: b_i += u * sign(mean load - load_i) every step
    maxvio_window: int = 20  # steps over which MaxVio counts expert loads
    val_every: int = 50  # held-out validation loss every N steps (and at step 0 and the end)
    log_every: int = 1  # a metrics.jsonl line every N steps (and on every step with an event or an evaluation)
    checkpoint_every: int = 100  # a DCP checkpoint every N steps (written in the background)
    keep_checkpoints: int = 3  # keep the last K checkpoints
    seed: int = 0  # model initialization and the stochastic-rounding streams (the data order: data.seed)
    threads: int = 0  # torch intra-op threads; 0 = torch's default
    compile: bool = False  # torch.compile every block in place and the loss; fused AdamW (in one process)
    recompute: str = "none"  # activation checkpointing per block: none | selective | full

    def validate(self) -> None:
        for name in ("steps", "grad_accum", "val_every", "log_every",
                     "checkpoint_every", "keep_checkpoints", "maxvio_window"):
            if getattr(self, name) <= 0:
                raise ValueError(f"train.{name} must be positive, got {getattr(self, name)}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"train.lr must be a positive finite number, got {self.lr}")
        if not 0 <= self.decay_fraction <= 1:
            raise ValueError(f"train.decay_fraction must be in [0, 1], got {self.decay_fraction}")
        if self.precision not in ("fp32", "bf16", "nvfp4", "mxfp8"):
            raise ValueError(f"train.precision must be one of fp32, bf16, nvfp4, mxfp8; got {self.precision!r}")
        if self.precision_policy not in ("ultra", "all"):
            raise ValueError(f"train.precision_policy must be ultra or all, got {self.precision_policy!r}")
        if self.precision != "nvfp4" and not (self.nvfp4_stochastic_rounding and self.nvfp4_rht
                                              and self.nvfp4_2d_weights):
            raise ValueError(f"train.nvfp4_* switches apply to train.precision=nvfp4, not {self.precision!r}")
        if self.grad_accum_dtype not in ("fp32", "bf16"):
            raise ValueError(f"train.grad_accum_dtype must be fp32 or bf16, got {self.grad_accum_dtype!r}")
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"train.recompute must be none, selective or full, got {self.recompute!r}")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    model: ModelConfig = field(default_factory=lambda: preset("tiny"))
    data: DataConfig = field(default_factory=lambda: DataConfig(seq_len=256, batch_size=8))  # batch shape here
    train: TrainConfig = field(default_factory=TrainConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    dist: DistConfig = field(default_factory=DistConfig)  # the parallel layout under torchrun

    def to_dict(self) -> dict:
        return {"model": self.model.to_hf(), "data": _plain(self.data), "train": _plain(self.train),
                "monitor": _plain(self.monitor), "dist": _plain(self.dist)}

    def save(self, path: str | Path) -> None:
        from hybridtron.files import atomic_write_json

        atomic_write_json(path, self.to_dict())

    def to_toml(self) -> str:
        """The configuration as a TOML file that `--config` reads back to the same RunConfig, every field with
        the comment its dataclass gives it."""
        parts = [TOML_HEADER]
        for section in ("model", "data", "train", "monitor", "dist"):
            parts += section_toml(section, getattr(self, section)) + [""]
        return "\n".join(parts)

    @classmethod
    def load(cls, path: str | Path) -> "RunConfig":
        raw = read_run_config(path, ("model", "data", "train"), "a pretraining run")
        return cls(model=ModelConfig.from_hf(raw["model"]), data=_build(DataConfig, raw["data"], "data"),
                   train=_build(TrainConfig, raw["train"], "train"),
                   monitor=_build(MonitorConfig, raw.get("monitor", {}), "monitor"),
                   dist=_build(DistConfig, raw.get("dist", {}), "dist"))


TOML_HEADER = """\
# A hybridtron run configuration (`hybridtron pretrain --print-config` writes it; `--config FILE` reads it).
# Every field may be left out: [model] then keeps the --preset's value, the other sections their defaults.
# "none" stands for an unset optional field (TOML has no null).
"""


def section_toml(name: str, obj) -> list[str]:
    """The lines of one `[name]` section: each field of the dataclass `obj` as `field = value  # its comment`,
    under the group comments of its source."""
    comments = field_comments(type(obj))
    lines = [f"[{name}]"]
    for f in dataclasses.fields(obj):
        headers, comment = comments.get(f.name, ((), ""))
        lines += [f"# {header}" for header in headers]
        line = f"{f.name} = {_toml_value(getattr(obj, f.name))}"
        lines.append(f"{line}  # {comment}" if comment else line)
    return lines


@functools.cache
def field_comments(cls) -> dict[str, tuple[tuple[str, ...], str]]:
    """Per field of a dataclass, read from its source: (the group comments on their own lines just above it, its
    trailing comment, continued by the own-line comments below it that start with `#` and two or more spaces).
    Empty where the source cannot be read."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    fields = {f.name for f in dataclasses.fields(cls)}
    found: dict[str, tuple[tuple[str, ...], str]] = {}
    headers: list[str] = []
    current = None  # the field a comment belongs to
    first_on_line = True
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        kind, text, (_, column) = token.type, token.string, token.start
        if kind in (tokenize.NL, tokenize.NEWLINE):
            first_on_line = True
            continue
        if kind in (tokenize.INDENT, tokenize.DEDENT):
            continue
        if kind == tokenize.COMMENT:
            comment = text[1:]
            if not first_on_line and current is not None:  # the field's own trailing comment
                found[current] = (found[current][0], comment.strip())
            elif current is not None and comment.startswith("  "):  # its continuation
                found[current] = (found[current][0], f"{found[current][1]} {comment.strip()}".strip())
            else:  # a group comment over the fields below
                headers.append(comment.strip())
                current = None
            continue
        if first_on_line and column == 4:  # a statement of the class body: a field, a method, the docstring
            current = text if kind == tokenize.NAME and text in fields else None
            if current is not None:
                found[current] = (tuple(headers), "")
            headers = []
        first_on_line = False
    return found


def _toml_value(value) -> str:
    """A TOML literal; None, which TOML lacks, as the string "none" (what an override of an optional field takes)."""
    if value is None:
        return '"none"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # inf, nan and exponents are TOML floats as Python writes them
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__}")


def _plain(obj) -> dict:
    return {f.name: (list(v) if isinstance(v := getattr(obj, f.name), tuple) else v)
            for f in dataclasses.fields(obj)}


def read_toml(path: str | Path) -> dict[str, Any]:
    """A configuration file's TOML as a dict; FileNotFoundError or ValueError (invalid TOML) naming the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: config file not found")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: invalid TOML ({exc})") from None


def read_run_config(path: str | Path, required: tuple[str, ...], what: str) -> dict:
    """A run's run_config.json as a dict holding every key of `required`, or a ValueError naming the file and what
    it lacks (`what`: the kind of run, e.g. "an SFT run")."""
    try:
        raw = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    missing = [key for key in required if key not in raw]
    if missing:
        raise ValueError(f"{path}: not the run config of {what} (no {', '.join(missing)})")
    return raw


def _build(cls, values: dict, section: str):
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown {section} fields {unknown}; known: {', '.join(sorted(known))}")
    hints = typing.get_type_hints(cls)
    return cls(**{k: _coerce(v, hints[k], f"{section}.{k}") for k, v in values.items()})


def _coerce(value: Any, hint, name: str):
    """Convert `value` (a TOML value or an override string) to the field's type."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, name)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError(errors[0] if errors else f"{name}: cannot parse {value!r}")
    if origin is tuple:
        items = value if isinstance(value, (list, tuple)) else [v for v in str(value).split(",") if v]
        inner = args[0] if args else str
        return tuple(_coerce(v, inner, name) for v in items)
    if hint is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "1", "yes", "on"):
            return True
        if str(value).lower() in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"{name}: expected true or false, got {value!r}")
    if hint in (int, float, str):
        if hint is int and isinstance(value, float) and not value.is_integer():
            raise ValueError(f"{name}: expected an integer, got {value!r}")
        try:
            return hint(float(value)) if hint is int and isinstance(value, str) and "e" in value.lower() \
                else hint(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name}: expected {hint.__name__}, got {value!r}") from None
    return value


def parse_override(text: str) -> tuple[str, str, str]:
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ValueError(f"--set {text!r}: expected SECTION.FIELD=VALUE, e.g. train.lr=3e-4")
    key, value = text.split("=", 1)
    section, name = key.split(".", 1)
    return section.strip(), name.strip(), value.strip()


def build_run_config(base_preset: str = "tiny", toml_path: str | None = None, overrides: list[str] = (),
                     base: RunConfig | None = None) -> RunConfig:
    """preset (or a saved run's config) <- config file <- --set overrides, in that order. The config file is TOML
    (`[model]`, `[data]`, `[train]`, `[monitor]`, `[dist]`; what `pretrain --print-config` prints) or a run's run_config.json
    (which then replaces the preset)."""
    sections: dict[str, dict[str, Any]] = {"model": {}, "data": {}, "train": {}, "monitor": {}, "dist": {}}
    if toml_path is not None and Path(toml_path).suffix == ".json":  # a run's own run_config.json
        if not Path(toml_path).is_file():
            raise FileNotFoundError(f"{toml_path}: config file not found")
        base, toml_path = RunConfig.load(toml_path), None
    if toml_path is not None:
        path = Path(toml_path)
        for section, values in read_toml(path).items():
            if section not in sections or not isinstance(values, dict):
                raise ValueError(f"{path}: unknown section [{section}]; expected [model], [data], [train], [monitor], "
                                 f"[dist]")
            sections[section].update(values)
    for text in overrides:
        section, name, value = parse_override(text)
        if section not in sections:
            raise ValueError(f"--set {text!r}: unknown section {section!r}; expected model, data, train, monitor or "
                             f"dist")
        sections[section][name] = value

    run = base or RunConfig(model=preset(base_preset))
    model_hints = typing.get_type_hints(ModelConfig)
    unknown = sorted(set(sections["model"]) - set(model_hints))
    if unknown:
        raise ValueError(f"unknown model fields {unknown}")
    model_changes = {k: _coerce(v, model_hints[k], f"model.{k}") for k, v in sections["model"].items()}
    data = _build(DataConfig, {**_plain(run.data), **sections["data"]}, "data")
    train = _build(TrainConfig, {**_plain(run.train), **sections["train"]}, "train")
    train.validate()
    monitor = _build(MonitorConfig, {**_plain(run.monitor), **sections["monitor"]}, "monitor")
    monitor.validate()
    dist = _build(DistConfig, {**_plain(run.dist), **sections["dist"]}, "dist")
    dist.validate()
    return RunConfig(model=run.model.replace(**model_changes), data=data, train=train, monitor=monitor, dist=dist)
