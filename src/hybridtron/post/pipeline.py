"""`hybridtron pipeline`: Nemotron 3 Ultra's training recipe end to end, from pretraining to MTP boosting, in one
resumable command.

The stages, in order, each a run directory `OUT/<stage>/` made by the stage's own command (its `run(args)`, with the
options the command line would give) and holding that command's HF export in `hf/`:

    pretrain         hybridtron pretrain --preset P                        the base model
    sft              hybridtron sft --model pretrain --data (math + code)  worked solutions, reasoning trained
    rlvr             hybridtron grpo --model sft --env math                the RLVR student
    math_teacher_sft hybridtron sft --model sft --data env:math            math-focused SFT from the same base
    math_teacher     hybridtron grpo --model math_teacher_sft --env math   math RLVR on top (with math_teacher_sft
                                                                           off: the student's RLVR continued)
    code_teacher     hybridtron sft --model sft --data env:code            code-focused SFT from the same base
    code_teacher_rl  hybridtron grpo --model code_teacher --env code       code RLVR on top (off in the presets)
    mopd_warmup      hybridtron sft --model rlvr --data teachers' data     a light SFT on every teacher's domain
    mopd_1           hybridtron mopd --student mopd_warmup --teachers math=math_teacher,code=code_teacher --general rlvr
    mopd_2           hybridtron mopd --student mopd_1 (same panel)         the second iteration
    mopd_no_warmup   hybridtron mopd --student rlvr (same panel, mopd_1's steps)    the ablation without warmup
    mtp_boost        hybridtron mtp-boost --model mopd_2 --prompts (chat prompts of training tasks)   the drafter trained
                     against the final model, on the kind of text its acceptance is measured on

SFT is multi-domain, as the report's is: the math environment's worked solutions (`sft.env_examples`) and
`[sft] code_examples` of the code environment's, written to `OUT/sft/stage_data.jsonl` (`code_examples = 0`: math
alone, `--data env:math`). In a model this small a skill learnt after another overwrites it (docs/LOG.md, session 7):
a student that learns code only in the warmup loses its math there.

The teachers are specialists made from the multi-domain SFT model, each by SFT on its own domain and (for math,
and for code with `code_teacher_rl`) RLVR on top. The warmup is its own stage, an SFT run on each teacher's data,
so that the ablation compares two MOPD runs that differ in their starting point only (the MOPD stages run with
`mopd.warmup_steps = 0`). A teacher's SFT data is here the student's own, so its data for the warmup are its
answers: `[mopd_warmup] math_examples` and `code_examples` training tasks, each answered by its domain's teacher up to
`teacher_samples` times, the first answer the environment scores 1 kept (rejection sampling; `teacher_samples = 0`:
the tasks' worked solutions instead), in `OUT/mopd_warmup/stage_data.jsonl`.

One configuration holds every stage (`--print-config` writes it as TOML; `--config FILE` reads one back;
`--set STAGE.FIELD=VALUE` changes one field): `[pipeline]` (model preset, torch threads, environments' levels),
`[eval]`, and a section per stage with `enabled`, `steps` and, as sub-tables, the settings handed to the stage's
command (`[rlvr.grpo] group_size = 8` is `hybridtron grpo --set grpo.group_size=8`; `--set rlvr.grpo.group_size=8`
on the pipeline's command line). Presets: `tiny` (the real run, sized for 2 CPU cores) and `micro` (CI).
`--base DIR` starts from a pretrained checkpoint of one's own instead of the pretrain stage.

Resumable stage by stage: a finished stage (its `stage.json` written after its command returned and its model was
evaluated) is skipped; a stage that was killed is continued by its command's `--resume` (the DCP checkpoints of
pretrain, sft, grpo and mopd; mtp-boost, a few minutes long and without checkpoints, is rerun). A stage's
fingerprint (its command line and those of the stages it builds on) is kept in `stage.json`: a configuration that
changed a finished stage is refused, naming the stage, rather than mixing the outputs of two configurations.

After every stage its model is evaluated the same way (`[eval]`): greedy pass@1 on held-out (test-split) math tasks
(`hybridtron.post.evaluate.evaluate_env`); the code pass rate (the mean share of hidden unit tests passed) and pass@1
on held-out code tasks; the validation loss, the masked next-token CE of the assistant turns (reasoning included) of
held-out math and code conversations; and the MTP acceptance length of greedy self-speculative decoding on the
evaluation prompts (`hybridtron.post.mtp_boost.training.acceptance_length`). At the end, as in the report's Table 5,
each MOPD stage's recovery per domain, (MOPD - RLVR) / (teacher - RLVR), on math pass@1 and on the code pass rate
(undefined where the teacher is not better than the student). Written to `OUT/pipeline.json`, printed, and drawn in
`OUT/pipeline.html` (the table, the recovery, the goals, and each stage's curves).

This module's top-level imports stay light (the CLI builds its parser from it); torch loads when a stage runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STAGE_FILE = "stage.json"  # written when a stage's command returned and its model was evaluated
EVAL_FILE = "eval.json"
RESULT_FILE = "pipeline.json"
HTML_FILE = "pipeline.html"
BOOST_PROMPTS = "boost_prompts.jsonl"  # mtp_boost's chat prompts (training-split tasks), written before it runs
DATA_FILE = "stage_data.jsonl"  # the conversations of a DATA_STAGES stage, written before it runs
# the SFT stages whose data the pipeline writes, and the fields of their sections that say what it is
DATA_STAGES = {"sft": ("code_examples",), "mopd_warmup": ("math_examples", "code_examples", "teacher_samples")}
TEACHER_TEMPERATURE = 0.5  # the teachers' sampling temperature for the warmup data: the rollouts' (GRPO's, MOPD's)
CODE_DOMAIN, MATH_DOMAIN = "code", "math"


# ============================================================================================ configuration
@dataclass(frozen=True, kw_only=True)
class Stage:
    """One stage: its command and how its command line is made from the configuration and the earlier stages."""

    name: str
    command: str  # the CLI name (hybridtron.cli.COMMANDS)
    module: str
    what: str  # one line for the table and the HTML page


STAGES = (
    Stage(name="pretrain", command="pretrain", module="hybridtron.train.pretrain", what="pretraining"),
    Stage(name="sft", command="sft", module="hybridtron.post.sft", what="SFT on math and code worked solutions"),
    Stage(name="rlvr", command="grpo", module="hybridtron.post.grpo", what="RLVR student (GRPO on math)"),
    Stage(name="math_teacher_sft", command="sft", module="hybridtron.post.sft", what="math teacher (math SFT)"),
    Stage(name="math_teacher", command="grpo", module="hybridtron.post.grpo", what="math teacher (math RLVR)"),
    Stage(name="code_teacher", command="sft", module="hybridtron.post.sft", what="code teacher (code SFT)"),
    Stage(name="code_teacher_rl", command="grpo", module="hybridtron.post.grpo", what="code teacher (code RLVR)"),
    Stage(name="mopd_warmup", command="sft", module="hybridtron.post.sft", what="MOPD warmup (teachers' data)"),
    Stage(name="mopd_1", command="mopd", module="hybridtron.post.mopd", what="MOPD iteration 1"),
    Stage(name="mopd_2", command="mopd", module="hybridtron.post.mopd", what="MOPD iteration 2"),
    Stage(name="mopd_no_warmup", command="mopd", module="hybridtron.post.mopd", what="MOPD without warmup (ablation)"),
    Stage(name="mtp_boost", command="mtp-boost", module="hybridtron.post.mtp_boost", what="MTP boosting"),
)
STAGE_BY_NAME = {stage.name: stage for stage in STAGES}
# mtp-boost takes plain flags, not sections: [mtp_boost.boost] FIELD = VALUE becomes --FIELD VALUE
BOOST_FLAGS = ("lr", "batch_size", "depths", "num_samples", "sample_length", "draft_length", "seed")


@dataclass(frozen=True, kw_only=True)
class StageConfig:
    """A stage's section: `enabled`, `steps`, the data fields of the DATA_STAGES (sft: `code_examples`, code worked
    solutions mixed into the math ones, 0 for math alone; mopd_warmup: `math_examples` and `code_examples`, training
    tasks of each teacher domain, and `teacher_samples`, each teacher's tries at each task, the first one its
    environment scores 1 kept, 0 for the tasks' worked solutions, the teachers' SFT data), and `settings`, the
    `SECTION.FIELD=VALUE` overrides given to its command (kept as text; the command parses them by the type of the
    field they name)."""

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
    """`[pipeline]`: the model preset pretraining starts from (or `base_model`, an HF checkpoint with tokenizer
    files that replaces the pretrain stage), torch threads of every stage, and the difficulty levels of the math and
    code tasks every stage trains and is evaluated on."""

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
        return {"pipeline": _plain(self.pipeline), "eval": _plain(self.eval),
                **{name: stage_dict(stage) for name, stage in self.stages.items()}}

    def to_toml(self) -> str:
        lines = ["# hybridtron pipeline: one section per stage; [STAGE.SECTION] tables are the stage command's --set",
                 ""]
        for name, obj in (("pipeline", self.pipeline), ("eval", self.eval)):
            lines += [f"[{name}]"] + [f"{k} = {_toml_value(v)}" for k, v in _plain(obj).items()] + [""]
        for name, stage in self.stages.items():
            lines += [f"# {STAGE_BY_NAME[name].what}: hybridtron {STAGE_BY_NAME[name].command}", f"[{name}]",
                      f"enabled = {_toml_value(stage.enabled)}", f"steps = {stage.steps}"]
            lines += [f"{field} = {getattr(stage, field)}" for field in DATA_STAGES.get(name, ())]
            for section, values in _settings_tables(stage.settings).items():
                lines += ["", f"[{name}.{section}]"] + [f"{k} = {_toml_value(_typed(v))}" for k, v in values.items()]
            lines.append("")
        return "\n".join(lines)


def _plain(obj) -> dict:
    return {f.name: (list(v) if isinstance(v := getattr(obj, f.name), tuple) else v) for f in dataclasses.fields(obj)}


def stage_dict(stage: StageConfig) -> dict:
    return {"enabled": stage.enabled, "steps": stage.steps, "math_examples": stage.math_examples,
            "code_examples": stage.code_examples, "teacher_samples": stage.teacher_samples,
            "settings": list(stage.settings)}


def _settings_tables(settings) -> dict[str, dict[str, str]]:
    tables: dict[str, dict[str, str]] = {}
    for text in settings:
        key, _, value = text.partition("=")
        section, _, name = key.partition(".")
        tables.setdefault(section, {})[name] = value
    return tables


def _typed(text: str):
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


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))


def _text(value) -> str:
    """A TOML value as the text of a `--set` override."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(_text(v) for v in value)
    return str(value)


