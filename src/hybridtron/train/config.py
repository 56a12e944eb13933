"""Run configuration: what a run is given (its inputs: `--model`, `--data`, ...), its model (`[model]`), and its
sections of settings (`[data]`, `[train]`, `[monitor]`, `[dist]`, and a command's own: `[sft]`, `[grpo]`, ...).

Every section is a frozen, keyword-only dataclass whose fields carry their defaults and, in a trailing comment, what
they mean (`--print-config` writes those comments into the TOML). A run's configuration is itself a frozen dataclass
of inputs, `model: ModelConfig` and sections (`SectionedConfig`): it is saved as run_config.json, read back by
`--config` and `--resume`, printed as TOML, and changed by a TOML file and `--set SECTION.FIELD=VALUE` overrides,
each value parsed by the type of the field it names; an unknown section or field is an error that lists what
exists. Pretraining's is `RunConfig` below; the post-training commands declare theirs beside their code.

What `--resume` may change: each section names the fields it lets a resumed run change (`RESUMABLE`: a tuple of
names, or ALL); any other difference from the run's saved configuration, [model] included, is refused, naming the
field and both values (`resume_changes`).
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
from typing import Any, ClassVar

from hybridtron.config import ModelConfig, preset
from hybridtron.data import DataConfig
from hybridtron.distributed.config import DistConfig
from hybridtron.files import atomic_write_json
from hybridtron.train.monitor.config import MonitorConfig

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ALL = "all"  # RESUMABLE: every field of the section may change on resume
OPTIMIZERS = ("adamw", "adamh", "muonh", "muon")  # train.optimizer (hybridtron.train.optimizers)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    # the schedule: warmup-stable-decay (hybridtron.train.schedule)
    steps: int = 400  # optimizer steps
    lr: float = 3e-3  # peak learning rate
    min_lr_ratio: float = 0.0  # the decay ends at lr * min_lr_ratio
    warmup_steps: int = 40  # linear warmup, in steps (a run shorter than this never reaches the peak: a warning)
    decay_fraction: float = 0.3  # the last share of the run's steps decays linearly (a fraction of train.steps)
    # the optimizer step
    grad_accum: int = 1  # micro-batches per optimizer step (gradients summed in fp32)
    optimizer: str = "adamw"  # adamw | adamh | muonh | muon: the matrices' update rule (docs/pretraining.md)
    adam_lr: float | None = None  # adamh/muonh/muon: peak LR of the tensors left to AdamW; none = train.lr
    momentum: float = 0.95  # muon/muonh: Nesterov momentum
    weight_decay: float = 0.1  # AdamW's, on every weight of 2 or more dimensions (not on norms and biases)
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.95  # AdamW's second-moment decay
    eps: float = 1e-8  # AdamW's epsilon
    grad_clip: float = 1.0  # max global gradient L2 norm (0 = off)
    # number formats
    precision: str = "fp32"  # fp32 | bf16 (autocast) | nvfp4 | mxfp8 (emulated, by the precision policy)
    precision_policy: str = "ultra"  # nvfp4/mxfp8: "ultra" (Nemotron 3 Ultra's mixed policy) or "all" (ablation)
    nvfp4_stochastic_rounding: bool = True  # nvfp4 ablation switches: SR on gradients,
    nvfp4_rht: bool = True  # the Random Hadamard Transform on wgrad operands,
    nvfp4_2d_weights: bool = True  # 16x16 weight blocks
    grad_accum_dtype: str = "fp32"  # dtype of the output layer's gradient accumulation across micro-batches
    # losses and balancing
    mtp_loss_weight: float | None = None  # None: the model config's (0.1 in total over the depths)
    router_bias_rate: float = 1e-3  # aux-loss-free balancing: b_i += u * sign(mean load - load_i) every step
    maxvio_window: int = 20  # steps over which MaxVio counts expert loads
    # evaluation, logging, checkpoints
    val_every: int = 50  # held-out validation loss every N steps (and at step 0 and the end)
    log_every: int = 1  # a metrics.jsonl line every N steps (and on every step with an event or an evaluation)
    checkpoint_every: int = 100  # a DCP checkpoint every N steps (written in the background)
    keep_checkpoints: int = 3  # keep the last K checkpoints
    # the process
    seed: int = 0  # model initialization and the stochastic-rounding streams (the data order: data.seed)
    threads: int = 0  # torch intra-op threads; 0 = torch's default
    compile: bool = False  # torch.compile every block in place and the loss; fused AdamW (in one process)
    compile_cache: str | None = None  # torch.compile's on-disk caches in this directory, shared by runs and ranks
    #   (hybridtron.ops.compile_cache); none = torch's default (/tmp/torchinductor_$USER)
    recompute: str = "none"  # activation checkpointing per block: none | selective | full

    # A resumed run may change the schedule (a longer run, another LR), the optimizer's hyperparameters, the
    # balancing rate, the cadence of evaluation, logging and checkpoints, and how the process runs. The batch
    # (grad_accum), the number formats and the seed define the run: a change there is a new run (or a branch).
    # The optimizer itself (train.optimizer) defines the run: its state does not carry over to another one.
    RESUMABLE: ClassVar = ("steps", "lr", "min_lr_ratio", "warmup_steps", "decay_fraction", "weight_decay", "beta1",
                           "beta2", "eps", "adam_lr", "momentum", "grad_clip", "mtp_loss_weight", "router_bias_rate",
                           "maxvio_window",
                           "val_every", "log_every", "checkpoint_every", "keep_checkpoints", "threads", "compile",
                           "compile_cache", "recompute")

    def validate(self) -> None:
        for name in ("steps", "grad_accum", "val_every", "log_every",
                     "checkpoint_every", "keep_checkpoints", "maxvio_window"):
            if getattr(self, name) <= 0:
                raise ValueError(f"train.{name} must be positive, got {getattr(self, name)}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"train.lr must be a positive finite number, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"train.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.decay_fraction <= 1:
            raise ValueError(f"train.decay_fraction must be in [0, 1], got {self.decay_fraction}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"train.optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.adam_lr is not None and not (self.adam_lr > 0 and math.isfinite(self.adam_lr)):
            raise ValueError(f"train.adam_lr must be a positive finite number or none, got {self.adam_lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"train.momentum must be in [0, 1), got {self.momentum}")
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

    def schedule_warnings(self) -> list[str]:
        """What a run of this schedule will not do that the user may expect: a warmup longer than the run (the LR
        never reaches its peak), a decay that is empty."""
        warnings = []
        if self.warmup_steps >= self.steps:
            warnings.append(f"train.warmup_steps={self.warmup_steps} >= train.steps={self.steps}: the LR never "
                            f"reaches its peak {self.lr:g} (it ends at {self.lr * self.steps / max(self.warmup_steps, 1):.3g})")
        decay_steps = round(self.decay_fraction * self.steps)
        if self.decay_fraction > 0 and decay_steps == 0:
            warnings.append(f"train.decay_fraction={self.decay_fraction:g} of {self.steps} steps rounds to no decay "
                            f"step: the LR stays at its peak to the end")
        elif decay_steps and self.steps - decay_steps < self.warmup_steps < self.steps:
            warnings.append(f"the decay (the last {decay_steps} of {self.steps} steps, train.decay_fraction="
                            f"{self.decay_fraction:g}) begins before the {self.warmup_steps}-step warmup ends")
        return warnings


class SectionedConfig:
    """A run's configuration: a frozen dataclass of inputs (plain values: a checkpoint directory, a data source),
    `model: ModelConfig` and sections (frozen dataclasses). `MODEL_FROM` names the input whose checkpoint fixes
    [model] (a fine-tuning run trains the weights it is given, not another architecture); None: [model] is a
    section like the others (pretraining: a preset, then the TOML file and --set)."""

    MODEL_FROM: ClassVar[str | None] = None

    def fixed_section(self, name: str) -> str | None:
        """Why the section `name` cannot be set (a TOML file or --set): None where it can, or is not one."""
        if name == "model" and self.MODEL_FROM is not None:
            return (f"[model] cannot be set here: the model is fixed by {self.MODEL_FROM} "
                    f"({getattr(self, self.MODEL_FROM)}/config.json); this run trains its weights, not another "
                    f"architecture")
        return None

    def sections(self) -> dict[str, Any]:
        """Section name -> its dataclass, in field order ([model] included when it is a section)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if dataclasses.is_dataclass(getattr(self, f.name))
                and (f.name != "model" or self.MODEL_FROM is None)}

    def inputs(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if not dataclasses.is_dataclass(getattr(self, f.name))}

    def to_dict(self) -> dict:
        return {**{name: (dict(value) if isinstance(value, dict) else value) for name, value in self.inputs().items()},
                "model": self.model.to_hf(),
                **{name: section_values(section) for name, section in self.sections().items() if name != "model"}}

    def save(self, path: str | Path) -> None:
        atomic_write_json(path, self.to_dict())

    def command_line(self) -> str:
        """The command's inputs as flags, for the TOML header (commands override it)."""
        return ""

    def to_toml(self) -> str:
        """The sections as a TOML file that `--config` reads back to the same values, every field with the comment
        its dataclass gives it."""
        header = [TOML_HEADER]
        if self.command_line():
            header.append(f"# {self.command_line()}")
        if self.MODEL_FROM is not None:
            header.append(f"# [model] is {getattr(self, self.MODEL_FROM)}/config.json, fixed by its flag")
        return "\n".join(header + [""] + [line for name, section in self.sections().items()
                                           for line in section_toml(name, section) + [""]])

    @classmethod
    def load(cls, path: str | Path):
        """A run_config.json back into the configuration; a ValueError naming the file and what is missing or
        unknown."""
        try:
            raw = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
        hints = typing.get_type_hints(cls)
        values, missing = {}, []
        for f in dataclasses.fields(cls):
            has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            if f.name not in raw:
                if not has_default:
                    missing.append(f.name)
                continue
            hint = hints[f.name]
            if hint is ModelConfig:
                values[f.name] = ModelConfig.from_hf(raw[f.name])
            elif dataclasses.is_dataclass(hint):
                # a field added since: the run was saved without it, so it ran with the value the section names
                values[f.name] = build_section(hint, {**getattr(hint, "SAVED_WITHOUT", {}), **raw[f.name]}, f.name)
            else:
                values[f.name] = raw[f.name]
        if missing:
            raise ValueError(f"{path}: not a run config of this command (it has no {', '.join(missing)}): the run was "
                             f"made by another command")
        return cls(**values)


