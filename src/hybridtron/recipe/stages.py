"""The stages of the recipe, each a typed run of its command (hybridtron.recipe; their configuration:
hybridtron.recipe.config).

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

Each stage's configuration is the run configuration its command takes (`RunConfig`, `SFTRunConfig`, ...): its
inputs (the checkpoints of the stages it builds on, its data), then the stage's settings, `SECTION.FIELD=VALUE` as
`--set` takes them, applied by the same code (`hybridtron.train.config.change_config`): `stage_run` builds it, and
`command_line` prints the command that runs the same configuration by hand.

SFT is multi-domain, as the report's is: the math environment's worked solutions (`sft.env_examples`) and
`[sft] code_examples` of the code environment's, written to `OUT/sft/stage_data.jsonl` (`code_examples = 0`: math
alone, `--data env:math`). In a model this small a skill learnt after another overwrites it (docs/LOG.md, session 7):
a student that learns code only in the warmup loses its math there.

The teachers are specialists made from the multi-domain SFT model, each by SFT on its own domain and (for math,
and for code with `code_teacher_rl`) RLVR on top. The warmup is its own stage (the MOPD stages run with
`mopd.warmup_steps = 0`), so that the ablation compares two MOPD runs that differ in their starting point only: the
MOPD warmup of hybridtron.post.mopd_warmup, on `[mopd_warmup] math_examples` and `code_examples` training tasks each
answered by its domain's teacher up to `teacher_samples` times, the first answer the environment scores 1 kept
(`teacher_samples = 0`: the tasks' worked solutions instead), in `OUT/mopd_warmup/stage_data.jsonl`. (A teacher's
SFT data is here the student's own, so what the student has not seen of a teacher is its answers.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridtron.config import PRESETS, ModelConfig
from hybridtron.envs import get_env, write_jsonl
from hybridtron.post import grpo, mopd, mtp_boost, sft
from hybridtron.post.mopd_warmup import warmup_conversations
from hybridtron.train import pretrain
from hybridtron.recipe.config import (DATA_STAGES, PipelineConfig, setting_value, settings_tables)
from hybridtron.train.config import change_config, section_values, toml_value
from hybridtron.train.run import RunCommand

CONFIG_FILE = "pipeline_config.toml"  # the pipeline's resolved configuration; a later run in OUT starts from it
STAGE_FILE = "stage.json"  # written when a stage's command returned and its model was evaluated
EVAL_FILE = "eval.json"
RESULT_FILE = "pipeline.json"
HTML_FILE = "pipeline.html"
DATA_FILE = "stage_data.jsonl"  # the conversations of a DATA_STAGES stage, written before it runs
BOOST_PROMPTS = "boost_prompts.jsonl"  # mtp_boost's chat prompts (training-split tasks), written before it runs
TEACHER_TEMPERATURE = 0.5  # the teachers' sampling temperature for the warmup data: the rollouts' (GRPO's, MOPD's)
CODE_DOMAIN, MATH_DOMAIN = "code", "math"


@dataclass(frozen=True, kw_only=True)
class Stage:
    """One stage: the command that runs it, and one line for the table and the HTML page."""

    name: str
    command: RunCommand
    what: str


STAGES = (
    Stage(name="pretrain", command=pretrain.COMMAND, what="pretraining"),
    Stage(name="sft", command=sft.COMMAND, what="SFT on math and code worked solutions"),
    Stage(name="rlvr", command=grpo.COMMAND, what="RLVR student (GRPO on math)"),
    Stage(name="math_teacher_sft", command=sft.COMMAND, what="math teacher (math SFT)"),
    Stage(name="math_teacher", command=grpo.COMMAND, what="math teacher (math RLVR)"),
    Stage(name="code_teacher", command=sft.COMMAND, what="code teacher (code SFT)"),
    Stage(name="code_teacher_rl", command=grpo.COMMAND, what="code teacher (code RLVR)"),
    Stage(name="mopd_warmup", command=sft.COMMAND, what="MOPD warmup (teachers' data)"),
    Stage(name="mopd_1", command=mopd.COMMAND, what="MOPD iteration 1"),
    Stage(name="mopd_2", command=mopd.COMMAND, what="MOPD iteration 2"),
    Stage(name="mopd_no_warmup", command=mopd.COMMAND, what="MOPD without warmup (ablation)"),
    Stage(name="mtp_boost", command=mtp_boost.COMMAND, what="MTP boosting"),
)
STAGE_BY_NAME = {stage.name: stage for stage in STAGES}


def pipeline_toml(config: PipelineConfig) -> str:
    """The configuration as the TOML file `--config` reads back, each stage under a comment naming its command."""
    lines = ["# hybridtron pipeline: one section per stage; [STAGE.SECTION] tables are the stage command's --set",
             ""]
    for name, obj in (("pipeline", config.pipeline), ("eval", config.eval)):
        lines += [f"[{name}]"] + [f"{k} = {toml_value(v)}" for k, v in section_values(obj).items()] + [""]
    for name, stage in config.stages.items():
        lines += [f"# {STAGE_BY_NAME[name].what}: hybridtron {STAGE_BY_NAME[name].command.name}", f"[{name}]",
                  f"enabled = {toml_value(stage.enabled)}", f"steps = {stage.steps}"]
        lines += [f"{field} = {getattr(stage, field)}" for field in DATA_STAGES.get(name, ())]
        for section, values in settings_tables(stage.settings).items():
            lines += ["", f"[{name}.{section}]"] + [f"{k} = {toml_value(setting_value(v))}" for k, v in values.items()]
        lines.append("")
    return "\n".join(lines)




def validate(config: PipelineConfig) -> None:
    """Every field of every enabled stage, checked before anything runs: its steps, and its command settings
    against the command's own configuration (the same checks the command makes, an hour earlier)."""
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
    for name in active_stages(config):  # each enabled stage's configuration, built as it will run
        try:
            stage_run(name, config, Path("OUT"), model=pipeline_model(config))
        except ValueError as exc:
            raise ValueError(f"[{name}] ({STAGE_BY_NAME[name].command.name}): {exc}") from None


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
    stage = config.stages[name]
    code = f"{name}.code_examples={stage.code_examples}"
    if name == "mopd_warmup":
        teachers = teacher_stages(config) if stage.teacher_samples else {}
        return [DataDraw(domain, examples, 1, setting, teachers.get(domain, ""), stage.teacher_samples)
                for domain, examples, setting in (
                    (MATH_DOMAIN, stage.math_examples, f"{name}.math_examples={stage.math_examples}"),
                    (CODE_DOMAIN, stage.code_examples, code))]
    if name == "sft" and stage.code_examples:
        math_examples = int(stage.setting("sft.env_examples") or sft.SFTConfig.env_examples)
        seed = int(stage.setting("sft.seed") or sft.SFTConfig.seed)
        return [DataDraw(MATH_DOMAIN, math_examples, seed, f"sft.sft.env_examples={math_examples}"),
                DataDraw(CODE_DOMAIN, stage.code_examples, seed, code)]
    return []


