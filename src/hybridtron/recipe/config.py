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

from hybridtron.train.config import build_section, read_toml, section_values

# the SFT stages whose data the pipeline writes, and the fields of their sections that say what it is
DATA_STAGES = {"sft": ("code_examples",), "mopd_warmup": ("math_examples", "code_examples", "teacher_samples")}


@dataclass(frozen=True, kw_only=True)
class StageConfig:
    """A stage's section: `enabled`, `steps`, the data fields of the DATA_STAGES (sft: `code_examples`, code worked
    solutions mixed into the math ones, 0 for math alone; mopd_warmup: `math_examples` and `code_examples`, training
    tasks of each teacher domain, and `teacher_samples`, each teacher's tries at each task, the first one its
    environment scores 1 kept, 0 for the tasks' worked solutions, the teachers' SFT data), and `settings`, the
    `SECTION.FIELD=VALUE` overrides of its command's configuration (kept as text, applied as `--set` applies them,
    each parsed by the type of the field it names)."""

    enabled: bool = True
    steps: int = 1
    math_examples: int = 0
    code_examples: int = 0
    teacher_samples: int = 0
    settings: tuple[str, ...] = ()

    def setting(self, key: str) -> str | None:
        """The value of `SECTION.FIELD` in `settings` (the last one given), or None."""
        found = None
        for text in self.settings:
            name, _, value = text.partition("=")
            if name == key:
                found = value
        return found


@dataclass(frozen=True, kw_only=True)
class PipelineSection:
    """`[pipeline]`: the pipeline preset the rest of the configuration was resolved from (a file's values are
    changes to it), the model preset pretraining starts from (or `base_model`, an HF checkpoint with tokenizer
    files that replaces the pretrain stage), torch threads of every stage, and the difficulty levels of the math and
    code tasks every stage trains and is evaluated on."""

    preset: str = "tiny"  # tiny or micro: PRESET_STAGES
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
    return {"enabled": stage.enabled, "steps": stage.steps, "math_examples": stage.math_examples,
            "code_examples": stage.code_examples, "teacher_samples": stage.teacher_samples,
            "settings": list(stage.settings)}


def settings_tables(settings) -> dict[str, dict[str, str]]:
    tables: dict[str, dict[str, str]] = {}
    for text in settings:
        key, _, value = text.partition("=")
        section, _, name = key.partition(".")
        tables.setdefault(section, {})[name] = value
    return tables


def setting_value(text: str):
    """A setting's text as the TOML value it most likely was: a bool, int, float, list of ints, or a string."""
    if text in ("true", "false"):
        return text == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    parts = text.split(",")
    if len(parts) > 1 and all(p.strip().lstrip("-").isdigit() for p in parts):
        return [int(p) for p in parts]
    return text