def merge_settings(settings, changes) -> tuple[str, ...]:
    """`settings` with `changes` applied (both `SECTION.FIELD=VALUE` texts): a field given again takes the new
    value in its old place, and every value is written one way (`5e-4` and `0.0005` alike), so that the same
    configuration, however it was given, makes the same command line."""
    merged: dict[str, str] = {}
    for text in (*settings, *changes):
        key, _, value = text.partition("=")
        merged[key.strip()] = _text(_typed(value.strip()))
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
        "rlvr": _stage(1, "grpo.group_size=2", "grpo.prompts_per_step=2", "grpo.task_pool=8",
                       "grpo.max_new_tokens=6", "grpo.speculative=false", "grpo.max_refill_rounds=0",
                       "grpo.eval_tasks=0", "grpo.mtp_loss_weight=0", "train.grad_accum=1"),
        "math_teacher_sft": _stage(2, "sft.train_on_thinking=true", "sft.env_examples=40", "sft.seq_len=256",
                                   "sft.batch_size=1", "sft.val_batches=1", "train.val_every=2"),
        "math_teacher": _stage(1, "grpo.group_size=2", "grpo.prompts_per_step=2", "grpo.task_pool=8",
                               "grpo.max_new_tokens=6", "grpo.speculative=false", "grpo.max_refill_rounds=0",
                               "grpo.eval_tasks=0", "grpo.mtp_loss_weight=0", "train.grad_accum=1"),
        "code_teacher": _stage(2, "sft.train_on_thinking=true", "sft.env_examples=40", "sft.seq_len=256",
                               "sft.batch_size=1", "sft.val_batches=1", "train.val_every=2"),
        "code_teacher_rl": _stage(1, "grpo.group_size=2", "grpo.prompts_per_step=2", "grpo.task_pool=8",
                                  "grpo.max_new_tokens=6", "grpo.speculative=false", "grpo.max_refill_rounds=0",
                                  "grpo.eval_tasks=0", "grpo.mtp_loss_weight=0", "train.grad_accum=1",
                                  enabled=False),
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
    return PipelineConfig(pipeline=pipeline, eval=evaluation, stages=dict(PRESET_STAGES[name]))


