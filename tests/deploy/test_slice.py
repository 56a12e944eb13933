"""`hybridtron slice`: which layers a slice keeps; a slice of a trained checkpoint is the source with the dropped
blocks skipped, on real text; it loads in transformers and here with equal logits; a preset's slice is a config
alone with its counts printed; `plan` and `memory` read both; bad input gets one line and writes nothing."""

from __future__ import annotations

import json
import json.decoder
import os
import re
import shutil
import stat
from pathlib import Path

import pytest
import torch

from hybridtron.checkpoint import load_pretrained, save_pretrained
from hybridtron.checkpoint.hf import FP32_TENSORS, TOKENIZER_FILES
from hybridtron.cli import main
from hybridtron.config import ATTENTION, MAMBA, MLP, MOE, PRESETS, SLICED_FROM_KEY, ModelConfig, preset, tiny, ultra3
from hybridtron.data.tokenizer import Tokenizer
from hybridtron.deploy.slice import slice_config, spread_layers
from hybridtron.model.lm import HybridLM


# ------------------------------------------------------------------------------------------- which layers
def test_the_default_spread_reaches_both_ends_and_keeps_every_kind():
    assert spread_layers(tiny().layers_block_type, 4) == [0, 2, 5, 7]  # ME*EM-ME -> M * - E
    # an even spread of Ultra's 108 layers, 0 36 71 107, has no attention layer: 71 (MoE) yields to 73
    assert spread_layers(ultra3().layers_block_type, 4) == [0, 36, 73, 107]
    assert [ultra3().layers_block_type[i] for i in (0, 36, 73, 107)] == [MAMBA, MAMBA, ATTENTION, MOE]
    for name in PRESETS:
        kinds = preset(name).layers_block_type
        for layers in range(len(set(kinds)), len(kinds) + 1):
            kept = spread_layers(kinds, layers)
            assert len(kept) == layers and kept == sorted(set(kept)), (name, layers, kept)
            assert {kinds[i] for i in kept} == set(kinds), (name, layers, kept)
        assert spread_layers(kinds, len(kinds)) == list(range(len(kinds)))


def test_a_windowed_model_keeps_its_window_on_the_same_layers(small_config):
    config = small_config(layers_block_type="M*E*-*M*", sliding_window=16)
    assert config.windowed_layers == (1, 3, 5)  # every 4th attention layer (7) stays full
    sliced = slice_config(config, [1, 2, 5, 7])
    assert sliced.layers_block_type == (ATTENTION, MOE, ATTENTION, ATTENTION)
    assert sliced.windowed_layers == (0, 2)  # layers 1 and 5, renumbered; 7 stays full
    assert sliced.sliding_window == 16


# ----------------------------------------------------------------------------------- a trained checkpoint
def real_text_ids(hf_dir: Path, tokens: int = 128) -> torch.Tensor:
    """The first `tokens` tokens of the standard library's json/decoder.py."""
    ids = Tokenizer.load(hf_dir / "tokenizer.json").encode(Path(json.decoder.__file__).read_text())[:tokens]
    assert len(ids) == tokens
    return torch.tensor([ids])


