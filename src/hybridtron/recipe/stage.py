"""What a stage of the recipe is (hybridtron.recipe; the stages themselves: hybridtron.recipe.stages): one
declaration, `Stage`, that carries everything about it, so that the pipeline's functions loop over the stages and
none of them asks a stage's name.

    Stage(name="rlvr", command=grpo.COMMAND, what="RLVR student (GRPO on math)",
          inputs={"base_model": SFT, "env": MATH_DOMAIN},        # the configuration's fields and where they come from
          fixed={"grpo.levels": LEVELS, "grpo.seed": 0},        # what the recipe sets (before the preset)
          presets={"tiny": preset(50, GRPO), "micro": preset(1, MICRO_GRPO)})

An input is another stage (its model's `OUT/<stage>/hf`), `First(A, B)` (A's model, or B's where A is off), a
mapping of them (MOPD's teachers by domain), a value (`"env:math"`) or `Written(fallback)` (the file the stage's
data writer writes, or `fallback` where it writes none). The stages a stage reads (its inputs' and its writer's)
are its upstream: they must run first, and its fingerprint includes theirs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from hybridtron.envs import get_env, write_jsonl
from hybridtron.post.mopd_warmup import warmup_conversations
from hybridtron.recipe.config import PipelineConfig, StageConfig
from hybridtron.train.run import RunCommand

DATA_FILE = "stage_data.jsonl"  # the conversations of a stage whose writer makes its SFT data, written before it runs
BOOST_PROMPTS = "boost_prompts.jsonl"  # MTP boosting's chat prompts (training-split tasks), written before it runs
TEACHER_TEMPERATURE = 0.5  # the teachers' sampling temperature for the warmup data: the rollouts' (GRPO's, MOPD's)
CODE_DOMAIN, MATH_DOMAIN = "code", "math"
# the agentic teacher's domain: the terminal tool environment's (its name too). math-python, the other tool
# environment, shares math's domain, so a mixture of it and math could not tell their teachers apart.
AGENTIC_DOMAIN = "terminal"
LEVELS = object()  # in `Stage.fixed`: the pipeline's levels (`[pipeline] levels`)


class First:
    """The model of the first enabled stage of `stages` (a teacher made with or without its optional stage)."""

    def __init__(self, *stages: Stage):
        self.stages = stages

    def pick(self, config: PipelineConfig) -> Stage:
        return next((s for s in self.stages if config.stages[s.name].enabled), self.stages[-1])


@dataclass(frozen=True)
class Written:
    """The file the stage's data writer writes, or `fallback` where it writes none (SFT without code: env:math)."""

    fallback: str = ""


def preset(steps: int, *settings: Mapping[str, Any], enabled: bool = True, **data: int) -> StageConfig:
    """A stage's values in a preset: its steps, its settings (typed, `SECTION.FIELD` -> value, later mappings
    over earlier ones) and its data fields."""
    merged: dict[str, Any] = {}
    for values in settings:
        merged.update(values)
    return StageConfig(enabled=enabled, steps=steps, data=data, settings=merged)


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


class DataWriter:
    """What a stage writes before its command runs. `fields`: its fields in the stage's section, name -> (the
    least value, what it means), checked before anything runs."""

    file = DATA_FILE
    fields: dict[str, tuple[int, str]] = {}

    sources: Mapping[str, Any] = {}  # the stages (or `First`s) whose models the data may be made with

    def reads(self, stage: StageConfig, config: PipelineConfig) -> list[Stage]:
        """The stages whose models the data is made with."""
        return []

    def draws(self, name: str, stage: StageConfig, config: PipelineConfig) -> list[DataDraw]:
        """The environments' training tasks it takes (checked against what they have before the first stage);
        empty: it writes nothing, and the stage reads its `Written` input's fallback."""
        return []

    def writes(self, name: str, stage: StageConfig, config: PipelineConfig) -> bool:
        return bool(self.draws(name, stage, config))

    def write(self, name: str, config: PipelineConfig, out: Path, log=None) -> int:
        """The conversations of `draws`, the environments' training splits at the pipeline's levels, as
        `OUT/<name>/stage_data.jsonl` (written whole or not at all); returns their number."""
        levels = tuple(config.pipeline.levels)
        examples = []
        for draw in self.draws(name, config.stages[name], config):
            with get_env(draw.domain, levels=levels) as env:
                kind = "verified" if draw.teacher else "env"
                max_tokens = domain_max_tokens(draw.domain, config)
                answered = warmup_conversations([(env, draw.examples)], kind, teacher_for=lambda _: str(
                    out / draw.teacher / "hf"), seed=draw.seed, temperature=TEACHER_TEMPERATURE,
                    max_tokens=lambda _: max_tokens, tries=draw.samples, batch_size=config.eval.batch_size,
                    setting=f"{draw.setting} (the {draw.teacher or 'worked solutions'})")
                if draw.teacher and log is not None:
                    log(f"[{name}] {draw.teacher}: {len(answered)} of {draw.examples} {draw.domain} tasks solved in "
                        f"{draw.samples} tries each")
                examples += answered
        path = out / name / self.file
        partial = path.with_name(path.name + ".partial")
        write_jsonl(partial, examples)
        partial.replace(path)
        return len(examples)