def apply_changes(config: PipelineConfig, changes: dict[str, dict[str, Any]], where: str) -> PipelineConfig:
    """`changes` (section -> field -> value; stage settings as `SECTION.FIELD` keys) applied to `config`, each
    field checked by its type. `where` names the source (a file, or --set) in errors."""
    from hybridtron.train.config import _build

    sections = {"pipeline": config.pipeline, "eval": config.eval}
    stages = dict(config.stages)
    for name, values in changes.items():
        if name in sections:
            sections[name] = _build(type(sections[name]), {**_plain(sections[name]), **values}, name)
            continue
        if name not in stages:
            raise ValueError(f"{where}: unknown section [{name}]; expected [pipeline], [eval] or a stage: "
                             f"{', '.join(stages)}")
        stage = stages[name]
        plain = {k: v for k, v in values.items() if "." not in k}
        settings = [f"{k}={_text(v)}" for k, v in values.items() if "." in k]
        fields = ("enabled", "steps", *DATA_STAGES.get(name, ()))
        unknown = sorted(set(plain) - set(fields))
        if unknown:
            raise ValueError(f"{where}: [{name}] has no field(s) {unknown}; this stage has {', '.join(fields)} and "
                             f"[{name}.SECTION] tables of its command's settings")
        merged = _build(StageConfig, {**stage_dict(stage), **plain,
                                      "settings": list(merge_settings(stage.settings, settings))}, name)
        stages[name] = merged
    return PipelineConfig(pipeline=sections["pipeline"], eval=sections["eval"], stages=stages)


def read_pipeline_toml(path: str | Path) -> dict[str, dict[str, Any]]:
    """A pipeline TOML file as section -> field -> value, the `[STAGE.SECTION]` tables flattened to
    `SECTION.FIELD` keys of their stage."""
    from hybridtron.train.config import read_toml

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


def validate(config: PipelineConfig) -> None:
    """Every field of every enabled stage, checked before anything runs: its steps, and its command settings
    against the command's own configuration (the same checks the command makes, an hour earlier)."""
    from hybridtron.config import PRESETS

    if config.pipeline.model_preset not in PRESETS:
        raise ValueError(f"pipeline.model_preset: unknown preset {config.pipeline.model_preset!r}; expected one of "
                         f"{', '.join(PRESETS)}")
    if config.pipeline.threads < 0:
        raise ValueError(f"pipeline.threads must be >= 0 (0: torch's default), got {config.pipeline.threads}")
    if not config.pipeline.levels or any(level < 1 for level in config.pipeline.levels):
        raise ValueError(f"pipeline.levels must be positive difficulty levels, got {list(config.pipeline.levels)}")
    config.eval.validate()
    base = config.pipeline.base_model
    if base and config.stages["pretrain"].enabled:
        raise ValueError(f"pipeline.base_model = {base!r} replaces the pretrain stage; also set pretrain.enabled = "
                         f"false (--set pretrain.enabled=false), or use --base")
    if base and not (Path(base) / "config.json").is_file():
        raise FileNotFoundError(f"pipeline.base_model: {base} is not an HF checkpoint directory (no config.json)")
    for name in ("sft", "rlvr", "mtp_boost") + (() if base else ("pretrain",)):
        if not config.stages[name].enabled:
            raise ValueError(f"{name}.enabled = false: the stage {name} cannot be left out (the stages after it "
                             f"build on its model)")
    for name in active_stages(config):
        for needed in upstream(name, config):
            if not config.stages[needed].enabled and not (needed == "pretrain" and base):
                raise ValueError(f"{needed}.enabled = false: the stage {name} builds on its model; enable it, or "
                                 f"set {name}.enabled = false too")
    for name, stage in config.stages.items():
        if stage.steps < 1:
            raise ValueError(f"{name}.steps must be >= 1, got {stage.steps}")
        if name == "sft" and stage.code_examples < 0:
            raise ValueError(f"sft.code_examples must be >= 0 (code worked solutions mixed in; 0: math alone), got "
                             f"{stage.code_examples}")
        for field in ("math_examples", "code_examples") if name == "mopd_warmup" else ():
            if getattr(stage, field) < 1:
                raise ValueError(f"mopd_warmup.{field} must be >= 1 (training tasks of that teacher's domain), got "
                                 f"{getattr(stage, field)}")
        if name == "mopd_warmup" and stage.teacher_samples < 0:
            raise ValueError(f"mopd_warmup.teacher_samples must be >= 0 (each teacher's tries per task; 0: the "
                             f"worked solutions), got {stage.teacher_samples}")
        if stage.enabled:
            check_settings(name, stage, config)


def check_settings(name: str, stage: StageConfig, config: PipelineConfig) -> None:
    """The stage's settings against its command's configuration classes; errors name the stage."""
    command = STAGE_BY_NAME[name].command
    settings = list(stage.settings)
    try:
        if command == "pretrain":
            from hybridtron.train.config import build_run_config

            build_run_config(config.pipeline.model_preset, None, settings)
        elif command in ("sft", "grpo"):
            from hybridtron.train.run import merge_sections

            module = importlib.import_module(STAGE_BY_NAME[name].module)
            merge_sections(module.default_sections(), None, settings, fixed={"model": module.MODEL_FIXED})
        elif command == "mtp-boost":
            from hybridtron.post.mtp_boost import BoostConfig

            values = {}
            for text in settings:
                key, _, value = text.partition("=")
                section, _, field_name = key.partition(".")
                if section != "boost" or field_name not in BOOST_FLAGS:
                    raise ValueError(f"{key}: mtp_boost takes boost.FIELD settings, FIELD one of "
                                     f"{', '.join(BOOST_FLAGS)}")
                values[field_name] = float(value) if field_name == "lr" else int(value)
            BoostConfig(steps=stage.steps, **values)
        elif command == "mopd":
            module = _mopd_module()
            if module is not None and hasattr(module, "default_sections"):
                from hybridtron.train.run import merge_sections

                merge_sections(module.default_sections(), None, settings,
                               fixed={"model": getattr(module, "MODEL_FIXED", "the model is the student's")})
    except ValueError as exc:
        raise ValueError(f"[{name}] ({command}): {exc}") from None