@dataclass(frozen=True, kw_only=True)
class RunConfig(SectionedConfig):
    """Pretraining's configuration (`hybridtron pretrain`): every section settable, [model] from --preset."""

    model: ModelConfig = field(default_factory=lambda: preset("tiny"))
    data: DataConfig = field(default_factory=lambda: DataConfig(seq_len=256, batch_size=8))  # batch shape here
    train: TrainConfig = field(default_factory=TrainConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    dist: DistConfig = field(default_factory=DistConfig)  # the parallel layout under torchrun


TOML_HEADER = """\
# A hybridtron run configuration (`--print-config` writes it; `--config FILE` reads it).
# Every field may be left out: it then keeps the base configuration's value (the preset's, the command's defaults).
# "none" stands for an unset optional field (TOML has no null)."""


def section_toml(name: str, obj) -> list[str]:
    """The lines of one `[name]` section: each field of the dataclass `obj` as `field = value  # its comment`,
    under the group comments of its source."""
    comments = field_comments(type(obj))
    lines = [f"[{name}]"]
    for f in dataclasses.fields(obj):
        headers, comment = comments.get(f.name, ((), ""))
        lines += [f"# {header}" for header in headers]
        line = f"{f.name} = {toml_value(getattr(obj, f.name))}"
        lines.append(f"{line}  # {comment}" if comment else line)
    return lines


@functools.cache
def field_comments(cls) -> dict[str, tuple[tuple[str, ...], str]]:
    """Per field of a dataclass, read from its source and its dataclass bases' (a field declared in a base, such as
    the shared rollout settings of GRPO's and MOPD's sections, keeps its comment): (the group comments on their own
    lines just above it, its trailing comment, continued by the own-line comments below it that start with `#` and
    two or more spaces). Empty where the source cannot be read."""
    found: dict[str, tuple[tuple[str, ...], str]] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            found.update(_own_field_comments(klass))
    return found


def _own_field_comments(cls) -> dict[str, tuple[tuple[str, ...], str]]:
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


def toml_value(value) -> str:
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
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__}")