@dataclass(frozen=True)
class MixedSFTData(DataWriter):
    """Multi-domain SFT, as the report's: the math environment's worked solutions (`sft.env_examples` of them, as
    the SFT command draws them from env:math, with its `sft.seed`) and `code_examples` of the code environment's.
    `code_examples = 0`: none written; the stage reads env:math itself."""

    fields = {"code_examples": (0, "code worked solutions mixed in; 0: math alone")}
    defaults: Any = None  # the SFT command's section (its env_examples and seed where the stage sets none)

    def draws(self, name, stage, config):
        code = stage.data["code_examples"]
        if not code:
            return []
        math_examples = stage.settings.get("sft.env_examples", self.defaults.env_examples)
        seed = stage.settings.get("sft.seed", self.defaults.seed)
        return [DataDraw(MATH_DOMAIN, math_examples, seed, f"{name}.sft.env_examples={math_examples}"),
                DataDraw(CODE_DOMAIN, code, seed, f"{name}.code_examples={code}")]


@dataclass(frozen=True)
class TeacherData(DataWriter):
    """The MOPD warmup's data (hybridtron.post.mopd_warmup): `<domain>_examples` training tasks of each teacher's
    domain (`math_examples`, `code_examples`, `terminal_examples`), drawn with another seed than the SFT data, each
    answered by its domain's teacher up to `teacher_samples` times (the first answer the environment scores 1 kept;
    in a tool environment a whole trajectory), or by its worked solution (a tool environment's: an expert
    trajectory) with `teacher_samples = 0`."""

    teachers: Mapping[str, Any] = field(default_factory=dict)  # domain -> a Stage or First

    @property
    def fields(self):
        return {**{f"{domain}_examples": (1, "training tasks of that teacher's domain") for domain in self.teachers},
                "teacher_samples": (0, "each teacher's tries per task; 0: the worked solutions")}

    @property
    def sources(self):
        return self.teachers

    def reads(self, stage, config):
        return [resolve(source, config) for source in self.teachers.values()] if stage.data["teacher_samples"] else []

    def draws(self, name, stage, config):
        samples = stage.data["teacher_samples"]
        return [DataDraw(domain, stage.data[key], 1, f"{name}.{key}={stage.data[key]}",
                         resolve(source, config).name if samples else "", samples)
                for domain, source in self.teachers.items() for key in [f"{domain}_examples"]]


@dataclass(frozen=True)
class BoostPrompts(DataWriter):
    """MTP boosting's prompts: training-split math and code tasks as chat conversations (half each, twice the
    evaluation's acceptance prompts), so that the drafter learns on the kind of text the pipeline measures its
    acceptance on, not on text sampled from bos."""

    file = BOOST_PROMPTS

    def writes(self, name, stage, config):
        return True

    def write(self, name, config, out, log=None):
        conversations = []
        count = config.eval.acceptance_prompts * 2
        for domain in (MATH_DOMAIN, CODE_DOMAIN):
            with get_env(domain, levels=tuple(config.pipeline.levels)) as env:
                conversations += [{"messages": env.prompt_messages(task)}
                                  for task in env.tasks("train", domain_share(count, domain), seed=2)]
        path = out / name / self.file
        path.parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(path, conversations)
        return len(conversations)


@dataclass(frozen=True)
class Recovery:
    """A distilled stage's evaluation, as in the report's Table 5: per domain, the share of each teacher's lead
    over `baseline` that it won back (hybridtron.recipe.render)."""

    baseline: Stage
    teachers: Mapping[str, Any]  # domain -> a Stage or First