def _mopd_module():
    try:
        return importlib.import_module("hybridtron.post.mopd")
    except ModuleNotFoundError as exc:
        if exc.name != "hybridtron.post.mopd":
            raise
        return None


def resolve_config(args) -> PipelineConfig:
    """The preset <- the TOML file <- --set overrides, validated."""
    config = preset_config(args.preset)
    if args.config:
        config = apply_changes(config, read_pipeline_toml(args.config), args.config)
    if getattr(args, "base", None):
        config = apply_changes(config, {"pipeline": {"base_model": args.base}, "pretrain": {"enabled": False}},
                               "--base")
    if args.overrides:
        config = apply_changes(config, parse_set(args.overrides), "--set")
    validate(config)
    return config


# =============================================================================================== the stages
def stage_argv(name: str, config: PipelineConfig, out: Path) -> list[str]:
    """The command line of stage `name` (without --resume and --quiet), from the configuration and the run
    directories of the stages it builds on."""
    stage, pipe = config.stages[name], config.pipeline
    def hf(stage_name: str) -> str:
        if stage_name == "pretrain" and pipe.base_model:
            return str(Path(pipe.base_model).resolve())
        return str(out / stage_name / "hf")

    run_dir = str(out / name)
    levels = ",".join(map(str, pipe.levels))
    common = ["--out", run_dir, "--steps", str(stage.steps), "--set", f"train.threads={pipe.threads}"]
    settings = [x for s in stage.settings for x in ("--set", s)]
    if name == "pretrain":
        return ["--preset", pipe.model_preset, *common, *settings]
    if name == "sft":
        data = str(out / name / DATA_FILE) if stage.code_examples else "env:math"
        return ["--model", hf("pretrain"), "--data", data, *common, "--set", f"sft.env_levels={levels}", *settings]
    if name in ("rlvr", "math_teacher"):
        base = "sft" if name == "rlvr" else math_teacher_base(config)
        return ["--model", hf(base), "--env", "math", *common, "--set", f"grpo.levels={levels}",
                "--set", f"grpo.seed={1 if name == 'math_teacher' else 0}", *settings]
    if name in ("math_teacher_sft", "code_teacher"):
        data = "env:math" if name == "math_teacher_sft" else "env:code"
        return ["--model", hf("sft"), "--data", data, *common, "--set", f"sft.env_levels={levels}", *settings]
    if name == "code_teacher_rl":
        return ["--model", hf("code_teacher"), "--env", "code", *common, "--set", f"grpo.levels={levels}",
                *settings]
    if name == "mopd_warmup":
        return ["--model", hf("rlvr"), "--data", str(out / name / DATA_FILE), *common, *settings]
    if name.startswith("mopd_"):
        student = {"mopd_1": "mopd_warmup", "mopd_2": "mopd_1", "mopd_no_warmup": "rlvr"}[name]
        steps = config.stages["mopd_1"].steps if name == "mopd_no_warmup" else stage.steps
        teachers = ",".join(f"{domain}={hf(teacher)}" for domain, teacher in teacher_stages(config).items())
        return ["--student", hf(student), "--teachers", teachers, "--general", hf("rlvr"), "--out", run_dir,
                "--steps", str(steps), "--set", f"train.threads={pipe.threads}", "--set", "mopd.warmup_steps=0",
                "--set", f"mopd.levels={levels}", "--set", "mopd.eval_tasks=0", *settings]
    if name == "mtp_boost":
        flags = []
        for text in stage.settings:
            key, _, value = text.partition("=")
            flags += [f"--{key.partition('.')[2].replace('_', '-')}", value]
        return ["--model", hf("mopd_2"), "--out", hf("mtp_boost"), "--steps", str(stage.steps),
                "--prompts", str(out / name / BOOST_PROMPTS), *flags]
    raise AssertionError(name)


def math_teacher_base(config: PipelineConfig) -> str:
    return "math_teacher_sft" if config.stages["math_teacher_sft"].enabled else "rlvr"


def code_teacher(config: PipelineConfig) -> str:
    return "code_teacher_rl" if config.stages["code_teacher_rl"].enabled else "code_teacher"


def teacher_stages(config: PipelineConfig) -> dict[str, str]:
    """domain -> the stage whose model is that domain's teacher."""
    return {MATH_DOMAIN: "math_teacher", CODE_DOMAIN: code_teacher(config)}


def upstream(name: str, config: PipelineConfig) -> list[str]:
    """The stages whose models stage `name` reads."""
    teachers = list(teacher_stages(config).values())
    return {"pretrain": [], "sft": ["pretrain"], "rlvr": ["sft"], "math_teacher_sft": ["sft"],
            "math_teacher": [math_teacher_base(config)], "code_teacher": ["sft"],
            "code_teacher_rl": ["code_teacher"],
            "mopd_warmup": ["rlvr", *(teachers if config.stages["mopd_warmup"].teacher_samples else ())],
            "mopd_1": ["mopd_warmup", *teachers, "rlvr"],
            "mopd_2": ["mopd_1", *teachers, "rlvr"],
            "mopd_no_warmup": ["rlvr", *teachers],
            "mtp_boost": ["mopd_2"]}[name]


def active_stages(config: PipelineConfig) -> list[str]:
    return [stage.name for stage in STAGES if config.stages[stage.name].enabled]


def fingerprints(config: PipelineConfig, out: Path) -> dict[str, str]:
    """Each stage's fingerprint: a hash of its command line (and warmup data) and of its upstream stages'. Paths
    are taken relative to `out`, so that a pipeline directory can be moved."""
    prints: dict[str, str] = {}
    for name in active_stages(config):
        argv = [arg.replace(str(out), "OUT") for arg in stage_argv(name, config, out)]
        # a field added since is left out at its default, so that it does not change the prints of finished stages
        added = {field: getattr(config.stages[name], field) for field in ("math_examples", "teacher_samples")
                 if getattr(config.stages[name], field)}
        payload = {"argv": argv, "examples": config.stages[name].code_examples, **added,  # code_examples' old name
                   "levels": list(config.pipeline.levels),
                   "upstream": [prints[u] for u in upstream(name, config) if u in prints]}
        prints[name] = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
    return prints