def section_values(obj) -> dict:
    """A section's fields as plain values (tuples as lists: what JSON and TOML hold)."""
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


def build_section(cls, values: dict, section: str):
    """The section `cls` from plain values (a TOML table, a run_config.json entry, override strings), each
    converted to its field's type; an unknown field is a ValueError listing the known ones."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown {section} fields {unknown}; known: {', '.join(sorted(known))}")
    hints = typing.get_type_hints(cls)
    return cls(**{k: coerce_value(v, hints[k], f"{section}.{k}") for k, v in values.items()})


def coerce_value(value: Any, hint, name: str):
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
                return coerce_value(value, arg, name)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError(errors[0] if errors else f"{name}: cannot parse {value!r}")
    if origin is tuple:
        items = value if isinstance(value, (list, tuple)) else [v for v in str(value).split(",") if v]
        inner = args[0] if args else str
        return tuple(coerce_value(v, inner, name) for v in items)
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
    """`--set SECTION.FIELD=VALUE` -> (section, field, value text)."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ValueError(f"--set {text!r}: expected SECTION.FIELD=VALUE, e.g. train.lr=3e-4")
    key, value = text.split("=", 1)
    section, name = key.split(".", 1)
    return section.strip(), name.strip(), value.strip()


# ------------------------------------------------------------------------------------ changing a configuration
def change_config(config: SectionedConfig, toml_path: str | Path | None = None, overrides: list[str] = ()):
    """`config` with a TOML file's sections, then `--set SECTION.FIELD=VALUE` overrides, applied; each changed
    section rebuilt field by field and validated (`validate()`). Setting a section the configuration fixes
    (`fixed_section`: [model] where a checkpoint gives it) is an error that says what fixes it."""
    sections = config.sections()
    names = ", ".join(f"[{name}]" for name in sections)
    changes: dict[str, dict[str, Any]] = {name: {} for name in sections}

    def refuse_fixed(where: str, section: str) -> None:
        reason = config.fixed_section(section)
        if reason is not None:
            raise ValueError(f"{where}: {reason}")

    if toml_path is not None:
        for section, values in read_toml(toml_path).items():
            if values:
                refuse_fixed(str(toml_path), section)
            if section == "model" and "model" not in sections:  # an empty [model]: what to_toml writes for it
                continue
            if section not in sections or not isinstance(values, dict):
                raise ValueError(f"{toml_path}: unknown section [{section}]; expected {names}")
            changes[section].update(values)
    for text in overrides:
        section, name, value = parse_override(text)
        refuse_fixed(f"--set {text!r}", section)
        if section not in sections:
            raise ValueError(f"--set {text!r}: unknown section {section!r}; expected one of "
                             f"{', '.join(sections)}")
        changes[section][name] = value
    updated = {}
    for section, values in changes.items():
        if not values:
            continue
        obj = sections[section]
        if isinstance(obj, ModelConfig):  # its fields are checked by ModelConfig itself
            hints = typing.get_type_hints(ModelConfig)
            unknown = sorted(set(values) - set(hints))
            if unknown:
                raise ValueError(f"unknown model fields {unknown}")
            updated[section] = obj.replace(**{k: coerce_value(v, hints[k], f"model.{k}") for k, v in values.items()})
            continue
        updated[section] = build_section(type(obj), {**section_values(obj), **values}, section)
        if hasattr(updated[section], "validate"):
            updated[section].validate()
    return dataclasses.replace(config, **updated)