def check_data_tasks(config: PipelineConfig) -> None:
    """Before the first stage: each environment has the distinct training tasks the data of every enabled stage
    asks of it, at the pipeline's levels (a ValueError naming the setting otherwise)."""
    for name in active_stages(config):
        for draw in data_draws(name, config):
            with get_env(draw.domain, levels=tuple(config.pipeline.levels)) as env:
                try:
                    env.tasks("train", draw.examples, seed=draw.seed)
                except ValueError as exc:
                    raise ValueError(f"{draw.setting}: {exc}") from None


# =========================================================================================== typed stages
def pipeline_model(config: PipelineConfig) -> ModelConfig:
    """The architecture every stage trains: the base checkpoint's, or the pretrain stage's preset with its model.*
    settings."""
    if config.pipeline.base_model:
        return ModelConfig.from_hf(config.pipeline.base_model)
    return stage_run("pretrain", config, Path("OUT"))[1].model


def hf_dir(stage_name: str, config: PipelineConfig, out: Path) -> str:
    """Where the model of stage `stage_name` is (the base checkpoint stands in for pretraining)."""
    if stage_name == "pretrain" and config.pipeline.base_model:
        return str(Path(config.pipeline.base_model).resolve())
    return str(out / stage_name / "hf")


def stage_inputs(name: str, config: PipelineConfig, out: Path) -> dict[str, Any]:
    """The inputs of stage `name`'s run configuration: the checkpoints of the stages it builds on, its data."""
    stage = config.stages[name]
    if name == "sft":
        return {"base_model": hf_dir("pretrain", config, out),
                "data": str(out / name / DATA_FILE) if stage.code_examples else "env:math"}
    if name in ("rlvr", "math_teacher"):
        return {"base_model": hf_dir("sft" if name == "rlvr" else math_teacher_base(config), config, out),
                "env": MATH_DOMAIN}
    if name in ("math_teacher_sft", "code_teacher"):
        return {"base_model": hf_dir("sft", config, out),
                "data": "env:math" if name == "math_teacher_sft" else "env:code"}
    if name == "code_teacher_rl":
        return {"base_model": hf_dir("code_teacher", config, out), "env": CODE_DOMAIN}
    if name == "mopd_warmup":
        return {"base_model": hf_dir("rlvr", config, out), "data": str(out / name / DATA_FILE)}
    if name.startswith("mopd_"):
        student = {"mopd_1": "mopd_warmup", "mopd_2": "mopd_1", "mopd_no_warmup": "rlvr"}[name]
        return {"student": hf_dir(student, config, out), "general": hf_dir("rlvr", config, out),
                "teachers": {domain: hf_dir(teacher, config, out) for domain, teacher in teacher_stages(config).items()}}
    if name == "mtp_boost":
        return {"base_model": hf_dir("mopd_2", config, out), "prompts": str(out / name / BOOST_PROMPTS)}
    return {}