@dataclass(frozen=True, kw_only=True, eq=False)
class Stage:
    """One stage of the recipe: the command it runs (`what`: its line in the table and on the page); `inputs`, its
    run configuration's input fields and where each comes from; `fixed`, what the recipe sets on that
    configuration before the stage's own settings (typed, `SECTION.FIELD` -> value; `LEVELS`: the pipeline's);
    `data`, what it writes before it runs; `presets`, its section in each pipeline preset. `base`: the stage a
    `pipeline.base_model` replaces; `required`: the recipe cannot leave it out; `steps_of`: it trains as many steps
    as that stage (an ablation); `recovery`: it is measured as distillation."""

    name: str
    command: RunCommand
    what: str
    inputs: Mapping[str, Any] = field(default_factory=dict)
    fixed: Mapping[str, Any] = field(default_factory=dict)
    data: DataWriter | None = None
    presets: Mapping[str, StageConfig] = field(default_factory=dict)
    base: bool = False
    required: bool = False
    steps_of: Stage | None = None
    recovery: Recovery | None = None

    def may_read(self) -> set[Stage]:
        """Every stage this one may read, whichever are enabled: its place in the order follows from them."""
        found = set()
        for source in [*self.inputs.values(), *(self.data.sources.values() if self.data is not None else ())]:
            for item in source.values() if isinstance(source, Mapping) else (source,):
                found.update(item.stages if isinstance(item, First) else [item] if isinstance(item, Stage) else [])
        return found

    @property
    def data_fields(self) -> dict[str, tuple[int, str]]:
        return self.data.fields if self.data is not None else {}

    def reads(self, config: PipelineConfig) -> list[Stage]:
        """The stages whose models this stage reads, each once, in the order of its inputs then its data's."""
        found: list[Stage] = []
        for source in self.inputs.values():
            for item in source.values() if isinstance(source, Mapping) else (source,):
                if isinstance(item, (Stage, First)):
                    found.append(resolve(item, config))
        if self.data is not None:
            found += self.data.reads(config.stages[self.name], config)
        return list(dict.fromkeys(found))

    def input_values(self, config: PipelineConfig, out: Path, hf_dir: Callable[[Stage], str]) -> dict[str, Any]:
        """The inputs of the stage's run configuration in the pipeline directory `out`."""
        def value(source):
            if isinstance(source, Mapping):
                return {key: value(item) for key, item in source.items()}
            if isinstance(source, (Stage, First)):
                return hf_dir(resolve(source, config))
            if isinstance(source, Written):
                writes = self.data.writes(self.name, config.stages[self.name], config)
                return str(out / self.name / self.data.file) if writes else source.fallback
            return source
        return {key: value(source) for key, source in self.inputs.items()}


def in_order(stages: tuple[Stage, ...]) -> list[Stage]:
    """`stages` in an order where each comes after every stage it may read (the declared order where it is one)."""
    placed: list[Stage] = []
    while len(placed) < len(stages):
        ready = next((s for s in stages if s not in placed and s.may_read() <= set(placed)), None)
        if ready is None:
            waiting = [s.name for s in stages if s not in placed]
            raise ValueError(f"the stages {', '.join(waiting)} read each other's models (or an undeclared stage's)")
        placed.append(ready)
    return placed


def resolve(source: Stage | First, config: PipelineConfig) -> Stage:
    return source.pick(config) if isinstance(source, First) else source


def domain_max_tokens(domain: str, config: PipelineConfig) -> int:
    """The evaluation's completion cap in `domain` (in the agentic one, each turn's), which the warmup's teacher
    answers share."""
    ev = config.eval
    return {MATH_DOMAIN: ev.max_tokens, AGENTIC_DOMAIN: ev.agentic_max_tokens}.get(domain, ev.code_max_tokens)


def domain_share(n: int, domain: str) -> int:
    """Math's half of `n`, or code's (the rest)."""
    return n // 2 if domain == MATH_DOMAIN else n - n // 2


# ============================================================================================ the recipe's goals
def mean_recovery(values: Mapping[str, float | None]) -> float | None:
    kept = [v for v in values.values() if v is not None]
    return sum(kept) / len(kept) if kept else None


@dataclass(frozen=True)
class Raises:
    """`after`'s `metric` is above `before`'s (the two reported under `labels`, default the stages' names)."""

    name: str
    metric: str
    before: Stage
    after: Stage
    labels: tuple[str, str] = ()

    def check(self, rows: Mapping[str, dict], recoveries: Mapping[str, dict]) -> dict | None:
        if self.before.name not in rows or self.after.name not in rows:
            return None
        before, after = rows[self.before.name][self.metric], rows[self.after.name][self.metric]
        first, second = self.labels or (self.before.name, self.after.name)
        return {"met": after > before, first: before, second: after}


@dataclass(frozen=True)
class RecoversAtLeast:
    """`stage` won back at least `share` of every teacher's lead."""

    name: str
    stage: Stage
    share: float

    def check(self, rows, recoveries):
        if self.stage.name not in recoveries:
            return None
        values = recoveries[self.stage.name]
        return {"met": bool(values) and all(v is not None and v >= self.share for v in values.values()), **values}


@dataclass(frozen=True)
class RecoversMore:
    """`stage` won back more of the teachers' leads (its mean over domains) than `other`."""

    name: str
    stage: Stage
    other: Stage
    labels: tuple[str, str]

    def check(self, rows, recoveries):
        if self.stage.name not in recoveries or self.other.name not in recoveries:
            return None
        ours, theirs = mean_recovery(recoveries[self.stage.name]), mean_recovery(recoveries[self.other.name])
        return {"met": ours is not None and theirs is not None and ours > theirs,
                self.labels[0]: ours, self.labels[1]: theirs}