@pytest.fixture(scope="module")
def trained_slice(trained_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("slices") / "slice4"
    assert main(["slice", "--model", str(trained_run / "hf"), "--layers", "4", "--out", str(out)]) == 0
    return out


def skipping(model: HybridLM, dropped: list[int]) -> list:
    """Forward hooks that make each dropped block return its input: the residual stream passes it by."""
    return [model.backbone.layers[i].register_forward_hook(lambda module, args, output: args[0]) for i in dropped]


def test_a_slice_is_the_source_with_the_dropped_blocks_skipped(trained_run, trained_slice):
    source_dir = trained_run / "hf"
    config = json.loads((trained_slice / "config.json").read_text())
    assert config[SLICED_FROM_KEY] == {"source": str(source_dir.resolve()), "source_layers": 8,
                                       "kept_layers": [0, 2, 5, 7]}
    assert config["hybrid_override_pattern"] == "M*-E" and config["num_nextn_predict_layers"] == 1
    for name in TOKENIZER_FILES:
        assert (trained_slice / name).read_bytes() == (source_dir / name).read_bytes()

    ids = real_text_ids(source_dir)
    source, sliced = load_pretrained(source_dir).eval(), load_pretrained(trained_slice).eval()
    with torch.no_grad():
        whole = source(ids)
        handles = skipping(source, [1, 3, 4, 6])
        skipped = source(ids)
        for handle in handles:
            handle.remove()
        ours = sliced(ids)
    assert torch.equal(ours.logits, skipped.logits)
    assert len(ours.mtp_logits) == 2 and all(torch.equal(a, b) for a, b in zip(ours.mtp_logits, skipped.mtp_logits))
    assert (ours.logits - whole.logits).abs().max() > 0.1  # the dropped layers did matter: the test can fail
    source_state, sliced_state = source.state_dict(), sliced.state_dict()
    mtp = [name for name in source_state if name.startswith("mtp.")]
    assert mtp and all(torch.equal(sliced_state[name], source_state[name]) for name in mtp)


def test_a_slice_loads_in_transformers_with_equal_logits(trained_run, trained_slice):
    transformers = pytest.importorskip("transformers")
    ids = real_text_ids(trained_run / "hf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(trained_slice, dtype=torch.float32).eval()
    assert type(theirs).__name__ == "NemotronHForCausalLM"
    assert theirs.config.num_hidden_layers == 4 and theirs.config.hybridtron_sliced_from["kept_layers"] == [0, 2, 5, 7]
    ours = load_pretrained(trained_slice).eval()
    with torch.no_grad():
        assert (ours(ids, mtp=False).logits - theirs(ids).logits).abs().max() <= 1e-4


def test_kept_layers_by_hand_carry_their_weights(small_config, tmp_path, capsys):
    model = HybridLM(small_config())  # M*E-ME
    save_pretrained(model, tmp_path / "source")
    (tmp_path / "out").mkdir()  # an empty --out is fine
    assert main(["slice", "--model", str(tmp_path / "source"), "--layers", "3", "--keep", "1,2,5",
                 "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    sliced = load_pretrained(tmp_path / "out")
    assert sliced.config.layers_block_type == (ATTENTION, MOE, MOE)
    assert sliced.config.replace(layers_block_type=model.config.layers_block_type) == model.config
    for new, old in enumerate((1, 2, 5)):
        theirs = model.backbone.layers[old].state_dict()
        assert all(torch.equal(tensor, theirs[name])
                   for name, tensor in sliced.backbone.layers[new].state_dict().items())
    assert f"{sliced.num_parameters():,}" in printed and f"{sliced.num_parameters(active=True):,}" in printed
    assert not (tmp_path / "out" / "tokenizer.json").exists()  # the source had none to copy
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "source"]  # no staging directory left behind


# ------------------------------------------------------------------------------------ a preset's config alone
@pytest.fixture(scope="module")
def ultra_slice(tmp_path_factory):
    out = tmp_path_factory.mktemp("slices") / "ultra3-4"
    assert main(["slice", "--preset", "ultra3", "--layers", "4", "--out", str(out)]) == 0
    return out


def test_a_preset_slice_is_its_config_with_the_counts_printed(tmp_path, capsys):
    out = tmp_path / "ultra3-4"
    assert main(["slice", "--preset", "ultra3", "--layers", "4", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert [p.name for p in out.iterdir()] == ["config.json"]
    config = ModelConfig.from_hf(out)
    assert config == ultra3(layers_block_type=(MAMBA, MAMBA, ATTENTION, MOE))
    raw = json.loads((out / "config.json").read_text())
    assert raw[SLICED_FROM_KEY] == {"source": "preset:ultra3", "source_layers": 108, "kept_layers": [0, 36, 73, 107]}
    model = HybridLM.on_meta(config)
    total, active = model.num_parameters(), model.num_parameters(active=True)
    assert (total, active) == (14_072_149_504, 2_722_362_880)
    # the parameters in bf16, but the routers' weights in fp32 (2 more bytes each), and their biases (buffers) in fp32
    router_weights = sum(t.numel() for name, t in model.named_parameters() if FP32_TENSORS.search(name))
    biases = [t.numel() for t in model.buffers()]
    assert biases == [512, 512]  # the MoE layer's router and the MTP block's
    weight_bytes = 2 * model.num_parameters(include_mtp=True) + 2 * router_weights + 4 * sum(biases)
    assert weight_bytes == 50_592_300_032
    for number in (total, active, model.num_parameters(include_mtp=True) - total, weight_bytes):
        assert f"{number:,}" in printed
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoConfig.from_pretrained(out)
    assert type(theirs).__name__ == "NemotronHConfig" and theirs.num_hidden_layers == 4


@pytest.mark.parametrize("which, layers", [("trained_slice", "1 attention layers, 1 Mamba layers"),  # M*-E
                                           ("ultra_slice", "1 attention layers, 2 Mamba layers")])  # MM*E
def test_plan_and_memory_read_a_slice(which, layers, request, capsys):
    out = str(request.getfixturevalue(which))
    capsys.readouterr()
    assert main(["memory", "--config", out, "--context", "4096"]) == 0
    assert f"{out}: {layers}" in capsys.readouterr().out
    assert main(["plan", "--config", out, "--gpus", "8", "--gpu", "h100", "--seq-len", "4096",
                 "--tokens-per-iter", "32768", "--top", "1"]) == 0
    valid = re.search(r"^(\d+) valid layouts", capsys.readouterr().out, re.MULTILINE)
    assert valid and int(valid.group(1)) > 0
    assert main(["plan", "--config", out, "--gpus", "8", "--gpu", "h100", "--serve", "--seq-len", "4096"]) == 0
    assert "serving on 8 GPUs" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------ bad input
@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("source") / "hf"
    save_pretrained(HybridLM(tiny(vocab_size=256, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                                  head_dim=16, mamba_num_heads=2, mamba_head_dim=16, moe_latent_size=16,
                                  intermediate_size=32, moe_intermediate_size=16,
                                  moe_shared_expert_intermediate_size=32)), directory)
    return directory  # tiny's layers: ME*EM-ME, four kinds


@pytest.mark.parametrize("argv, message", [
    (["--layers", "9"], "--layers 9 is more than the model's 8 layers"),
    (["--layers", "3"], "--layers 3 is fewer than the model's 4 layer kinds (Mamba, MoE, attention, MLP): the "
                        "minimum is 4"),
    (["--layers", "0"], "--layers must be at least 1, got 0"),
    (["--keep", "0,8"], "--keep: layer 8 is out of range; the model's layers are 0..7"),
    (["--layers", "2", "--keep", "0,1,2"], "--keep names 3 layers but --layers is 2"),
    (["--keep", "0,1,1"], "--keep names layer 1 twice"),
    (["--keep", "2,1"], "--keep must list the layers in increasing order"),
    (["--keep", "0,one"], "--keep: expected comma-separated layer indices such as 0,3,7, got '0,one'"),
    ([], "give --layers N"),
    (["--preset", "tiny", "--layers", "4"], "give --model DIR (a checkpoint to slice) or --preset NAME (its config "
                                            "alone), not both"),
    (["--out-exists", "--layers", "4"], "already holds a checkpoint (config.json): pass --overwrite to replace its "
                                         "checkpoint files (the other files there are kept)"),
])
def test_bad_input_gets_one_line_and_writes_nothing(small_checkpoint, tmp_path, capsys, argv, message):
    out, out_exists = tmp_path / "out", "--out-exists" in argv
    if out_exists:
        argv = [a for a in argv if a != "--out-exists"]
        out.mkdir()
        (out / "config.json").write_text("{}")
    assert main(["slice", "--model", str(small_checkpoint), *argv, "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and message in error, error
    assert [p.name for p in tmp_path.iterdir()] == (["out"] if out_exists else [])
    assert not out_exists or [p.name for p in out.iterdir()] == ["config.json"]


def test_a_quantized_checkpoint_is_refused(small_checkpoint, tmp_path, capsys):
    source = tmp_path / "quantized"
    shutil.copytree(small_checkpoint, source)
    (source / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4"}}))
    assert main(["slice", "--model", str(source), "--layers", "4", "--out", str(tmp_path / "out")]) == 2
    assert "an NVFP4 checkpoint; slice the unquantized one, then quantize the slice" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_neither_model_nor_preset(tmp_path, capsys):
    assert main(["slice", "--layers", "4", "--out", str(tmp_path / "out")]) == 2
    assert "give --model DIR (a checkpoint to slice) or --preset NAME (its config alone), one of them" in \
        capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_kinds_are_named_for_a_preset_too(tmp_path, capsys):
    assert main(["slice", "--preset", "ultra3", "--layers", "2", "--out", str(tmp_path / "out")]) == 2
    assert "fewer than the model's 3 layer kinds (Mamba, MoE, attention): the minimum is 3" in capsys.readouterr().err
    assert main(["slice", "--preset", "ultra3", "--layers", "109", "--out", str(tmp_path / "out")]) == 2
    assert "--layers 109 is more than the model's 108 layers" in capsys.readouterr().err
    assert MLP not in ultra3().layers_block_type


def test_a_slice_is_published_with_the_umask_permissions(small_checkpoint, tmp_path):
    """Written for others to read (a serving container, another user): not the private modes of temporary files."""
    previous = os.umask(0o022)
    try:
        assert main(["slice", "--model", str(small_checkpoint), "--layers", "4", "--out", str(tmp_path / "a")]) == 0
        assert main(["slice", "--preset", "tiny", "--layers", "4", "--out", str(tmp_path / "b")]) == 0
    finally:
        os.umask(previous)
    for path in [tmp_path / "a", tmp_path / "b", *(tmp_path / "a").iterdir(), *(tmp_path / "b").iterdir()]:
        assert stat.S_IMODE(path.stat().st_mode) == (0o755 if path.is_dir() else 0o644), path