def stage_settings(name: str, config: PipelineConfig) -> list[str]:
    """What the pipeline sets on stage `name`'s configuration (its length, threads, levels and the settings that
    make it part of the recipe), then the stage's own settings, which may change any of them."""
    stage, pipe = config.stages[name], config.pipeline
    levels = ",".join(map(str, pipe.levels))
    steps = config.stages["mopd_1"].steps if name == "mopd_no_warmup" else stage.steps
    ours = [f"train.steps={steps}", f"train.threads={pipe.threads}"]
    if name in ("sft", "math_teacher_sft", "code_teacher"):
        ours.append(f"sft.env_levels={levels}")
    elif name in ("rlvr", "math_teacher", "code_teacher_rl"):
        ours.append(f"grpo.levels={levels}")
        if name != "code_teacher_rl":
            ours.append(f"grpo.seed={1 if name == 'math_teacher' else 0}")
    elif name.startswith("mopd_") and name != "mopd_warmup":
        ours += ["mopd.warmup_steps=0", f"mopd.levels={levels}", "mopd.eval_tasks=0"]
    return ours + list(stage.settings)


def stage_run(name: str, config: PipelineConfig, out: Path, *, model: ModelConfig | None = None):
    """(the command, its run configuration) of stage `name` in the pipeline directory `out`: the command's defaults
    for the stage's inputs, then `stage_settings` applied as --set applies them. `model`: the architecture, where
    the checkpoint the stage starts from does not exist yet (checking the configuration before anything runs)."""
    command = STAGE_BY_NAME[name].command
    inputs = stage_inputs(name, config, out)
    if name == "pretrain":
        base = command.default_config(argparse.Namespace(preset=config.pipeline.model_preset), inputs)
    elif model is not None:
        base = command.config_class(model=model, **inputs)
    else:
        base = command.default_config(argparse.Namespace(), inputs)
    return command, change_config(base, None, stage_settings(name, config))


