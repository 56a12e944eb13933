"""The recipe's stages are typed runs of their commands: the command line the pipeline logs for a stage, run by hand,
resolves to exactly the configuration the pipeline trains the stage with."""

from __future__ import annotations

import json
import shlex

import pytest

from hybridtron.cli import COMMANDS, build_parser
from hybridtron.post import sft
from hybridtron.recipe import stages as S
from hybridtron.recipe.config import parse_set, read_pipeline_toml
from hybridtron.recipe.render import format_table, render_html, summarize
from hybridtron.recipe.stage import LEVELS, Stage, preset
from hybridtron.recipe.stages import STAGES, active_stages, command_line, pipeline_model, preset_config, stage_run


@pytest.mark.parametrize("preset", ["micro", "tiny"])
def test_each_logged_command_line_runs_the_stage_as_configured(preset, tmp_path):
    config = preset_config(preset)
    out = tmp_path / "pipe"
    model = pipeline_model(config)
    for name in active_stages(config):  # each stage's checkpoint, as the stages before it leave them
        (out / name / "hf").mkdir(parents=True)
        (out / name / "hf" / "config.json").write_text(json.dumps(model.to_hf()))
    for name in active_stages(config):
        command, typed = stage_run(name, config, out)
        argv = shlex.split(command_line(name, config, out))
        assert argv[:2] == ["hybridtron", command.name]
        args = build_parser(load=command.name).parse_args(argv[1:])
        from_the_command_line, _ = command.resolve(args)
        assert from_the_command_line == typed, name
        assert args.out == str(out / name)


def test_every_stage_names_a_command_of_the_registry():
    assert {stage.command.name for stage in STAGES} <= set(COMMANDS)


def test_a_stage_declared_here_runs_through_validate_command_line_and_render(tmp_path, monkeypatch):
    """Adding a stage is one declaration: a toy stage (more code SFT on top of the RLVR student) appended to STAGES
    is validated, configured by TOML and --set, logged, fingerprinted after the stage it reads, and drawn."""
    toy = Stage(name="toy_code_sft", command=sft.COMMAND, what="toy: code SFT on the RLVR student",
                inputs={"base_model": S.RLVR, "data": "env:code"}, fixed={"sft.env_levels": LEVELS},
                presets={"tiny": preset(7, {"sft.train_on_thinking": True}),
                         "micro": preset(3, {"sft.env_examples": 40, "sft.seq_len": 256, "sft.batch_size": 1})})
    monkeypatch.setattr(S, "STAGES", (toy, *S.STAGES))  # declared first: its place follows from its inputs
    config = S.apply_changes(preset_config("micro"), parse_set(["toy_code_sft.sft.seed=5", "toy_code_sft.steps=4"]),
                             "--set")
    S.validate(config)
    order = active_stages(config)
    assert S.upstream("toy_code_sft", config) == ["rlvr"] and order.index("toy_code_sft") == order.index("rlvr") + 1
    line = command_line("toy_code_sft", config, tmp_path)
    assert line.startswith(f"hybridtron sft --model {tmp_path / 'rlvr' / 'hf'} --data env:code ")
    assert "--set train.steps=4" in line and "--set sft.env_levels=1" in line and "--set sft.seed=5" in line
    typed = stage_run("toy_code_sft", config, tmp_path, model=pipeline_model(config))[1]
    assert (typed.sft.seed, typed.sft.env_examples, typed.train.steps) == (5, 40, 4)
    # its fingerprint follows the stage it builds on
    changed = S.apply_changes(config, {"rlvr": {"steps": 2}}, "test")
    assert S.fingerprints(changed, tmp_path)["toy_code_sft"] != S.fingerprints(config, tmp_path)["toy_code_sft"]
    # the pipeline TOML holds it and reads back the same
    path = tmp_path / "pipe.toml"
    path.write_text(S.pipeline_toml(config))
    assert "[toy_code_sft.sft]" in path.read_text()
    assert S.apply_changes(preset_config("micro"), read_pipeline_toml(path), str(path)) == config
    with pytest.raises(ValueError, match=r"\[toy_code_sft\] \(sft\): unknown sft fields \['bogus'\]"):
        S.apply_changes(config, {"toy_code_sft": {"sft.bogus": 1}}, "--set")
    # the table and the page show its row
    out = tmp_path / "pipe"
    for name in active_stages(config):
        (out / name).mkdir(parents=True)
        (out / name / S.STAGE_FILE).write_text(json.dumps({"seconds": 1.0}))
        (out / name / S.EVAL_FILE).write_text(json.dumps(
            {"math_pass_at_1": 0.1, "code_pass_rate": 0.2, "code_pass_at_1": 0.0, "terminal_pass_at_1": 0.0,
             "val_loss": 1.0, "acceptance_length": 1.5, "seconds": 2.0}))
    result = summarize(config, out)
    assert [row["what"] for row in result["stages"]].count(toy.what) == 1 and result["missing"] == []
    assert "| toy_code_sft |" in format_table(result)
    assert "toy_code_sft" in render_html(result, out)


def test_stages_that_read_each_other_are_refused(monkeypatch):
    loop = Stage(name="loop", command=sft.COMMAND, what="reads itself", inputs={"base_model": S.SFT})
    object.__setattr__(loop, "inputs", {"base_model": loop})
    monkeypatch.setattr(S, "STAGES", (*S.STAGES, loop))
    with pytest.raises(ValueError, match="the stages loop read each other's models"):
        S.declared()


def test_the_presets_settings_are_typed_and_their_fingerprints_unchanged(tmp_path):
    """The settings are values of their fields' types, however given; the presets' command lines, and so the
    fingerprints a resumed pipeline compares, change only with the recipe (the fingerprints chain upstream: these
    two cover every stage of the presets; last changed by the agentic teacher, in MOPD's panel and its warmup, and
    the micro model's context). The tiny preset's stages before the teachers keep theirs."""
    tiny = preset_config("tiny")
    assert tiny.stages["mopd_1"].settings["mopd.domain_weights"] == (0.7, 0.2, 0.1)
    assert tiny.stages["rlvr"].settings["grpo.mtp_loss_weight"] == 0.0
    changed = S.apply_changes(tiny, parse_set(["rlvr.grpo.temperature=0.7", "rlvr.grpo.curriculum=true"]), "--set")
    assert changed.stages["rlvr"].settings["grpo.temperature"] == 0.7
    assert changed.stages["rlvr"].settings["grpo.curriculum"] is True
    assert list(changed.stages["rlvr"].settings).index("grpo.temperature") == 2  # given again: in its old place
    pinned = {"tiny": ("31e9ebcd709ca667", "3d3d6ad0926008fe"), "micro": ("93ca0ae752d5393d", "652f74e22faeeffc")}
    for name, (boost, no_warmup) in pinned.items():
        prints = S.fingerprints(preset_config(name), tmp_path)
        assert (prints["mtp_boost"], prints["mopd_no_warmup"]) == (boost, no_warmup), name
    kept = {"rlvr": "04e4110c4d5eee22", "math_teacher": "817b7a823dd6d44e", "code_teacher": "60a105eb41d6db37"}
    assert {name: S.fingerprints(tiny, tmp_path)[name] for name in kept} == kept
