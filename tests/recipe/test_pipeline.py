"""`hybridtron pipeline`: the micro preset end to end (every stage, the table, the page), a second run that skips
every finished stage, a stage killed in the middle and resumed, and the configuration's clear errors."""

from __future__ import annotations

import json
import shlex
import shutil
from argparse import Namespace

import pytest

from hybridtron.cli import main as cli_main
from hybridtron.envs import get_env
from hybridtron.envs.math import MathEnv
from hybridtron.post.mopd_warmup import warmup_conversations
from hybridtron.recipe import stage as stage_module
from hybridtron.recipe import stages as S
from hybridtron.recipe.pipeline import resolve_config
from hybridtron.recipe.render import format_table, recovery
from hybridtron.recipe.stage import DATA_FILE, TEACHER_TEMPERATURE
from hybridtron.recipe.stages import (HTML_FILE, RESULT_FILE, STAGE_FILE, active_stages, apply_changes, command_line,
                                      data_draws, fingerprints, pipeline_model, preset_config, stage_run, upstream,
                                      write_stage_data)

STAGES = [stage.name for stage in S.STAGES if stage.name != "code_teacher_rl"]  # off in the presets


@pytest.fixture(scope="module")
def micro_run(tmp_path_factory):
    """The micro pipeline run once (about a minute on a busy 2-core machine): its directory and its output."""
    root = tmp_path_factory.mktemp("pipeline")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HYBRIDTRON_CACHE", str(root / "cache"))
        assert cli_main(["pipeline", "--preset", "micro", "--out", str(root / "pipe")]) == 0
    return root / "pipe"


def test_micro_pipeline_runs_every_stage_and_writes_the_table(micro_run):
    result = json.loads((micro_run / RESULT_FILE).read_text())
    assert [row["stage"] for row in result["stages"]] == STAGES
    assert result["missing"] == []
    for name in STAGES:
        assert (micro_run / name / "hf" / "config.json").is_file(), name
        record = json.loads((micro_run / name / STAGE_FILE).read_text())
        assert record["fingerprint"] and record["seconds"] > 0
    for row in result["stages"]:
        for key in ("math_pass_at_1", "code_pass_rate", "code_pass_at_1", "terminal_pass_at_1", "val_loss",
                    "acceptance_length"):
            assert isinstance(row[key], float), (row["stage"], key)
        assert 1.0 <= row["acceptance_length"] <= 1 + 2  # draft length 2 in the micro preset
    assert set(result["recovery"]) == {"mopd_1", "mopd_2", "mopd_no_warmup"}
    # the ablation without warmup measures every teacher's domain, the agentic one's included
    assert all(set(values) == {"math", "code", "terminal"} for values in result["recovery"].values())
    assert set(result["goals"]) == {"rlvr_raises_math", "mopd_recovers_half", "warmup_helps",
                                    "mtp_boost_raises_acceptance"}
    # each stage built on the one before it: the MOPD student of iteration 2 is iteration 1's model
    mopd_2 = json.loads((micro_run / "mopd_2" / "run_config.json").read_text())
    assert mopd_2["student"] == str(micro_run / "mopd_1" / "hf")
    assert mopd_2["teachers"] == {"math": str(micro_run / "math_teacher" / "hf"),
                                  "code": str(micro_run / "code_teacher" / "hf"),
                                  "terminal": str(micro_run / "agentic_teacher" / "hf")}
    assert mopd_2["mopd"]["envs"] == ["math", "code", "terminal"]  # each teacher's domain among the prompts
    assert mopd_2["mopd"]["warmup_steps"] == 0  # the warmup is its own stage
    no_warmup = json.loads((micro_run / "mopd_no_warmup" / "run_config.json").read_text())
    assert no_warmup["student"] == str(micro_run / "rlvr" / "hf")
    page = (micro_run / HTML_FILE).read_text()
    assert "<table>" in page and page.count("data:image/png;base64") >= len(STAGES)
    assert "| mopd_2 |" in format_table(result)