def _parse_command_args(stage: Stage, argv: list[str]):
    """(the command's module, `argv` parsed by its own parser), as `hybridtron COMMAND argv` would parse it."""
    try:
        module = importlib.import_module(stage.module)
    except ModuleNotFoundError as exc:
        if exc.name != stage.module:
            raise
        raise ValueError(f"stage {stage.name}: the command `hybridtron {stage.command}` ({stage.module}) is not "
                         f"installed; the stages before it are done, rerun the pipeline once it is") from None
    parser = argparse.ArgumentParser(prog=f"hybridtron {stage.command}")
    module.add_arguments(parser)
    known = {option for action in parser._actions for option in action.option_strings}
    argv = [a for a in argv if a != "--quiet" or "--quiet" in known]
    try:
        return module, parser.parse_args(argv)
    except SystemExit:  # argparse printed what it rejected
        raise ValueError(f"stage {stage.name}: `hybridtron {stage.command} {' '.join(argv)}` was rejected by the "
                         f"command's parser (see above)") from None


@dataclass(frozen=True)
class DataDraw:
    """Training tasks of one environment in a stage's data, and the setting that asks for them (for errors). Each
    task's conversation ends in its worked solution or, with a `teacher` stage, in the first of that teacher's
    `samples` answers that the environment scores 1."""

    domain: str
    examples: int
    seed: int
    setting: str
    teacher: str = ""
    samples: int = 0


def data_draws(name: str, config: PipelineConfig) -> list[DataDraw]:
    """The draws that make the data of stage `name`: SFT's `sft.env_examples` math worked solutions (the SFT
    command's default without the setting) and, with `code_examples`, that many code ones, the multi-domain SFT of
    the report; the warmup's `math_examples` and `code_examples` tasks, drawn with another seed than the SFT data and
    answered by that domain's teacher (`teacher_samples` tries each) or by their worked solutions. Empty for the
    other stages, and where SFT reads `env:math` itself."""
    from hybridtron.post.sft import SFTConfig

    stage = config.stages[name]
    code = f"{name}.code_examples={stage.code_examples}"
    if name == "mopd_warmup":
        teachers = teacher_stages(config) if stage.teacher_samples else {}
        return [DataDraw(domain, examples, 1, setting, teachers.get(domain, ""), stage.teacher_samples)
                for domain, examples, setting in (
                    (MATH_DOMAIN, stage.math_examples, f"{name}.math_examples={stage.math_examples}"),
                    (CODE_DOMAIN, stage.code_examples, code))]
    if name == "sft" and stage.code_examples:
        math_examples = int(stage.setting("sft.env_examples") or SFTConfig.env_examples)
        seed = int(stage.setting("sft.seed") or SFTConfig.seed)
        return [DataDraw(MATH_DOMAIN, math_examples, seed, f"sft.sft.env_examples={math_examples}"),
                DataDraw(CODE_DOMAIN, stage.code_examples, seed, code)]
    return []


def check_data_tasks(config: PipelineConfig) -> None:
    """Before the first stage: each environment has the distinct training tasks the data of every enabled stage
    asks of it, at the pipeline's levels (a ValueError naming the setting otherwise)."""
    from hybridtron.post.envs import get_env

    for name in active_stages(config):
        for draw in data_draws(name, config):
            with get_env(draw.domain, levels=tuple(config.pipeline.levels)) as env:
                try:
                    env.tasks("train", draw.examples, seed=draw.seed)
                except ValueError as exc:
                    raise ValueError(f"{draw.setting}: {exc}") from None


def write_stage_data(name: str, config: PipelineConfig, out: Path, log=None) -> int:
    """The conversations of stage `name` (see `data_draws`), the environments' training splits at the pipeline's
    levels, as `OUT/<name>/stage_data.jsonl` (written whole or not at all); returns their number."""
    from hybridtron.post.envs import get_env, write_jsonl

    examples = []
    for draw in data_draws(name, config):
        with get_env(draw.domain, levels=tuple(config.pipeline.levels)) as env:
            if not draw.teacher:
                examples += env.sft_examples(draw.examples, seed=draw.seed)
                continue
            answered = teacher_examples(out / draw.teacher / "hf", env, draw, config)
            if log is not None:
                log(f"[{name}] {draw.teacher}: {len(answered)} of {draw.examples} {draw.domain} tasks solved in "
                    f"{draw.samples} tries each")
            examples += answered
    path = out / name / DATA_FILE
    partial = path.with_name(path.name + ".partial")
    write_jsonl(partial, examples)
    partial.replace(path)
    return len(examples)


def teacher_examples(hf_dir: Path, env, draw: DataDraw, config: PipelineConfig) -> list[dict]:
    """`draw.examples` training tasks of `env`, each answered by the teacher checkpoint `hf_dir` up to
    `draw.samples` times at TEACHER_TEMPERATURE, as conversations ending in the first answer the environment scores
    1 (`teachers.teacher_answers`). These are the teacher's data of the warmup: here the teachers' SFT data is the
    student's own (the multi-domain SFT), so what the student has not seen of a teacher is its answers."""
    import torch

    from hybridtron.post.teachers import teacher_answers

    if config.pipeline.threads:
        torch.set_num_threads(config.pipeline.threads)
    max_tokens = config.eval.max_tokens if draw.domain == MATH_DOMAIN else config.eval.code_max_tokens
    try:
        return teacher_answers(hf_dir, env, env.tasks("train", draw.examples, seed=draw.seed),
                               temperature=TEACHER_TEMPERATURE, max_tokens=max_tokens, seed=draw.seed,
                               tries=draw.samples, verified=True, batch_size=config.eval.batch_size)
    except ValueError as exc:
        raise ValueError(f"{draw.setting}: the {draw.teacher} stage's model: {exc}, so the warmup has no "
                         f"{draw.domain} data from it; train that teacher further, or set "
                         f"mopd_warmup.teacher_samples=0 for the worked solutions") from None


def write_boost_prompts(config: PipelineConfig, path: Path) -> None:
    """MTP boosting's prompts: training-split math and code tasks as chat conversations (half each), so that the
    drafter learns on the kind of text the pipeline measures its acceptance on, not on text sampled from bos."""
    from hybridtron.post.envs import get_env, write_jsonl

    conversations = []
    count = config.eval.acceptance_prompts * 2
    for domain in (MATH_DOMAIN, CODE_DOMAIN):
        with get_env(domain, levels=tuple(config.pipeline.levels)) as env:
            conversations += [{"messages": env.prompt_messages(task)}
                              for task in env.tasks("train", _share(count, domain), seed=2)]
    path.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(path, conversations)