@dataclass(frozen=True)
class Change:
    """One field that differs between a run's saved configuration and the one given on resume."""

    key: str  # section.field
    saved: Any
    given: Any

    def __str__(self) -> str:
        return f"{self.key} {self.saved!r} -> {self.given!r}"


def config_changes(saved: SectionedConfig, given: SectionedConfig) -> list[Change]:
    """Every field, [model] and inputs included, whose value differs between two configurations of one command."""
    found = []
    for name, value in saved.inputs().items():
        if value != getattr(given, name):
            found.append(Change(name, value, getattr(given, name)))
    pairs = [("model", saved.model, given.model)] + [(name, section, getattr(given, name))
                                                      for name, section in saved.sections().items()
                                                      if name != "model"]
    for name, old, new in pairs:
        for f in dataclasses.fields(old):
            if getattr(old, f.name) != getattr(new, f.name):
                found.append(Change(f"{name}.{f.name}", getattr(old, f.name), getattr(new, f.name)))
    return found


def resume_changes(saved: SectionedConfig, given: SectionedConfig) -> tuple[list[Change], list[Change]]:
    """(the changes a resumed run applies, the changes it refuses): a section's field is applied when the section
    lists it in `RESUMABLE` (or RESUMABLE is ALL); [model] and the inputs never change."""
    applied, refused = [], []
    sections = saved.sections()
    for change in config_changes(saved, given):
        section, _, name = change.key.partition(".")
        resumable = getattr(type(sections[section]), "RESUMABLE", ()) if section in sections and section != "model" \
            else ()
        (applied if resumable == ALL or name in resumable else refused).append(change)
    return applied, refused
