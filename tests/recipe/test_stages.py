"""The recipe's stages are typed runs of their commands: the command line the pipeline logs for a stage, run by hand,
resolves to exactly the configuration the pipeline trains the stage with."""

from __future__ import annotations

import json
import shlex

import pytest

from hybridtron.cli import COMMANDS, build_parser
from hybridtron.recipe.config import preset_config
from hybridtron.recipe.stages import STAGE_BY_NAME, active_stages, command_line, pipeline_model, stage_run


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
    assert {stage.command.name for stage in STAGE_BY_NAME.values()} <= set(COMMANDS)
