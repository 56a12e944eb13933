"""The pipeline's configuration (`hybridtron pipeline --print-config` writes it as TOML; `--config FILE` reads one
back; `--set STAGE.FIELD=VALUE` changes one field): `[pipeline]` (model preset, torch threads, the environments'
levels), `[eval]` (what every stage's model is measured on), and a section per stage with `enabled`, `steps`, its
data fields and, as sub-tables, its command's settings (`[rlvr.grpo] group_size = 8` is `hybridtron grpo --set
grpo.group_size=8`; `--set rlvr.grpo.group_size=8` on the pipeline's command line). Presets: `tiny` (the real run,
sized for 2 CPU cores) and `micro` (CI)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridtron.train.config import read_toml, section_values


@dataclass(frozen=True, kw_only=True)
class StageConfig:
    """A stage's section: `enabled`, `steps`, `data` (the fields of its data writer, e.g. the SFT stage's
    `code_examples`: hybridtron.recipe.stage) and `settings`, typed values of its command's configuration by
    `SECTION.FIELD` (each checked against the field it names when it is given: hybridtron.recipe.stages), in the
    order they were given (a field given again keeps its place), the `--set` overrides of the stage's command line."""

    enabled: bool = True
    steps: int = 1
    data: dict[str, int] = dataclasses.field(default_factory=dict)
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class PipelineSection:
    """`[pipeline]`: the pipeline preset the rest of the configuration was resolved from (a file's values are
    changes to it), the model preset pretraining starts from (or `base_model`, an HF checkpoint with tokenizer
    files that replaces the pretrain stage), torch threads of every stage, and the levels of the tasks every stage
    trains and is evaluated on: the math and code difficulty levels, and the terminal environment's task kinds (1:
    count the files with errors, 2: the function called most, ...: hybridtron.envs.terminal)."""

    preset: str = "tiny"  # tiny or micro: PRESET_SECTIONS, and each stage's `presets`
    model_preset: str = "tiny"
    base_model: str = ""  # a pretrained checkpoint directory to start from instead of pretraining ("" = pretrain)
    threads: int = 1  # intra-op threads of every stage; tiny: 2 (on a shared or busy CPU, 2 ran 10x slower than 1)
    levels: tuple[int, ...] = (1, 2)


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """`[eval]`: what every stage's model is measured on (held-out test splits, greedy decoding)."""

    math_tasks: int = 600  # one standard error ~1.6 points at 20% (60 and 200 tasks left comparisons within noise)
    code_tasks: int = 18  # every test-split code task of levels 1-2 (the code environment has 18 of them, 268 train)
    max_tokens: int = 80  # math completion cap (a column-style trace is up to 62 tokens)
    code_max_tokens: int = 96
    agentic_tasks: int = 50  # held-out terminal tasks, each a trajectory through the turn loop with the bash tool
    agentic_max_tokens: int = 128  # a terminal turn's cap (a bash call is 35-101 tokens); the trajectory's: the context
    batch_size: int = 50
    val_conversations: int = 36  # held-out math + code tasks (half each) whose reference turns the loss is on
    acceptance_prompts: int = 32  # evaluation prompts (half math, half code) decoded speculatively (8 were noise)
    acceptance_tokens: int = 48
    draft_length: int = 3
    seed: int = 0

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "seed" and value < 1:
                raise ValueError(f"eval.{f.name} must be >= 1, got {value}")


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    pipeline: PipelineSection
    eval: EvalConfig
    stages: dict[str, StageConfig]

    def to_dict(self) -> dict:
        return {"pipeline": section_values(self.pipeline), "eval": section_values(self.eval),
                **{name: stage_dict(stage) for name, stage in self.stages.items()}}


def stage_dict(stage: StageConfig) -> dict:
    return {"enabled": stage.enabled, "steps": stage.steps, **stage.data,
            "settings": [f"{key}={setting_text(value)}" for key, value in stage.settings.items()]}


def setting_text(value) -> str:
    """A typed value as the text of a `--set` override (what the command's --set parses back to the same value).
    A whole float is written as an integer (`0`, not `0.0`), as the presets spelt them before they were typed, so
    that their command lines and the fingerprints made of them stay the same."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    if isinstance(value, (list, tuple)):
        return ",".join(setting_text(v) for v in value)
    return str(value)


PRESET_SECTIONS = {
    "tiny": (PipelineSection(threads=2), EvalConfig()),
    "micro": (PipelineSection(levels=(1,)),
              EvalConfig(math_tasks=4, code_tasks=2, agentic_tasks=2, max_tokens=8, code_max_tokens=8,
                         agentic_max_tokens=8, batch_size=4,
                         val_conversations=4, acceptance_prompts=2, acceptance_tokens=6, draft_length=2)),
}


def read_pipeline_toml(path: str | Path) -> dict[str, dict[str, Any]]:
    """A pipeline TOML file as section -> field -> value, the `[STAGE.SECTION]` tables flattened to
    `SECTION.FIELD` keys of their stage."""
    path = Path(path)
    raw = read_toml(path)
    changes: dict[str, dict[str, Any]] = {}
    for name, values in raw.items():
        if not isinstance(values, dict):
            raise ValueError(f"{path}: {name} = ... outside a section; expected [pipeline], [eval] or [STAGE] tables")
        flat = changes.setdefault(name, {})
        for key, value in values.items():
            if isinstance(value, dict):  # [STAGE.SECTION]
                if name in ("pipeline", "eval"):
                    raise ValueError(f"{path}: [{name}.{key}]: only stages have sub-tables")
                flat.update({f"{key}.{k}": v for k, v in value.items()})
            else:
                flat[key] = value
    return changes


def parse_set(texts: list[str]) -> dict[str, dict[str, Any]]:
    """`--set STAGE.FIELD=VALUE` / `--set STAGE.SECTION.FIELD=VALUE` / `--set eval.FIELD=VALUE` as changes."""
    changes: dict[str, dict[str, Any]] = {}
    for text in texts:
        key, sep, value = text.partition("=")
        if not sep or "." not in key:
            raise ValueError(f"--set {text!r}: expected STAGE.FIELD=VALUE or STAGE.SECTION.FIELD=VALUE, e.g. "
                             f"rlvr.steps=40 or rlvr.grpo.group_size=8")
        section, _, name = key.strip().partition(".")
        changes.setdefault(section, {})[name] = value.strip()
    return changes


