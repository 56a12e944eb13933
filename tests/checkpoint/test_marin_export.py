"""An HF export is for `nemotron_h` readers: it refuses the Marin options they cannot express (one line naming the
field, nothing written) unless asked for hybridtron's own format (a run's final export), and reading a config.json refuses a `sliding_window` that transformers would ignore. Our own
configs and training checkpoints (DCP) keep the options."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hybridtron.checkpoint.hf import check_exportable, load_pretrained, save_pretrained
from hybridtron.config import HYBRIDTRON_H, ModelConfig
from hybridtron.model.lm import HybridLM


@pytest.mark.parametrize("overrides, field", [
    (dict(moe_latent_norm=True), "moe_latent_norm"),
    (dict(moe_output_norm=True), "moe_output_norm"),
    (dict(sliding_window=16), "sliding_window"),
    (dict(sliding_window=16, sliding_window_layers=[1]), "sliding_window"),
])
def test_export_refuses_what_nemotron_h_cannot_express(small_config, tmp_path, overrides, field):
    model = HybridLM(small_config(**overrides))
    with pytest.raises(ValueError, match=f"HF export: {field} = ") as error:
        save_pretrained(model, tmp_path / "hf")
    assert "\n" not in str(error.value)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("overrides", [dict(moe_latent_norm=True, moe_output_norm=True), dict(sliding_window=4)])
def test_hybridtrons_own_format_loads_here_and_is_refused_by_transformers(small_config, tmp_path, overrides):
    """A run's final export of a model with an option (`nemotron_h=False`): model_type hybridtron_h, read back here
    with equal logits; transformers refuses the model_type instead of loading another model."""
    transformers = pytest.importorskip("transformers")
    model = HybridLM(small_config(**overrides))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "latent_norm" in name or "output_norm" in name:
                param.uniform_(0.5, 1.5)
    save_pretrained(model, tmp_path / "hf", nemotron_h=False)
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["model_type"] == HYBRIDTRON_H and written["architectures"] == ["HybridtronForCausalLM"]
    ids = torch.randint(0, 128, (1, 11))
    torch.testing.assert_close(load_pretrained(tmp_path / "hf")(ids).logits, model(ids).logits, rtol=0, atol=0)
    with pytest.raises((ValueError, KeyError)):
        transformers.AutoConfig.from_pretrained(tmp_path / "hf")


def test_a_model_without_the_options_exports_as_before(small_config, tmp_path):
    model = HybridLM(small_config())
    check_exportable(model.config)
    save_pretrained(model, tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert not {"moe_latent_norm", "moe_output_norm", "sliding_window", "sliding_window_layers"} & set(written)


def test_reading_refuses_a_sliding_window_transformers_ignores(small_config):
    """transformers' NemotronHConfig has a `sliding_window` field but attends in full on every layer."""
    raw = small_config().to_hf()
    raw["sliding_window"] = 4096
    with pytest.raises(ValueError, match="sliding_window is 4096 without sliding_window_layers") as error:
        ModelConfig.from_hf(raw)
    assert "\n" not in str(error.value)
    raw["sliding_window"] = None  # what transformers writes by default
    assert ModelConfig.from_hf(raw) == small_config()


@pytest.mark.parametrize("overrides", [
    dict(moe_latent_norm=True, moe_output_norm=True),
    dict(sliding_window=6),  # the default layers: written as null, read back as the default
    dict(sliding_window=6, sliding_window_layers=[1]),
])
def test_our_configs_round_trip_the_options(small_config, overrides):
    config = small_config(**overrides)
    assert ModelConfig.from_hf(json.loads(json.dumps(config.to_hf()))) == config


def test_a_training_checkpoint_holds_the_options(small_config, tmp_path):
    """A DCP checkpoint of a model with every option reads back into the model its config.json describes."""
    config = small_config(moe_latent_norm=True, moe_output_norm=True, sliding_window=4)
    model = HybridLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "latent_norm" in name or "output_norm" in name:
                param.uniform_(0.5, 1.5)
    dcp.save(model.state_dict(), checkpoint_id=tmp_path / "step")
    restored = HybridLM(ModelConfig.from_hf(json.loads(json.dumps(config.to_hf()))), init=False)
    state = restored.state_dict()
    dcp.load(state, checkpoint_id=tmp_path / "step")
    restored.load_state_dict(state)
    ids = torch.randint(0, 128, (1, 11))
    torch.testing.assert_close(restored(ids).logits, model(ids).logits, rtol=0, atol=0)