def setting_text(value) -> str:
    """A TOML value as the text of a `--set` override."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(setting_text(v) for v in value)
    return str(value)


def merge_settings(settings, changes) -> tuple[str, ...]:
    """`settings` with `changes` applied (both `SECTION.FIELD=VALUE` texts): a field given again takes the new
    value in its old place, and every value is written one way (`5e-4` and `0.0005` alike), so that the same
    configuration, however it was given, makes the same command line."""
    merged: dict[str, str] = {}
    for text in (*settings, *changes):
        key, _, value = text.partition("=")
        merged[key.strip()] = setting_text(setting_value(value.strip()))
    return tuple(f"{key}={value}" for key, value in merged.items())


def _stage(steps: int, *settings: str, enabled: bool = True, **data: int) -> StageConfig:
    return StageConfig(enabled=enabled, steps=steps, settings=merge_settings((), settings), **data)


# The tiny preset's GRPO: issue 12's working run (BENCHMARKS.md, "GRPO at rollout temperature 0.5"): 8 completions
# of 32 prompts a step sampled at T = 0.5, prompts drawn uniformly, lr 1e-4, short completions, no MTP drafts in the
# rollouts and no MTP loss (MTP boosting retrains the drafter at the end), the stage evaluation instead of GRPO's own.
_GRPO = ("grpo.group_size=8", "grpo.prompts_per_step=32", "grpo.temperature=0.5", "grpo.curriculum=false",
         "grpo.max_new_tokens=64", "grpo.speculative=false", "grpo.mtp_loss_weight=0", "grpo.eval_tasks=0",
         "train.lr=1e-4", "train.checkpoint_every=10")

# MOPD: 64 prompts a step (one completion each) at T = 0.5 and lr 2e-4 (docs/LOG.md, session 7, math prompts alone:
# 128 a step at lr 1e-4 won back 39% of a math teacher's lead in 30 steps, 32 a step at 2e-4 66% in 120; 5e-4 broke
# the student), on the reverse KL over each teacher's top 16 tokens, three quarters of the prompts math: against the
# report's sampled estimator it took two iterations from 19% / 30% to 49% / 74% of the math / code leads (session 9)
_MOPD = ("mopd.prompts_per_step=64", "mopd.temperature=0.5", "mopd.max_new_tokens=64", "mopd.speculative=false",
         "mopd.mtp_loss_weight=0", "mopd.task_pool=400", "train.lr=2e-4", "train.checkpoint_every=5",
         "mopd.kl_top_k=16", "mopd.domain_weights=0.75,0.25")
_MICRO_GRPO = ("grpo.group_size=2", "grpo.prompts_per_step=2", "grpo.task_pool=8", "grpo.max_new_tokens=6",
               "grpo.speculative=false", "grpo.max_refill_rounds=0", "grpo.eval_tasks=0", "grpo.mtp_loss_weight=0",
               "train.grad_accum=1")
_MICRO_MOPD = ("mopd.prompts_per_step=4", "mopd.max_new_tokens=6", "mopd.speculative=false", "mopd.task_pool=8",
               "train.grad_accum=1", "mopd.kl_top_k=4")

# the micro model: tests/conftest.py's small config (every layer kind, LatentMoE, MTP) at 512 tokens
_MICRO_MODEL = tuple(f"model.{k}={v}" for k, v in dict(
    hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=12, intermediate_size=64,
    mamba_num_heads=4, mamba_head_dim=8, n_groups=2, ssm_state_size=8, chunk_size=8, num_experts_per_tok=3,
    moe_intermediate_size=24, moe_shared_expert_intermediate_size=32, moe_latent_size=16, n_group=4).items())

PRESET_STAGES: dict[str, dict[str, StageConfig]] = {
    # the real run, sized for 2 CPU cores (BENCHMARKS.md, issue 13): SFT on the math worked solutions and every
    # level 1-2 code training task's (268), RLVR and the math teacher at issue 12's working GRPO (50 steps each)
    "tiny": {
        "pretrain": _stage(150, "train.val_every=50", "train.checkpoint_every=50"),
        "sft": _stage(800, "sft.train_on_thinking=true", "train.val_every=50", "train.checkpoint_every=50",
                      code_examples=268),
        "rlvr": _stage(50, *_GRPO),
        # the math teacher is specialised like the code teacher, by SFT on its domain alone, then RLVR: from the
        # multi-domain student, 50 more GRPO steps did not raise math (23.7% -> 23.0%: docs/LOG.md, session 7)
        "math_teacher_sft": _stage(200, "sft.train_on_thinking=true", "train.val_every=50",
                                   "train.checkpoint_every=50"),
        "math_teacher": _stage(50, *_GRPO),
        "code_teacher": _stage(100, "sft.train_on_thinking=true", "sft.env_examples=250", "train.val_every=50",
                               "train.checkpoint_every=50"),
        "code_teacher_rl": _stage(10, *_GRPO, enabled=False),
        # the warmup as long as the code teacher's own SFT (shorter ones left the student with no passing code:
        # docs/LOG.md, session 5), at lr 5e-4 (at 2e-3 it took the RLVR student's math from 44.5% to 4.8%: session
        # 7), on each teacher's verified answers, best of 4: the worked solutions cost the student more math and
        # taught it less code, and of the warmups tried only one with ~400 math answers raised math (session 8)
        "mopd_warmup": _stage(100, "sft.train_on_thinking=true", "train.lr=5e-4", "train.val_every=20",
                              "train.checkpoint_every=20", math_examples=600, code_examples=200, teacher_samples=4),
        "mopd_1": _stage(40, *_MOPD),
        "mopd_2": _stage(40, *_MOPD),
        "mopd_no_warmup": _stage(40, *_MOPD),
        "mtp_boost": _stage(30, "boost.num_samples=64", "boost.sample_length=48", "boost.draft_length=3"),
    },
    # CI: every stage for a step or two on a 512-token vocabulary and a few stdlib families
    "micro": {
        "pretrain": _stage(2, "data.families=json,text,functional", "data.seq_len=64", "data.batch_size=4",
                           "data.vocab_size=512", "model.vocab_size=512", "model.max_position_embeddings=512",
                           *_MICRO_MODEL,
                           "data.val_batches=1", "train.warmup_steps=1", "train.val_every=2"),
        "sft": _stage(2, "sft.train_on_thinking=true", "sft.env_examples=40", "sft.seq_len=256", "sft.batch_size=1",
                      "sft.val_batches=1", "train.val_every=2", code_examples=4),
        "rlvr": _stage(1, *_MICRO_GRPO),
        "math_teacher_sft": _stage(2, "sft.train_on_thinking=true", "sft.env_examples=40", "sft.seq_len=256",
                                   "sft.batch_size=1", "sft.val_batches=1", "train.val_every=2"),
        "math_teacher": _stage(1, *_MICRO_GRPO),
        "code_teacher": _stage(2, "sft.train_on_thinking=true", "sft.env_examples=40", "sft.seq_len=256",
                               "sft.batch_size=1", "sft.val_batches=1", "train.val_every=2"),
        "code_teacher_rl": _stage(1, *_MICRO_GRPO, enabled=False),
        "mopd_warmup": _stage(2, "sft.train_on_thinking=true", "sft.seq_len=256", "sft.batch_size=1",
                              "sft.val_batches=1", "train.val_every=2", math_examples=20, code_examples=20),
        "mopd_1": _stage(1, *_MICRO_MOPD),
        "mopd_2": _stage(1, *_MICRO_MOPD),
        "mopd_no_warmup": _stage(1, *_MICRO_MOPD),
        "mtp_boost": _stage(2, "boost.num_samples=4", "boost.sample_length=8", "boost.batch_size=2",
                            "boost.depths=2", "boost.draft_length=2"),
    },
}
PRESET_SECTIONS = {
    "tiny": (PipelineSection(threads=2), EvalConfig()),
    "micro": (PipelineSection(levels=(1,)),
              EvalConfig(math_tasks=4, code_tasks=2, max_tokens=8, code_max_tokens=8, batch_size=4,
                         val_conversations=4, acceptance_prompts=2, acceptance_tokens=6, draft_length=2)),
}


def preset_config(name: str) -> PipelineConfig:
    if name not in PRESET_STAGES:
        raise ValueError(f"--preset {name}: unknown pipeline preset; expected one of {', '.join(PRESET_STAGES)}")
    pipeline, evaluation = PRESET_SECTIONS[name]
    return PipelineConfig(pipeline=dataclasses.replace(pipeline, preset=name), eval=evaluation,
                          stages=dict(PRESET_STAGES[name]))


def apply_changes(config: PipelineConfig, changes: dict[str, dict[str, Any]], where: str) -> PipelineConfig:
    """`changes` (section -> field -> value; stage settings as `SECTION.FIELD` keys) applied to `config`, each
    field checked by its type. `where` names the source (a file, or --set) in errors."""
    sections = {"pipeline": config.pipeline, "eval": config.eval}
    stages = dict(config.stages)
    for name, values in changes.items():
        if name in sections:
            sections[name] = build_section(type(sections[name]), {**section_values(sections[name]), **values}, name)
            continue
        if name not in stages:
            raise ValueError(f"{where}: unknown section [{name}]; expected [pipeline], [eval] or a stage: "
                             f"{', '.join(stages)}")
        stage = stages[name]
        plain = {k: v for k, v in values.items() if "." not in k}
        settings = [f"{k}={setting_text(v)}" for k, v in values.items() if "." in k]
        fields = ("enabled", "steps", *DATA_STAGES.get(name, ()))
        unknown = sorted(set(plain) - set(fields))
        if unknown:
            raise ValueError(f"{where}: [{name}] has no field(s) {unknown}; this stage has {', '.join(fields)} and "
                             f"[{name}.SECTION] tables of its command's settings")
        merged = build_section(StageConfig, {**stage_dict(stage), **plain,
                                      "settings": list(merge_settings(stage.settings, settings))}, name)
        stages[name] = merged
    return PipelineConfig(pipeline=sections["pipeline"], eval=sections["eval"], stages=stages)


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