def run_stage(name: str, config: PipelineConfig, out: Path, log) -> float:
    """Run (or continue) the command of stage `name`; returns its wall time in seconds, writing its data
    included."""
    started = time.perf_counter()
    stage = STAGE_BY_NAME[name]
    run_dir = out / name
    argv = stage_argv(name, config, out) + ["--quiet"]
    checkpoints = run_dir / "checkpoints"
    resume = stage.command != "mtp-boost" and checkpoints.is_dir() and any(checkpoints.iterdir())
    if resume:
        argv.append("--resume")
    if data_draws(name, config) and not (run_dir / DATA_FILE).is_file():
        write_stage_data(name, config, out, log)
    if name == "mtp_boost" and not (run_dir / BOOST_PROMPTS).is_file():
        write_boost_prompts(config, run_dir / BOOST_PROMPTS)
    module, args = _parse_command_args(stage, argv)
    log(f"[{name}] {'resuming' if resume else 'running'}: hybridtron {stage.command} {' '.join(argv)}")
    code = module.run(args)
    if code:
        raise ValueError(f"stage {name}: hybridtron {stage.command} exited with status {code}")
    return time.perf_counter() - started


# =============================================================================================== evaluation
@dataclass
class EvalSet:
    """The held-out material every stage is measured on, drawn once."""

    math_tasks: list
    code_tasks: list
    val_conversations: dict[str, list[dict]]  # by domain


def eval_set(config: PipelineConfig) -> EvalSet:
    from hybridtron.post.envs import get_env

    ev, pipe = config.eval, config.pipeline
    val: dict[str, list[dict]] = {}
    tasks = {}
    for domain, n in ((MATH_DOMAIN, ev.math_tasks), (CODE_DOMAIN, ev.code_tasks)):
        with get_env(domain, levels=tuple(pipe.levels)) as env:
            # the validation conversations are held-out tasks too (the graded ones first), with their references
            drawn = env.tasks("test", max(n, _share(ev.val_conversations, domain)), ev.seed)
            tasks[domain] = drawn[:n]
            for task in drawn[:_share(ev.val_conversations, domain)]:
                val.setdefault(domain, []).append(
                    {"messages": env.prompt_messages(task) + [{"role": "assistant", "content": task.reference}]})
    return EvalSet(tasks[MATH_DOMAIN], tasks[CODE_DOMAIN], val)


def _share(n: int, domain: str) -> int:
    """Math's half of `n`, or code's (the rest)."""
    return n // 2 if domain == MATH_DOMAIN else n - n // 2


def held_out_loss(model, tokenizer, conversations: list[dict]) -> tuple[float, int]:
    """(the summed masked next-token CE over the assistant turns, reasoning included, of `conversations`, the
    number of tokens it is summed over)."""
    import torch

    from hybridtron.data.chat import tokenize_chats

    total, count = 0.0, 0
    limit = model.config.max_position_embeddings
    with torch.no_grad():
        for chat in tokenize_chats(tokenizer, [c["messages"] for c in conversations]):
            ids = torch.as_tensor(chat.ids[:limit], dtype=torch.long)
            trained = torch.as_tensor(chat.trained(train_on_thinking=True)[:limit])
            targets = trained[1:]
            if not targets.any():
                continue
            logits = model(ids[None, :-1], mtp=False).logits[0].float()
            losses = torch.nn.functional.cross_entropy(logits, ids[1:], reduction="none")
            total += float(losses[targets].sum())
            count += int(targets.sum())
    return total, count


def evaluate_model(hf_dir: Path, config: PipelineConfig, material: EvalSet) -> dict:
    """One stage's model measured (see the module docstring): math, code, validation loss, acceptance length."""
    import torch

    from hybridtron.checkpoint import load_pretrained
    from hybridtron.data.chat import load_chat_tokenizer, tokenize_chat
    from hybridtron.post.envs import get_env
    from hybridtron.post.evaluate import evaluate_env
    from hybridtron.post.mtp_boost.training import acceptance_length

    ev, pipe = config.eval, config.pipeline
    if pipe.threads:
        torch.set_num_threads(pipe.threads)
    started = time.perf_counter()
    model = load_pretrained(hf_dir, dtype=torch.float32).eval()
    tokenizer = load_chat_tokenizer(hf_dir, vocab_size=model.config.vocab_size)
    result: dict[str, Any] = {}
    prompts = []
    for domain, tasks, max_tokens in ((MATH_DOMAIN, material.math_tasks, ev.max_tokens),
                                      (CODE_DOMAIN, material.code_tasks, ev.code_max_tokens)):
        with get_env(domain, levels=tuple(pipe.levels)) as env:
            scored = evaluate_env(model, tokenizer, env, tasks, max_tokens=max_tokens, batch_size=ev.batch_size)
            prompts += [tokenize_chat(tokenizer, env.prompt_messages(t), add_generation_prompt=True).ids.tolist()
                        for t in tasks[:_share(ev.acceptance_prompts, domain)]]
        result[f"{domain}_pass_at_1"] = scored.pass_at_1
        result[f"{domain}_mean_reward"] = scored.mean_reward
        result[f"{domain}_by_level"] = {str(k): v for k, v in scored.by_difficulty.items()}
        result[f"{domain}_completion_tokens"] = scored.mean_completion_tokens
        result[f"{domain}_truncated_share"] = scored.truncated_share
    result["code_pass_rate"] = result["code_mean_reward"]  # the share of hidden unit tests passed
    totals = {domain: held_out_loss(model, tokenizer, conversations)
              for domain, conversations in material.val_conversations.items()}
    for domain, (total, count) in totals.items():
        result[f"{domain}_val_loss"] = total / max(count, 1)
    # token-weighted over both domains
    result["val_loss"] = sum(t for t, _ in totals.values()) / max(sum(c for _, c in totals.values()), 1)
    with torch.no_grad():
        result["acceptance_length"] = acceptance_length(model, prompts, ev.draft_length, ev.acceptance_tokens)
    result["seconds"] = time.perf_counter() - started
    return result