def test_a_second_run_skips_every_finished_stage(micro_run, capsys):
    before = {name: (micro_run / name / STAGE_FILE).stat().st_mtime_ns for name in STAGES}
    assert cli_main(["pipeline", "--preset", "micro", "--out", str(micro_run)]) == 0
    err = capsys.readouterr().err
    for name in STAGES:
        assert f"[{name}] done" in err and "skipped" in err
        assert (micro_run / name / STAGE_FILE).stat().st_mtime_ns == before[name]
    assert "running:" not in err
    # the directory was run with the micro preset: another is refused, not mixed in
    assert cli_main(["pipeline", "--preset", "tiny", "--out", str(micro_run)]) == 2
    assert "was resolved from the micro preset; leave --preset out to use it" in capsys.readouterr().err


def _copy_stages(source, target, names):
    for name in names:
        shutil.copytree(source / name, target / name)


def test_a_killed_stage_resumes_where_it_stopped(micro_run, tmp_path, monkeypatch, capsys):
    """The RLVR stage killed right after its step-1 checkpoint: the next run skips pretrain and sft (copied from a
    finished pipeline: fingerprints do not depend on where the directory is) and resumes RLVR from step 1."""
    from hybridtron.train.loop import Trainer

    out = tmp_path / "pipe"
    _copy_stages(micro_run, out, ["pretrain", "sft"])
    overrides = ["--set", "rlvr.steps=3", "--set", "rlvr.train.checkpoint_every=1"]
    real_save = Trainer.save_checkpoint

    def save_then_die(self, blocking=False):
        real_save(self, blocking=True)
        if self.step == 1:
            raise KeyboardInterrupt  # the machine went away after the step-1 checkpoint

    monkeypatch.setattr(Trainer, "save_checkpoint", save_then_die)
    # stopped at once (as by a second Ctrl-C): one line and exit status 130, not a traceback
    assert cli_main(["pipeline", "--preset", "micro", "--out", str(out), "--stop-after", "rlvr", *overrides]) == 130
    assert "hybridtron pipeline: interrupted at once" in capsys.readouterr().err
    assert not (out / "rlvr" / STAGE_FILE).exists()
    assert (out / "rlvr" / "checkpoints" / "step_000001").is_dir()
    monkeypatch.setattr(Trainer, "save_checkpoint", real_save)
    capsys.readouterr()

    # the directory remembers its configuration: the plain command continues it, the --set included
    assert cli_main(["pipeline", "--out", str(out), "--stop-after", "rlvr"]) == 0
    err = capsys.readouterr().err
    assert f"[pipeline] continuing in {out} with its configuration" in err
    assert "[pretrain] done" in err and "[sft] done" in err
    assert "[rlvr] resuming" in err and "(step 1)" in err
    steps = [json.loads(line)["step"] for line in (out / "rlvr" / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 3 and (out / "rlvr" / STAGE_FILE).is_file()
    result = json.loads((out / RESULT_FILE).read_text())
    assert [row["stage"] for row in result["stages"]] == ["pretrain", "sft", "rlvr"]
    assert "math_teacher" in result["missing"]


def test_a_finished_stage_run_with_another_configuration_is_refused(micro_run, tmp_path, capsys):
    out = tmp_path / "pipe"
    _copy_stages(micro_run, out, ["pretrain", "sft"])
    assert cli_main(["pipeline", "--preset", "micro", "--out", str(out), "--set", "sft.steps=3"]) == 2
    err = capsys.readouterr().err
    assert f"{out / 'sft'}: this stage was run with another configuration" in err


def test_a_change_to_a_finished_stage_is_refused_before_the_stages_before_it_run(micro_run, tmp_path, capsys):
    """pretrain not run yet, sft finished: a pretrain changed by --set would change what sft built on, so the run
    stops at once, not after pretraining."""
    out = tmp_path / "pipe"
    _copy_stages(micro_run, out, ["sft"])
    assert cli_main(["pipeline", "--preset", "micro", "--out", str(out), "--set", "pretrain.steps=3"]) == 2
    assert f"{out / 'sft'}: this stage was run with another configuration" in capsys.readouterr().err
    assert not (out / "pretrain").exists()


@pytest.mark.parametrize("overrides, message", [
    (["--set", "rlvr.grpo.group_size=1"], "[rlvr] (grpo): grpo.group_size must be >= 2"),
    (["--set", "mopd_1.mopd.prompts_per_step=0"], "[mopd_1] (mopd): mopd.prompts_per_step must be >= 1"),
    (["--set", "sft.train.lr=fast"], "[sft] (sft): train.lr: expected float"),
    (["--set", "pretrain.model.mamba_num_heads=5"], "mamba_num_heads (5) must be divisible by n_groups"),
    (["--set", "mtp_boost.boost.bogus=1"], "[mtp_boost] (mtp-boost): unknown boost fields ['bogus']"),
    (["--set", "rlvr.optim.lr=1"], "[rlvr] (grpo): optim.lr: unknown section 'optim'; expected one of"),
    (["--set", "rlvr.model.hidden_size=8"], "[rlvr] (grpo): model.hidden_size: [model] cannot be set here"),
    (["--set", "nope.steps=1"], "unknown section [nope]"),
    (["--set", "rlvr.stepz=3"], "[rlvr] has no field(s) ['stepz']"),
    (["--set", "rlvr.teacher_samples=2"], "[rlvr] has no field(s) ['teacher_samples']"),
    (["--set", "mopd_warmup.teacher_samples=-1"], "mopd_warmup.teacher_samples must be >= 0"),
    (["--set", "rlvr.steps=0"], "rlvr.steps must be >= 1"),
    (["--set", "rlvr.steps=many"], "rlvr.steps: expected int"),
    (["--set", "sft.enabled=false"], "the stage sft cannot be left out"),
    (["--set", "math_teacher.enabled=false"], "math_teacher.enabled = false: the stage mopd_1 builds on its model"),
    (["--set", "agentic_teacher.enabled=false"], "agentic_teacher.enabled = false: the stage mopd_1 builds on its"),
    (["--set", "mopd_warmup.terminal_examples=0"], "mopd_warmup.terminal_examples must be >= 1"),
    (["--set", "mopd_1.mopd.domain_weights=0.75,0.25"], "mopd.domain_weights has 2 weights for 3 environments"),
    (["--set", "pipeline.model_preset=huge"], "pipeline.model_preset: unknown preset 'huge'"),
    (["--set", "pipeline.levels=0"], "pipeline.levels must be positive difficulty levels"),
    (["--set", "eval.math_tasks=0"], "eval.math_tasks must be >= 1"),
    (["--set", "rlvr"], "expected STAGE.FIELD=VALUE"),
    (["--set", "pipeline.preset=tiny"], "use --preset"),
    (["--base", "/no/such/model"], "--base /no/such/model: no such directory"),
    (["--set", "pipeline.base_model=/no/such/model", "--set", "pretrain.enabled=false"],
     "pipeline.base_model: /no/such/model is not an HF checkpoint directory"),
    (["--set", "pipeline.base_model=."], "also set pretrain.enabled = false"),
])
def test_bad_configuration_gives_a_clear_error_before_anything_runs(tmp_path, capsys, overrides, message):
    out = tmp_path / "pipe"
    assert cli_main(["pipeline", "--preset", "micro", "--out", str(out), *overrides]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_a_warmup_asking_for_more_tasks_than_a_domain_has_fails_before_the_first_stage(tmp_path, capsys):
    out = tmp_path / "pipe"
    assert cli_main(["pipeline", "--preset", "micro", "--out", str(out),
                     "--set", "mopd_warmup.code_examples=5000"]) == 2
    assert "mopd_warmup.code_examples=5000: " in capsys.readouterr().err
    assert not (out / "pretrain").exists()


def test_an_sft_asking_for_more_code_tasks_than_there_are_fails_before_the_first_stage(tmp_path, capsys):
    out = tmp_path / "pipe"
    assert cli_main(["pipeline", "--preset", "micro", "--out", str(out), "--set", "sft.code_examples=5000"]) == 2
    assert "sft.code_examples=5000: " in capsys.readouterr().err
    assert not (out / "pretrain").exists()


def logged_flag(name, config, out, flag):
    """The value of `flag` in the command line the pipeline logs for stage `name`."""
    argv = shlex.split(command_line(name, config, out))
    return argv[argv.index(flag) + 1]


def test_the_sft_stage_mixes_code_solutions_into_the_math_ones(tmp_path):
    """`[sft] code_examples = N`: the stage trains on a file of `sft.env_examples` math and N code worked solutions (the
    multi-domain SFT), written before it runs; without it, on env:math. The stage's run configuration and the command
    line it logs say the same."""
    config = apply_changes(preset_config("micro"), {"sft": {"code_examples": 3}}, "test")
    model = pipeline_model(config)  # the stages before it have not run: their checkpoints do not exist yet
    assert stage_run("sft", config, tmp_path, model=model)[1].data == str(tmp_path / "sft" / DATA_FILE)
    assert logged_flag("sft", config, tmp_path, "--data") == str(tmp_path / "sft" / DATA_FILE)
    assert write_stage_data("sft", config, tmp_path) == 40 + 3  # micro: sft.env_examples=40
    lines = (tmp_path / "sft" / DATA_FILE).read_text().splitlines()
    assert [json.loads(line)["domain"] for line in lines] == ["math"] * 40 + ["code"] * 3
    math_only = apply_changes(config, {"sft": {"code_examples": 0}}, "test")
    assert stage_run("sft", math_only, tmp_path, model=model)[1].data == "env:math"
    assert logged_flag("sft", math_only, tmp_path, "--data") == "env:math" and data_draws("sft", math_only) == []


def test_the_math_teacher_is_math_sft_then_math_rlvr_or_the_students_rlvr_continued(tmp_path):
    config = preset_config("micro")
    model = pipeline_model(config)
    teacher_sft = stage_run("math_teacher_sft", config, tmp_path, model=model)[1]
    assert (teacher_sft.base_model, teacher_sft.data) == (str(tmp_path / "sft" / "hf"), "env:math")
    teacher = stage_run("math_teacher", config, tmp_path, model=model)[1]
    assert (teacher.base_model, teacher.env) == (str(tmp_path / "math_teacher_sft" / "hf"), "math")
    assert logged_flag("math_teacher", config, tmp_path, "--model") == str(tmp_path / "math_teacher_sft" / "hf")
    continued = apply_changes(config, {"math_teacher_sft": {"enabled": False}}, "test")
    assert stage_run("math_teacher", continued, tmp_path, model=model)[1].base_model == str(tmp_path / "rlvr" / "hf")
    assert upstream("math_teacher", continued) == ["rlvr"] and "math_teacher_sft" not in active_stages(continued)


def test_the_warmup_data_are_each_teachers_verified_answers(micro_run, tmp_path, monkeypatch):
    """With `teacher_samples = k` a warmup task keeps the first of its teacher's k tries that the environment
    scores 1 (here: any answer of odd length), a task never solved is left out, and one more try only adds tasks:
    try j of a task is the same sample whatever k is. A teacher that solves nothing is an error naming the stage's
    setting and the teacher, before the stage runs."""
    config = apply_changes(preset_config("micro"), {"mopd_warmup": {"teacher_samples": 3}}, "test")
    math_draw, code_draw, terminal_draw = data_draws("mopd_warmup", config)
    assert (math_draw.teacher, math_draw.samples, code_draw.teacher) == ("math_teacher", 3, "code_teacher")
    assert (terminal_draw.domain, terminal_draw.teacher) == ("terminal", "agentic_teacher")
    assert set(upstream("mopd_warmup", config)) == {"rlvr", "math_teacher", "code_teacher", "agentic_teacher"}
    teacher = micro_run / "math_teacher" / "hf"

    def verified(env, tries):  # the warmup's data (hybridtron.post.mopd_warmup), as the stage draws its math part
        return warmup_conversations([(env, math_draw.examples)], "verified", teacher_for=lambda _: str(teacher),
                                    seed=math_draw.seed, temperature=TEACHER_TEMPERATURE,
                                    max_tokens=lambda _: config.eval.max_tokens, tries=tries,
                                    batch_size=config.eval.batch_size)

    with get_env("math", levels=(1,)) as env:
        env.rewards = lambda tasks, completions: [float(len(c) % 2) for c in completions]
        once, thrice = verified(env, 1), verified(env, 3)

    def answers(examples):
        return {ex["messages"][-2]["content"]: ex["messages"][-1]["content"] for ex in examples}

    assert 0 < len(once) <= len(thrice) <= 20
    assert all(len(answer) % 2 for answer in answers(thrice).values())
    assert answers(once).items() <= answers(thrice).items()
    assert all(ex["domain"] == "math" and ex["messages"][-1]["role"] == "assistant" for ex in thrice)

    out = tmp_path / "pipe"  # the stage itself, in a directory holding the math teacher's model
    shutil.copytree(teacher, out / "math_teacher" / "hf")
    monkeypatch.setattr(MathEnv, "rewards", lambda self, tasks, completions: [0.0] * len(completions))
    with pytest.raises(ValueError, match=r"mopd_warmup.math_examples=20 \(the math_teacher\): the teacher .* solved "
                                         r"none of 20 math training tasks in 3 tries each"):
        write_stage_data("mopd_warmup", config, out)
    assert not (out / "mopd_warmup" / DATA_FILE).exists()


def test_the_warmup_stage_writes_its_teachers_answers_before_it_runs(tmp_path, monkeypatch):
    config = apply_changes(preset_config("micro"), {"mopd_warmup": {"teacher_samples": 2}}, "test")
    asked = []

    def answered(draws, kind, *, teacher_for, tries, **options):
        ((env, examples),) = draws
        asked.append((teacher_for(env.domain), env.domain, examples, kind, tries))
        return [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                 "domain": env.domain}]

    monkeypatch.setattr(stage_module, "warmup_conversations", answered)
    lines = []
    assert write_stage_data("mopd_warmup", config, tmp_path, lines.append) == 3
    assert asked == [(str(tmp_path / "math_teacher" / "hf"), "math", 20, "verified", 2),
                     (str(tmp_path / "code_teacher" / "hf"), "code", 20, "verified", 2),
                     (str(tmp_path / "agentic_teacher" / "hf"), "terminal", 2, "verified", 2)]
    rows = [json.loads(line) for line in (tmp_path / "mopd_warmup" / DATA_FILE).read_text().splitlines()]
    assert [row["domain"] for row in rows] == ["math", "code", "terminal"]
    assert lines[0] == "[mopd_warmup] math_teacher: 1 of 20 math tasks solved in 2 tries each"
    assert not list((tmp_path / "mopd_warmup").glob("*.partial"))


@pytest.mark.parametrize("text, message", [
    ("[rlvr\nsteps = 3", "invalid TOML"),
    ("[optimizer]\nlr = 1", "unknown section [optimizer]"),
    ("steps = 3", "outside a section"),
    ("[eval.math]\nx = 1", "only stages have sub-tables"),
    ("[pipeline]\npreset = \"huge\"", "[pipeline] preset = 'huge': unknown pipeline preset"),
    ("[pipeline]\npreset = \"tiny\"", "was resolved from the tiny preset"),
])
def test_bad_config_file_gives_a_clear_error(tmp_path, capsys, text, message):
    path = tmp_path / "pipe.toml"
    path.write_text(text)
    assert cli_main(["pipeline", "--preset", "micro", "--out", str(tmp_path / "pipe"), "--config", str(path)]) == 2
    assert message in capsys.readouterr().err
    assert cli_main(["pipeline", "--out", str(tmp_path / "pipe"), "--config", str(tmp_path / "none.toml")]) == 2
    assert "config file not found" in capsys.readouterr().err


def test_print_config_is_a_config_file_that_reads_back_the_same(tmp_path, capsys):
    assert cli_main(["pipeline", "--preset", "micro", "--print-config", "--set", "rlvr.steps=4",
                     "--set", "rlvr.grpo.levels=1,2", "--set", "eval.math_tasks=7"]) == 0
    text = capsys.readouterr().out
    assert "[rlvr.grpo]" in text and "levels = [1, 2]" in text
    path = tmp_path / "pipe.toml"
    path.write_text(text)
    args = Namespace(preset="micro", config=None, overrides=["rlvr.steps=4", "rlvr.grpo.levels=1,2",
                                                              "eval.math_tasks=7"])
    expected = resolve_config(args)
    # the file over the preset gives the same configuration, so the same command lines and fingerprints
    again = resolve_config(Namespace(preset="micro", config=str(path), overrides=[]))
    assert again == expected
    assert fingerprints(again, tmp_path) == fingerprints(expected, tmp_path)


def test_recovery_is_the_share_of_the_teacher_lead_won_back():
    assert recovery(0.3, 0.2, 0.4) == pytest.approx(0.5)
    assert recovery(0.1, 0.2, 0.4) == pytest.approx(-0.5)  # distillation lost ground
    assert recovery(0.5, 0.2, 0.2) is None and recovery(0.5, 0.3, 0.2) is None  # the teacher is not ahead
