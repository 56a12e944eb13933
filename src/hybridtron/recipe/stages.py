"""The stages of the recipe, each a typed run of its command (hybridtron.recipe; their configuration:
hybridtron.recipe.config; the recipe's table: docs/post-training.md): pretraining, multi-domain SFT, the RLVR
student, the math, code and agentic (terminal tool use) teachers, the MOPD warmup on the teachers' answers, two MOPD
iterations and the ablation without warmup, MTP boosting.

Each stage is one declaration (`Stage`, hybridtron.recipe.stage) carrying its command, its inputs, what the recipe
sets on its configuration, its data writer, how it is measured and its presets; the functions below loop over
`STAGES` and ask none of them its name. A stage's configuration is the run configuration its command takes
(`RunConfig`, `SFTRunConfig`, ...): its inputs (the checkpoints of the stages it builds on, its data), then the
recipe's settings and the stage's own, typed values of that configuration's fields (`SECTION.FIELD` -> value: in
the pipeline's TOML `[STAGE.SECTION]` tables, on its command line `--set STAGE.SECTION.FIELD=VALUE`, each checked
against its field's type when given): `stage_run` builds it, and `command_line` prints the command that runs the
same configuration by hand.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shlex
import typing
from pathlib import Path
from typing import Any

from hybridtron.config import PRESETS, ModelConfig, preset as model_preset
from hybridtron.envs import get_env
from hybridtron.post import grpo, mopd, mtp_boost, sft
from hybridtron.recipe.config import PRESET_SECTIONS, PipelineConfig, StageConfig, setting_text
from hybridtron.recipe.stage import (AGENTIC_DOMAIN, CODE_DOMAIN, LEVELS, MATH_DOMAIN, BoostPrompts, DataDraw, First,
                                     MixedSFTData, Raises, RecoversAtLeast, RecoversMore, Recovery, Stage, TeacherData,
                                     Written, in_order, preset)
from hybridtron.train import pretrain
from hybridtron.train.config import build_section, coerce_value, section_values, toml_value

CONFIG_FILE = "pipeline_config.toml"  # the pipeline's resolved configuration; a later run in OUT starts from it
STAGE_FILE = "stage.json"  # written when a stage's command returned and its model was evaluated
EVAL_FILE = "eval.json"
RESULT_FILE = "pipeline.json"
HTML_FILE = "pipeline.html"

# ====================================================================================== the presets' settings
SFT_SETTINGS = {"sft.train_on_thinking": True, "train.val_every": 50, "train.checkpoint_every": 50}
MICRO_SFT = {"sft.train_on_thinking": True, "sft.env_examples": 40, "sft.seq_len": 256, "sft.batch_size": 1,
             "sft.val_batches": 1, "train.val_every": 2}
MICRO_WARMUP = {key: value for key, value in MICRO_SFT.items() if key != "sft.env_examples"}  # its data is a file
# The tiny preset's GRPO: issue 12's working run (BENCHMARKS.md, "GRPO at rollout temperature 0.5"): 8 completions
# of 32 prompts a step sampled at T = 0.5, prompts drawn uniformly, lr 1e-4, short completions, no MTP drafts in the
# rollouts and no MTP loss (MTP boosting retrains the drafter at the end), the stage evaluation instead of GRPO's own.
# a terminal turn's cap (the evaluation's): the bash call of its "function called most" task is 101 tokens
AGENTIC_TURN = PRESET_SECTIONS["tiny"][1].agentic_max_tokens
GRPO = {"grpo.group_size": 8, "grpo.prompts_per_step": 32, "grpo.temperature": 0.5, "grpo.curriculum": False,
        "grpo.max_new_tokens": 64, "grpo.speculative": False, "grpo.mtp_loss_weight": 0.0, "grpo.eval_tasks": 0,
        "train.lr": 1e-4, "train.checkpoint_every": 10}
# MOPD: 64 prompts a step (one completion each) at T = 0.5 and lr 2e-4 (docs/LOG.md, session 7, math prompts alone:
# 128 a step at lr 1e-4 won back 39% of a math teacher's lead in 30 steps, 32 a step at 2e-4 66% in 120; 5e-4 broke
# the student), on the reverse KL over each teacher's top 16 tokens, three quarters of the prompts math: against the
# report's sampled estimator it took two iterations from 19% / 30% to 49% / 74% of the math / code leads (session 9).
# With the agentic teacher the terminal prompts take a tenth (a trajectory is several times a math completion's
# tokens), math and code keeping about their shares, and a turn may take AGENTIC_TURN tokens: 38.6% of the terminal
# lead recovered, 21.7% / 100% of math / code's, in 188 + 256 s (one seed, 2026-12-06, BENCHMARKS.md)
MOPD = {"mopd.prompts_per_step": 64, "mopd.temperature": 0.5, "mopd.max_new_tokens": AGENTIC_TURN,
        "mopd.speculative": False, "mopd.mtp_loss_weight": 0.0, "mopd.task_pool": 400, "train.lr": 2e-4,
        "train.checkpoint_every": 5, "mopd.kl_top_k": 16, "mopd.domain_weights": (0.7, 0.2, 0.1)}
MICRO_GRPO = {"grpo.group_size": 2, "grpo.prompts_per_step": 2, "grpo.task_pool": 8, "grpo.max_new_tokens": 6,
              "grpo.speculative": False, "grpo.max_refill_rounds": 0, "grpo.eval_tasks": 0,
              "grpo.mtp_loss_weight": 0.0, "train.grad_accum": 1}
MICRO_MOPD = {"mopd.prompts_per_step": 4, "mopd.max_new_tokens": 6, "mopd.speculative": False, "mopd.task_pool": 8,
              "train.grad_accum": 1, "mopd.kl_top_k": 4}
# An expert terminal trajectory (the tool's declaration, the task, its turns) is 383-605 tokens of the tiny tokenizer
# (at 512, a quarter of them lost their last turns) and ~800 of the micro one's: rows that hold one whole, as many
# tokens a micro-batch as SFT's 8 x 256
AGENTIC_ROWS = {"sft.seq_len": 1024, "sft.batch_size": 2}
AGENTIC_SFT = {"sft.train_on_thinking": True, **AGENTIC_ROWS, "train.val_every": 50, "train.checkpoint_every": 50}
MICRO_AGENTIC_SFT = {**MICRO_SFT, "sft.env_examples": 8, "sft.seq_len": 1024}
# the micro model: tests/conftest.py's small config (every layer kind, LatentMoE, MTP) with a 512-token vocabulary,
# its context 2048 tokens (no positional encoding: it bounds generation alone) for the terminal's ~570-token prompts
MICRO_MODEL = {f"model.{k}": v for k, v in dict(
    hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=12, intermediate_size=64,
    mamba_num_heads=4, mamba_head_dim=8, n_groups=2, ssm_state_size=8, chunk_size=8, num_experts_per_tok=3,
    moe_intermediate_size=24, moe_shared_expert_intermediate_size=32, moe_latent_size=16, n_group=4).items()}

# =============================================================================================== the stages
# Presets: `tiny` is the real run, sized for 2 CPU cores (BENCHMARKS.md, issue 13): SFT on the math worked solutions
# and every level 1-2 code training task's (268), RLVR and the math teacher at issue 12's working GRPO (50 steps
# each); `micro` is CI: every stage for a step or two on a 512-token vocabulary and a few stdlib families.
PRETRAIN = Stage(name="pretrain", command=pretrain.COMMAND, what="pretraining", base=True, required=True, presets={
    "tiny": preset(150, {"train.val_every": 50, "train.checkpoint_every": 50}),
    "micro": preset(2, {"data.families": ("json", "text", "functional"), "data.seq_len": 64, "data.batch_size": 4,
                        "data.vocab_size": 512, "model.vocab_size": 512, "model.max_position_embeddings": 2048},
                    MICRO_MODEL, {"data.val_batches": 1, "train.warmup_steps": 1, "train.val_every": 2})})
# SFT is multi-domain, as the report's: in a model this small a skill learnt after another overwrites it (docs/LOG.md,
# session 7): a student that learns code only in the warmup loses its math there
SFT = Stage(name="sft", command=sft.COMMAND, what="SFT on math and code worked solutions", required=True,
            inputs={"base_model": PRETRAIN, "data": Written("env:math")}, fixed={"sft.env_levels": LEVELS},
            data=MixedSFTData(defaults=sft.SFTConfig()), presets={
                "tiny": preset(800, SFT_SETTINGS, code_examples=268),
                "micro": preset(2, MICRO_SFT, code_examples=4)})
RLVR = Stage(name="rlvr", command=grpo.COMMAND, what="RLVR student (GRPO on math)", required=True,
             inputs={"base_model": SFT, "env": MATH_DOMAIN}, fixed={"grpo.levels": LEVELS, "grpo.seed": 0},
             presets={"tiny": preset(50, GRPO), "micro": preset(1, MICRO_GRPO)})
# the math teacher is specialised like the code teacher, by SFT on its domain alone, then RLVR: from the
# multi-domain student, 50 more GRPO steps did not raise math (23.7% -> 23.0%: docs/LOG.md, session 7); with
# math_teacher_sft off it is the student's RLVR continued
MATH_TEACHER_SFT = Stage(name="math_teacher_sft", command=sft.COMMAND, what="math teacher (math SFT)",
                         inputs={"base_model": SFT, "data": "env:math"}, fixed={"sft.env_levels": LEVELS},
                         presets={"tiny": preset(200, SFT_SETTINGS), "micro": preset(2, MICRO_SFT)})
MATH_TEACHER = Stage(name="math_teacher", command=grpo.COMMAND, what="math teacher (math RLVR)",
                     inputs={"base_model": First(MATH_TEACHER_SFT, RLVR), "env": MATH_DOMAIN},
                     fixed={"grpo.levels": LEVELS, "grpo.seed": 1},
                     presets={"tiny": preset(50, GRPO), "micro": preset(1, MICRO_GRPO)})
CODE_TEACHER = Stage(name="code_teacher", command=sft.COMMAND, what="code teacher (code SFT)",
                     inputs={"base_model": SFT, "data": "env:code"}, fixed={"sft.env_levels": LEVELS},
                     presets={"tiny": preset(100, {"sft.train_on_thinking": True, "sft.env_examples": 250,
                                                 "train.val_every": 50, "train.checkpoint_every": 50}),
                              "micro": preset(2, MICRO_SFT)})
CODE_TEACHER_RL = Stage(name="code_teacher_rl", command=grpo.COMMAND, what="code teacher (code RLVR)",
                        inputs={"base_model": CODE_TEACHER, "env": CODE_DOMAIN}, fixed={"grpo.levels": LEVELS},
                        presets={"tiny": preset(10, GRPO, enabled=False),
                                 "micro": preset(1, MICRO_GRPO, enabled=False)})
# The agentic teacher, as the report's: SFT on tool-use trajectories, then RL in the tool environment. Its SFT data
# are the terminal environment's expert trajectories, successful and failed, each prefixed with its outcome
# (hybridtron.envs.agentic_sft: the student never sees them, so its tool use comes from the warmup and MOPD alone);
# its RLVR samples whole trajectories through the sandboxed bash tool (hybridtron.post.rl.trajectories). The tiny
# model learns the calls from a few hundred trajectories but not to copy the tool's output into its answer: 400
# trajectories x 200 steps solved 5% of 20 held-out tasks greedily, 2,000 x 300 steps 25% (docs/post-training.md)
AGENTIC_TEACHER_SFT = Stage(name="agentic_teacher_sft", command=sft.COMMAND, what="agentic teacher (tool-use SFT)",
                            inputs={"base_model": SFT, "data": f"env:{AGENTIC_DOMAIN}"},
                            fixed={"sft.env_levels": LEVELS},
                            presets={"tiny": preset(300, AGENTIC_SFT, {"sft.env_examples": 2000}),
                                     "micro": preset(2, MICRO_AGENTIC_SFT)})
AGENTIC_TEACHER = Stage(name="agentic_teacher", command=grpo.COMMAND, what="agentic teacher (terminal RLVR)",
                        inputs={"base_model": AGENTIC_TEACHER_SFT, "env": AGENTIC_DOMAIN},
                        fixed={"grpo.levels": LEVELS, "grpo.seed": 2},
                        presets={"tiny": preset(20, GRPO, {"grpo.prompts_per_step": 16,
                                                           "grpo.max_new_tokens": AGENTIC_TURN}),
                                 "micro": preset(1, MICRO_GRPO)})
# the teachers are specialists made from the multi-domain SFT model; their SFT data is the student's own (the agentic
# teacher's excepted), so what the student has not seen of a teacher is its answers (the warmup's data). Each domain
# is also the environment MOPD samples its prompts from (math, code, terminal: each its environment's name).
TEACHERS = {MATH_DOMAIN: MATH_TEACHER, CODE_DOMAIN: First(CODE_TEACHER_RL, CODE_TEACHER),
            AGENTIC_DOMAIN: AGENTIC_TEACHER}
MOPD_FIXED = {"mopd.warmup_steps": 0, "mopd.levels": LEVELS, "mopd.eval_tasks": 0,  # the warmup is its own stage
              "mopd.envs": tuple(TEACHERS)}
# The warmup is its own stage (the MOPD stages run with mopd.warmup_steps = 0), so that the ablation compares two
# MOPD runs that differ in their starting point only. As long as the code teacher's own SFT (shorter ones left the
# student with no passing code: docs/LOG.md, session 5), at lr 5e-4 (at 2e-3 it took the RLVR student's math from
# 44.5% to 4.8%: session 7), on each teacher's verified answers, best of 4: the worked solutions cost the student
# more math and taught it less code, and of the warmups tried only one with ~400 math answers raised math (session 8)
MOPD_WARMUP = Stage(name="mopd_warmup", command=sft.COMMAND, what="MOPD warmup (teachers' data)",
                    inputs={"base_model": RLVR, "data": Written()}, data=TeacherData(teachers=TEACHERS), presets={
                        "tiny": preset(100, {"sft.train_on_thinking": True, "train.lr": 5e-4, "train.val_every": 20,
                                             "train.checkpoint_every": 20, **AGENTIC_ROWS},
                                       math_examples=600, code_examples=200, terminal_examples=100,
                                       teacher_samples=4),
                        "micro": preset(2, MICRO_WARMUP, {"sft.seq_len": 1024}, math_examples=20, code_examples=20,
                                        terminal_examples=2, teacher_samples=0)})
MOPD_RECOVERY = Recovery(baseline=RLVR, teachers=TEACHERS)
MOPD_1 = Stage(name="mopd_1", command=mopd.COMMAND, what="MOPD iteration 1", fixed=MOPD_FIXED, recovery=MOPD_RECOVERY,
               inputs={"student": MOPD_WARMUP, "teachers": TEACHERS, "general": RLVR},
               presets={"tiny": preset(40, MOPD), "micro": preset(1, MICRO_MOPD)})
MOPD_2 = Stage(name="mopd_2", command=mopd.COMMAND, what="MOPD iteration 2", fixed=MOPD_FIXED, recovery=MOPD_RECOVERY,
               inputs={"student": MOPD_1, "teachers": TEACHERS, "general": RLVR},
               presets={"tiny": preset(40, MOPD), "micro": preset(1, MICRO_MOPD)})
MOPD_NO_WARMUP = Stage(name="mopd_no_warmup", command=mopd.COMMAND, what="MOPD without warmup (ablation)",
                       fixed=MOPD_FIXED, recovery=MOPD_RECOVERY, steps_of=MOPD_1,
                       inputs={"student": RLVR, "teachers": TEACHERS, "general": RLVR},
                       presets={"tiny": preset(40, MOPD), "micro": preset(1, MICRO_MOPD)})
# the drafter trained against the final model, on the kind of text its acceptance is measured on
MTP_BOOST = Stage(name="mtp_boost", command=mtp_boost.COMMAND, what="MTP boosting", required=True,
                  inputs={"base_model": MOPD_2, "prompts": Written()}, data=BoostPrompts(), presets={
                      "tiny": preset(30, {"boost.num_samples": 64, "boost.sample_length": 48, "boost.draft_length": 3}),
                      "micro": preset(2, {"boost.num_samples": 4, "boost.sample_length": 8, "boost.batch_size": 2,
                                          "boost.depths": 2, "boost.draft_length": 2})})

# the recipe's goals, checked on the stages' evaluations (hybridtron.recipe.render)
GOALS = (Raises("rlvr_raises_math", "math_pass_at_1", SFT, RLVR),
         RecoversAtLeast("mopd_recovers_half", MOPD_2, 0.5),
         RecoversMore("warmup_helps", MOPD_1, MOPD_NO_WARMUP, ("with_warmup", "without_warmup")),
         Raises("mtp_boost_raises_acceptance", "acceptance_length", MOPD_2, MTP_BOOST, ("before", "after")))

STAGES = (PRETRAIN, SFT, RLVR, MATH_TEACHER_SFT, MATH_TEACHER, CODE_TEACHER, CODE_TEACHER_RL, AGENTIC_TEACHER_SFT,
          AGENTIC_TEACHER, MOPD_WARMUP, MOPD_1, MOPD_2, MOPD_NO_WARMUP, MTP_BOOST)


def declared() -> dict[str, Stage]:
    """The stages by name, each after the stages it may read (read at each call: a test may declare one more)."""
    return {stage.name: stage for stage in in_order(STAGES)}


# ======================================================================================= the configuration
def preset_config(name: str) -> PipelineConfig:
    if name not in PRESET_SECTIONS:
        raise ValueError(f"--preset {name}: unknown pipeline preset; expected one of {', '.join(PRESET_SECTIONS)}")
    pipeline, evaluation = PRESET_SECTIONS[name]
    stages = {}
    for stage in declared().values():
        values = stage.presets[name]
        stages[stage.name] = StageConfig(enabled=values.enabled, steps=values.steps, data=dict(values.data), settings={
            key: typed_setting(stage, key, value) for key, value in values.settings.items()})
    return PipelineConfig(pipeline=dataclasses.replace(pipeline, preset=name), eval=evaluation, stages=stages)


def typed_setting(stage: Stage, key: str, value: Any) -> Any:
    """`value` (a TOML value, a --set text or a preset's value) as the type of the field `SECTION.FIELD` of the
    stage's command configuration; a ValueError naming the stage, its command and what was expected otherwise."""
    try:
        return field_value(stage.command, key, value)
    except ValueError as exc:
        raise ValueError(f"[{stage.name}] ({stage.command.name}): {exc}") from None


def field_value(command, key: str, value: Any) -> Any:
    """`typed_setting` for the configuration of `command`, its errors unprefixed."""
    section, _, name = key.partition(".")
    sections = command.section_names()
    if section == "model" and section not in sections:
        raise ValueError(f"{key}: [model] cannot be set here: the model is fixed by {command.config_class.MODEL_FROM} "
                         f"(the checkpoint this stage starts from); the stage trains its weights, not another "
                         f"architecture")
    if section not in sections:
        raise ValueError(f"{key}: unknown section {section!r}; expected one of {', '.join(sections)}")
    fields = typing.get_type_hints(typing.get_type_hints(command.config_class)[section])
    if name not in fields:
        raise ValueError(f"unknown {section} fields {[name]}; known: {', '.join(sorted(fields))}")
    return coerce_value(value, fields[name], key)


def apply_changes(config: PipelineConfig, changes: dict[str, dict[str, Any]], where: str) -> PipelineConfig:
    """`changes` (section -> field -> value; stage settings as `SECTION.FIELD` keys) applied to `config`, each
    field checked by its type (a stage's settings by their fields' types in its command's configuration). `where`
    names the source (a file, or --set) in errors."""
    sections = {"pipeline": config.pipeline, "eval": config.eval}
    stages, by_name = dict(config.stages), declared()
    for name, values in changes.items():
        if name in sections:
            sections[name] = build_section(type(sections[name]), {**section_values(sections[name]), **values}, name)
            continue
        if name not in stages:
            raise ValueError(f"{where}: unknown section [{name}]; expected [pipeline], [eval] or a stage: "
                             f"{', '.join(stages)}")
        stage, declaration = stages[name], by_name[name]
        plain = {k: v for k, v in values.items() if "." not in k}
        fields = ("enabled", "steps", *declaration.data_fields)
        unknown = sorted(set(plain) - set(fields))
        if unknown:
            raise ValueError(f"{where}: [{name}] has no field(s) {unknown}; this stage has {', '.join(fields)} and "
                             f"[{name}.SECTION] tables of its command's settings")
        typed = {k: coerce_value(v, bool if k == "enabled" else int, f"{name}.{k}") for k, v in plain.items()}
        settings = {**stage.settings, **{k: typed_setting(declaration, k, v) for k, v in values.items() if "." in k}}
        stages[name] = StageConfig(enabled=typed.pop("enabled", stage.enabled), steps=typed.pop("steps", stage.steps),
                                   data={**stage.data, **typed}, settings=settings)
    return PipelineConfig(pipeline=sections["pipeline"], eval=sections["eval"], stages=stages)


def pipeline_toml(config: PipelineConfig) -> str:
    """The configuration as the TOML file `--config` reads back, each stage under a comment naming its command."""
    lines = ["# hybridtron pipeline: one section per stage; [STAGE.SECTION] tables are the stage command's --set",
             ""]
    for name, obj in (("pipeline", config.pipeline), ("eval", config.eval)):
        lines += [f"[{name}]"] + [f"{k} = {toml_value(v)}" for k, v in section_values(obj).items()] + [""]
    for stage in declared().values():
        values = config.stages[stage.name]
        lines += [f"# {stage.what}: hybridtron {stage.command.name}", f"[{stage.name}]",
                  f"enabled = {toml_value(values.enabled)}", f"steps = {values.steps}"]
        lines += [f"{field} = {values.data[field]}" for field in stage.data_fields]
        tables: dict[str, list[str]] = {}
        for key, value in values.settings.items():
            section, _, field = key.partition(".")
            tables.setdefault(section, []).append(f"{field} = {toml_value(value)}")
        for section, table in tables.items():
            lines += ["", f"[{stage.name}.{section}]", *table]
        lines.append("")
    return "\n".join(lines)


def validate(config: PipelineConfig) -> None:
    """Every field of every enabled stage, checked before anything runs: its steps, its data fields, and its
    configuration as its command will run it (the same checks the command makes, an hour earlier)."""
    if config.pipeline.model_preset not in PRESETS:
        raise ValueError(f"pipeline.model_preset: unknown preset {config.pipeline.model_preset!r}; expected one of "
                         f"{', '.join(PRESETS)}")
    if config.pipeline.threads < 0:
        raise ValueError(f"pipeline.threads must be >= 0 (0: torch's default), got {config.pipeline.threads}")
    if not config.pipeline.levels or any(level < 1 for level in config.pipeline.levels):
        raise ValueError(f"pipeline.levels must be positive difficulty levels, got {list(config.pipeline.levels)}")
    config.eval.validate()
    base = config.pipeline.base_model
    for stage in declared().values():
        if base and stage.base and config.stages[stage.name].enabled:
            raise ValueError(f"pipeline.base_model = {base!r} replaces the {stage.name} stage; also set "
                             f"{stage.name}.enabled = false (--set {stage.name}.enabled=false), or use --base")
    if base and not (Path(base) / "config.json").is_file():
        raise FileNotFoundError(f"pipeline.base_model: {base} is not an HF checkpoint directory (no config.json)")
    for stage in declared().values():
        if stage.required and not (stage.base and base) and not config.stages[stage.name].enabled:
            raise ValueError(f"{stage.name}.enabled = false: the stage {stage.name} cannot be left out (the stages "
                             f"after it build on its model)")
    for stage in enabled_stages(config):
        for needed in stage.reads(config):
            if not config.stages[needed.name].enabled and not (needed.base and base):
                raise ValueError(f"{needed.name}.enabled = false: the stage {stage.name} builds on its model; enable "
                                 f"it, or set {stage.name}.enabled = false too")
    for stage in declared().values():
        values = config.stages[stage.name]
        if values.steps < 1:
            raise ValueError(f"{stage.name}.steps must be >= 1, got {values.steps}")
        for field, (least, meaning) in stage.data_fields.items():
            if values.data[field] < least:
                raise ValueError(f"{stage.name}.{field} must be >= {least} ({meaning}), got {values.data[field]}")
    for stage in enabled_stages(config):  # each enabled stage's configuration, built as it will run
        try:
            stage_run(stage.name, config, Path("OUT"), model=pipeline_model(config))
        except ValueError as exc:
            raise ValueError(f"[{stage.name}] ({stage.command.name}): {exc}") from None


def upstream(name: str, config: PipelineConfig) -> list[str]:
    """The stages whose models stage `name` reads."""
    return [stage.name for stage in declared()[name].reads(config)]


def enabled_stages(config: PipelineConfig) -> list[Stage]:
    return [stage for stage in declared().values() if config.stages[stage.name].enabled]


def active_stages(config: PipelineConfig) -> list[str]:
    return [stage.name for stage in enabled_stages(config)]


def data_draws(name: str, config: PipelineConfig) -> list[DataDraw]:
    """The environments' training tasks the data of stage `name` takes (none: it writes no SFT data)."""
    stage = declared()[name]
    return stage.data.draws(name, config.stages[name], config) if stage.data is not None else []


def check_data_tasks(config: PipelineConfig) -> None:
    """Before the first stage: each environment has the distinct training tasks the data of every enabled stage
    asks of it, at the pipeline's levels (a ValueError naming the setting otherwise)."""
    for stage in enabled_stages(config):
        for draw in data_draws(stage.name, config):
            with get_env(draw.domain, levels=tuple(config.pipeline.levels)) as env:
                try:
                    env.tasks("train", draw.examples, seed=draw.seed)
                except ValueError as exc:
                    raise ValueError(f"{draw.setting}: {exc}") from None


def write_stage_data(name: str, config: PipelineConfig, out: Path, log=None) -> int:
    """What stage `name`'s data writer writes before it runs (hybridtron.recipe.stage); returns its number of
    conversations."""
    return declared()[name].data.write(name, config, out, log)


# =========================================================================================== typed stages
def pipeline_model(config: PipelineConfig) -> ModelConfig:
    """The architecture every stage trains: the base checkpoint's, or the base stage's (its preset with its model.*
    settings)."""
    if config.pipeline.base_model:
        return ModelConfig.from_hf(config.pipeline.base_model)
    return stage_run(base_stage().name, config, Path("OUT"))[1].model


def base_stage() -> Stage:
    """The stage whose model `pipeline.base_model` (--base) replaces."""
    return next(stage for stage in declared().values() if stage.base)


def hf_dir(stage: Stage, config: PipelineConfig, out: Path) -> str:
    """Where the model of `stage` is (the base checkpoint stands in for the stage it replaces)."""
    if stage.base and config.pipeline.base_model:
        return str(Path(config.pipeline.base_model).resolve())
    return str(out / stage.name / "hf")


def stage_inputs(name: str, config: PipelineConfig, out: Path) -> dict[str, Any]:
    """The inputs of stage `name`'s run configuration: the checkpoints of the stages it builds on, its data."""
    return declared()[name].input_values(config, out, lambda stage: hf_dir(stage, config, out))


def stage_settings(name: str, config: PipelineConfig) -> list[tuple[str, Any]]:
    """What the pipeline sets on stage `name`'s configuration (its length, threads, and the `fixed` settings that
    make it part of the recipe), then the stage's own settings, which may change any of them: typed values by
    `SECTION.FIELD`, in the order its command line gives them."""
    stage, pipe = declared()[name], config.pipeline
    steps = config.stages[(stage.steps_of or stage).name].steps
    ours = [("train.steps", steps), ("train.threads", pipe.threads)]
    ours += [(key, tuple(pipe.levels) if value is LEVELS else value) for key, value in stage.fixed.items()]
    return ours + list(config.stages[name].settings.items())


def stage_run(name: str, config: PipelineConfig, out: Path, *, model: ModelConfig | None = None):
    """(the command, its run configuration) of stage `name` in the pipeline directory `out`: the command's
    configuration for the stage's inputs, then `stage_settings` set on its sections (typed values, each section
    replaced and validated as --set does). `model`: the architecture, where the checkpoint the stage starts from
    does not exist yet (checking the configuration before anything runs)."""
    stage = declared()[name]
    command, cls = stage.command, stage.command.config_class
    inputs = stage_inputs(name, config, out)
    if cls.MODEL_FROM is None:  # a model of its own: the pipeline's model preset, then its model.* settings
        base = cls(model=model_preset(config.pipeline.model_preset), **inputs)
    else:
        base = cls(model=model or command.model_config_of(inputs[cls.MODEL_FROM]), **inputs)
    changes: dict[str, dict[str, Any]] = {}
    for key, value in stage_settings(name, config):
        section, _, field = key.partition(".")
        changes.setdefault(section, {})[field] = field_value(command, key, value)
    updated = {}
    for section, values in changes.items():
        obj = getattr(base, section)
        updated[section] = obj.replace(**values) if isinstance(obj, ModelConfig) else dataclasses.replace(obj, **values)
        if hasattr(updated[section], "validate"):
            updated[section].validate()
    return command, dataclasses.replace(base, **updated)


def command_line(name: str, config: PipelineConfig, out: Path) -> str:
    """The command line that runs stage `name` by hand, with the configuration the pipeline gives it."""
    command = declared()[name].command
    inputs = stage_inputs(name, config, out)
    flags = []
    for item in command.inputs:
        value = inputs.get(item.field)
        if isinstance(value, dict):
            value = ",".join(f"{key}={directory}" for key, directory in value.items())
        if value is not None:
            flags += [item.flag, str(value)]
    if command.config_class.MODEL_FROM is None:
        flags += ["--preset", config.pipeline.model_preset]
    flags += ["--out", str(out / name)]
    for key, value in stage_settings(name, config):
        flags += ["--set", f"{key}={setting_text(value)}"]
    return shlex.join(["hybridtron", command.name, *flags])


def fingerprints(config: PipelineConfig, out: Path) -> dict[str, str]:
    """Each stage's fingerprint: a hash of its command line (and data) and of its upstream stages'. Paths are taken
    relative to `out`, so that a pipeline directory can be moved."""
    prints: dict[str, str] = {}
    for stage in enabled_stages(config):
        values = config.stages[stage.name]
        payload = {"command": command_line(stage.name, config, out).replace(str(out), "OUT"),
                   "data": {field: values.data[field] for field in stage.data_fields},
                   "upstream": [prints[u.name] for u in stage.reads(config) if u.name in prints]}
        prints[stage.name] = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
    return prints


def read_json(path: Path) -> dict | None:
    """A JSON file the pipeline wrote, or None when it is missing or half-written (a stage killed before it)."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