# ================================================================================================= the run
def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def run_pipeline(config: PipelineConfig, out: Path, *, log=None, stop_after: str | None = None) -> dict:
    """Every enabled stage in order (skipping the finished ones), each evaluated; then the table. `stop_after`:
    end after that stage (what an interrupted run leaves, for tests and for running the pipeline in parts)."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    out.mkdir(parents=True, exist_ok=True)
    (out / "pipeline_config.toml").write_text(config.to_toml())
    prints = fingerprints(config, out)
    eval_print = hashlib.sha256(json.dumps(_plain(config.eval), sort_keys=True).encode()).hexdigest()[:16]
    material = eval_set(config)  # drawn first: an environment without enough test tasks fails now, not in an hour
    check_data_tasks(config)  # and one without enough training tasks for the SFT stages' data
    for name in active_stages(config):
        record = _read_json(out / name / STAGE_FILE)
        if record is not None and record.get("fingerprint") != prints[name]:
            raise ValueError(f"{out / name}: this stage was run with another configuration (or after other upstream "
                             f"stages; see its {STAGE_FILE}); remove {out / name} and the stages after it to rerun "
                             f"them, or choose another --out")
        if record is not None:
            log(f"[{name}] done ({record['seconds']:.0f}s), skipped")
        else:
            seconds = run_stage(name, config, out, log)
            record = {"stage": name, "command": STAGE_BY_NAME[name].command, "fingerprint": prints[name],
                      "argv": stage_argv(name, config, out), "seconds": seconds,
                      "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            (out / name / STAGE_FILE).write_text(json.dumps(record, indent=2))
        evaluation = _read_json(out / name / EVAL_FILE)
        if evaluation is None or evaluation.get("fingerprint") != eval_print + prints[name]:
            evaluation = {"fingerprint": eval_print + prints[name],
                          **evaluate_model(out / name / "hf", config, material)}
            (out / name / EVAL_FILE).write_text(json.dumps(evaluation, indent=2))
            log(f"[{name}] " + format_row(evaluation))
        if name == stop_after:
            break
    result = summarize(config, out)
    (out / RESULT_FILE).write_text(json.dumps(result, indent=2))
    (out / HTML_FILE).write_text(render_html(result, out))
    return result


def format_row(e: dict) -> str:
    return (f"math pass@1 {e['math_pass_at_1']:.1%}, code pass rate {e['code_pass_rate']:.1%} (pass@1 "
            f"{e['code_pass_at_1']:.1%}), val loss {e['val_loss']:.3f} (math {e['math_val_loss']:.3f}, code "
            f"{e['code_val_loss']:.3f}), MTP acceptance {e['acceptance_length']:.2f} (eval {e['seconds']:.0f}s)")


def recovery(student: float, rlvr: float, teacher: float) -> float | None:
    """(MOPD - RLVR) / (teacher - RLVR): the share of the teacher's lead over the RLVR student that distillation
    won back (the report's Table 5); None where the teacher is not ahead."""
    gap = teacher - rlvr
    return None if gap <= 0 else (student - rlvr) / gap


def summarize(config: PipelineConfig, out: Path) -> dict:
    """The stage table, the recovery of each MOPD stage per domain, and the goals of the recipe."""
    rows = []
    for name in active_stages(config):
        record, evaluation = _read_json(out / name / STAGE_FILE), _read_json(out / name / EVAL_FILE)
        if record is None or evaluation is None:
            continue
        rows.append({"stage": name, "what": STAGE_BY_NAME[name].what, "train_seconds": record["seconds"],
                     **{k: v for k, v in evaluation.items() if k != "fingerprint"}})
    by_stage = {row["stage"]: row for row in rows}
    metric = {MATH_DOMAIN: "math_pass_at_1", CODE_DOMAIN: "code_pass_rate"}
    teachers = teacher_stages(config)
    recoveries = {}
    for name in ("mopd_1", "mopd_2", "mopd_no_warmup"):
        if name in by_stage and "rlvr" in by_stage:
            recoveries[name] = {domain: recovery(by_stage[name][key], by_stage["rlvr"][key],
                                                 by_stage[teachers[domain]][key])
                                for domain, key in metric.items() if teachers[domain] in by_stage}
    goals = {}
    if "sft" in by_stage and "rlvr" in by_stage:
        sft, rlvr = by_stage["sft"]["math_pass_at_1"], by_stage["rlvr"]["math_pass_at_1"]
        goals["rlvr_raises_math"] = {"met": rlvr > sft, "sft": sft, "rlvr": rlvr}
    if "mopd_2" in recoveries:
        values = recoveries["mopd_2"]
        goals["mopd_recovers_half"] = {"met": bool(values) and all(v is not None and v >= 0.5 for v in values.values()),
                                       **values}
    if "mopd_1" in recoveries and "mopd_no_warmup" in recoveries:
        def mean(d):
            kept = [v for v in d.values() if v is not None]
            return sum(kept) / len(kept) if kept else None
        with_w, without = mean(recoveries["mopd_1"]), mean(recoveries["mopd_no_warmup"])
        goals["warmup_helps"] = {"met": with_w is not None and without is not None and with_w > without,
                                 "with_warmup": with_w, "without_warmup": without}
    if "mopd_2" in by_stage and "mtp_boost" in by_stage:
        before, after = by_stage["mopd_2"]["acceptance_length"], by_stage["mtp_boost"]["acceptance_length"]
        goals["mtp_boost_raises_acceptance"] = {"met": after > before, "before": before, "after": after}
    missing = [name for name in active_stages(config) if name not in by_stage]
    total = sum(row["train_seconds"] + row["seconds"] for row in rows)
    return {"stages": rows, "recovery": recoveries, "goals": goals, "missing": missing, "total_seconds": total,
            "config": config.to_dict()}


def _cell(value, percent=False) -> str:
    if value is None:
        return "n/a"
    return f"{value:.1%}" if percent else f"{value:.3f}" if isinstance(value, float) else str(value)


def format_table(result: dict) -> str:
    """The stage table as Markdown (what BENCHMARKS.md records), then the recovery and the goals."""
    lines = ["| stage | math pass@1 | code pass rate | code pass@1 | val loss (math / code) | MTP acceptance | train s "
             "| eval s |", "|---|---|---|---|---|---|---|---|"]
    for row in result["stages"]:
        by_domain = f" ({row['math_val_loss']:.2f} / {row['code_val_loss']:.2f})" if "code_val_loss" in row else ""
        lines.append(f"| {row['stage']} | {_cell(row['math_pass_at_1'], True)} | {_cell(row['code_pass_rate'], True)} "
                     f"| {_cell(row['code_pass_at_1'], True)} | {row['val_loss']:.3f}{by_domain} "
                     f"| {row['acceptance_length']:.2f} | {row['train_seconds']:.0f} | {row['seconds']:.0f} |")
    if result["recovery"]:
        lines += ["", "| recovery (MOPD - RLVR) / (teacher - RLVR) | math | code |", "|---|---|---|"]
        for name, values in result["recovery"].items():
            math, code = _cell(values.get(MATH_DOMAIN), True), _cell(values.get(CODE_DOMAIN), True)
            lines.append(f"| {name} | {math} | {code} |")
    if result["goals"]:
        lines.append("")
        for goal, values in result["goals"].items():
            numbers = ", ".join(f"{k} {_cell(v)}" for k, v in values.items() if k != "met")
            lines.append(f"- {goal}: {'met' if values['met'] else 'NOT met'} ({numbers})")
    if result["missing"]:
        lines.append(f"\nnot run yet: {', '.join(result['missing'])}")
    lines.append(f"\ntotal wall time {result['total_seconds'] / 60:.1f} min (training + evaluation)")
    return "\n".join(lines)


def render_html(result: dict, out: Path) -> str:
    """A self-contained page: the table, the recovery and goals, a chart of the stage metrics, each stage's
    curves (hybridtron.train.report's loss and rollout panels)."""
    import html

    from hybridtron.train import report

    parts = [f"<html><head><meta charset='utf-8'><title>hybridtron pipeline {html.escape(str(out))}</title>"
             "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}</style></head><body>",
             f"<h1>Pipeline {html.escape(str(out))}</h1>"]
    table = format_table(result).split("\n")
    rows = [line for line in table if line.startswith("|") and not line.startswith("|---")]
    parts.append("<table>")
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        tag = "th" if cells[0] in ("stage", "recovery (MOPD - RLVR) / (teacher - RLVR)") else "td"
        parts.append("<tr>" + "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in cells) + "</tr>")
    parts.append("</table><ul>")
    parts += [f"<li>{html.escape(line[2:])}</li>" for line in table if line.startswith("- ")]
    parts.append("</ul>")
    if result["stages"]:
        parts.append("<h2>Stage metrics</h2>" + _img(_stage_chart(result)))
    for row in result["stages"]:
        run_dir = out / row["stage"]
        if not (run_dir / "metrics.jsonl").is_file():
            continue
        data = report.load_run(run_dir)
        parts.append(f"<h2>{html.escape(row['stage'])}: {html.escape(row['what'])}</h2>")
        if data.keys("reverse_kl"):
            parts.append(_img(_plot_reverse_kl(data)))
        elif data.keys("reward_mean"):
            parts.append(_img(report.plot_rl(data)))
        if data.steps("loss")[0] or data.steps("val_loss")[0]:
            parts.append(_img(report.plot_losses(data)))
    parts.append("</body></html>")
    return "\n".join(parts)


def _img(png_base64: str) -> str:
    return f"<img src='data:image/png;base64,{png_base64}'>"


def _plot_reverse_kl(data) -> str:
    """A MOPD run's sampled reverse KL to the teachers, overall and per domain."""
    from hybridtron.train.report import _figure, _png

    plt, figure, axes = _figure()
    for key in data.keys("reverse_kl"):
        steps, values = data.steps(key)
        axes.plot(steps, values, "-", linewidth=1, label=key)
    axes.set_xlabel("step")
    axes.set_ylabel("KL(student || teacher), nats a token")
    axes.legend(fontsize=8)
    return _png(plt, figure)


def _stage_chart(result: dict) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hybridtron.train.report import _png

    names = [row["stage"] for row in result["stages"]]
    figure, (scores, acceptance) = plt.subplots(1, 2, figsize=(12, 3.6), dpi=90)
    width = 0.4
    for offset, (key, label) in enumerate((("math_pass_at_1", "math pass@1"), ("code_pass_rate", "code pass rate"))):
        scores.bar([i + (offset - 0.5) * width for i in range(len(names))], [row[key] for row in result["stages"]],
                   width, label=label)
    scores.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
    scores.legend(fontsize=8)
    scores.set_title("held-out accuracy", fontsize=9)
    acceptance.plot(names, [row["acceptance_length"] for row in result["stages"]], "o-")
    acceptance.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
    acceptance.set_title("MTP acceptance length (greedy)", fontsize=9)
    return _png(plt, figure)


# ================================================================================================ command
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESET_STAGES),
                        help="tiny: the real run, sized for 2 CPU cores; micro: a minute, for CI (default: tiny)")
    parser.add_argument("--out", help="the pipeline's directory: one run directory per stage, pipeline.json, "
                                      "pipeline.html (required unless --print-config)")
    parser.add_argument("--base", metavar="DIR",
                        help="start from this pretrained HF checkpoint (with tokenizer files) instead of the pretrain "
                             "stage; the same as --set pipeline.base_model=DIR --set pretrain.enabled=false "
                             "(default: none, pretrain)")
    parser.add_argument("--config", help="a TOML file with [pipeline], [eval] and [STAGE] sections ([STAGE.SECTION] "
                                         "tables: the stage command's settings), as --print-config writes "
                                         "(default: none, the preset's values)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="STAGE.FIELD=VALUE",
                        help="override one field, e.g. --set rlvr.steps=40 --set rlvr.grpo.group_size=8 --set "
                             "eval.math_tasks=200 (repeatable)")
    parser.add_argument("--stop-after", choices=[stage.name for stage in STAGES],
                        help="end after this stage; the rest runs when the pipeline is run again (default: none, "
                             "run every stage)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved configuration as TOML (which --config accepts) and exit")


def run(args) -> int:
    from hybridtron.train.run import refuse_torchrun

    refuse_torchrun("pipeline")  # its stages run in this process, one after another
    config = resolve_config(args)
    if args.print_config:
        print(config.to_toml(), end="")
        return 0
    if not args.out:
        raise ValueError("--out is required: the pipeline's directory (e.g. --out runs/pipe)")
    result = run_pipeline(config, Path(args.out), stop_after=args.stop_after)
    print(format_table(result))
    print(f"\n{Path(args.out) / RESULT_FILE}\n{Path(args.out) / HTML_FILE}")
    return 0