def command_line(name: str, config: PipelineConfig, out: Path) -> str:
    """The command line that runs stage `name` by hand, with the configuration the pipeline gives it."""
    command = STAGE_BY_NAME[name].command
    inputs = stage_inputs(name, config, out)
    flags = []
    for item in command.inputs:
        value = inputs.get(item.field)
        if isinstance(value, dict):
            value = ",".join(f"{key}={directory}" for key, directory in value.items())
        if value is not None:
            flags += [item.flag, str(value)]
    if name == "pretrain":
        flags += ["--preset", config.pipeline.model_preset]
    flags += ["--out", str(out / name)]
    for setting in stage_settings(name, config):
        flags += ["--set", setting]
    return shlex.join(["hybridtron", command.name, *flags])


def fingerprints(config: PipelineConfig, out: Path) -> dict[str, str]:
    """Each stage's fingerprint: a hash of its command line (and data) and of its upstream stages'. Paths are taken
    relative to `out`, so that a pipeline directory can be moved."""
    prints: dict[str, str] = {}
    for name in active_stages(config):
        stage = config.stages[name]
        payload = {"command": command_line(name, config, out).replace(str(out), "OUT"),
                   "data": {field: getattr(stage, field) for field in DATA_STAGES.get(name, ())},
                   "upstream": [prints[u] for u in upstream(name, config) if u in prints]}
        prints[name] = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
    return prints


# ================================================================================================= data
def write_stage_data(name: str, config: PipelineConfig, out: Path, log=None) -> int:
    """The conversations of stage `name` (see `data_draws`), the environments' training splits at the pipeline's
    levels, as `OUT/<name>/stage_data.jsonl` (written whole or not at all); returns their number. The warmup's are
    the MOPD warmup's data (hybridtron.post.mopd_warmup)."""
    levels = tuple(config.pipeline.levels)
    examples = []
    for draw in data_draws(name, config):
        with get_env(draw.domain, levels=levels) as env:
            kind = "verified" if draw.teacher else "env"
            max_tokens = config.eval.max_tokens if draw.domain == MATH_DOMAIN else config.eval.code_max_tokens
            answered = warmup_conversations([(env, draw.examples)], kind, teacher_for=lambda _: str(
                out / draw.teacher / "hf"), seed=draw.seed, temperature=TEACHER_TEMPERATURE,
                max_tokens=lambda _: max_tokens, tries=draw.samples, batch_size=config.eval.batch_size,
                setting=f"{draw.setting} (the {draw.teacher or 'worked solutions'})")
            if draw.teacher and log is not None:
                log(f"[{name}] {draw.teacher}: {len(answered)} of {draw.examples} {draw.domain} tasks solved in "
                    f"{draw.samples} tries each")
            examples += answered
    path = out / name / DATA_FILE
    partial = path.with_name(path.name + ".partial")
    write_jsonl(partial, examples)
    partial.replace(path)
    return len(examples)


def write_boost_prompts(config: PipelineConfig, path: Path) -> None:
    """MTP boosting's prompts: training-split math and code tasks as chat conversations (half each), so that the
    drafter learns on the kind of text the pipeline measures its acceptance on, not on text sampled from bos."""
    conversations = []
    count = config.eval.acceptance_prompts * 2
    for domain in (MATH_DOMAIN, CODE_DOMAIN):
        with get_env(domain, levels=tuple(config.pipeline.levels)) as env:
            conversations += [{"messages": env.prompt_messages(task)}
                              for task in env.tasks("train", domain_share(count, domain), seed=2)]
    path.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(path, conversations)


def domain_share(n: int, domain: str) -> int:
    """Math's half of `n`, or code's (the rest)."""
    return n // 2 if domain == MATH_DOMAIN else n - n // 2


def read_json(path: Path) -> dict | None:
    """A JSON file the pipeline wrote, or None when it is missing or half-written (a stage killed before it)."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
