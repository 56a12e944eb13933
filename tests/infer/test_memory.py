"""KV cache / Mamba state accounting: the report's figures, hand-computed Nano and Super, the command."""

import json

import pytest
import torch

from hybridtron.cli import main
from hybridtron.config import nano3, super3, tiny, ultra3
from hybridtron.infer.memory import crossover_context, memory_report
from hybridtron.infer.state_quant import quantize_state
from hybridtron.model.memory import conv_state_bytes, kv_bytes_per_token, mamba_state_bytes, ssm_state_bytes

MiB = 2 ** 20


def test_ultra3_reproduces_the_reports_figures():
    config = ultra3()
    assert kv_bytes_per_token(config, "fp8") == 6144  # 12 layers * 2 kv heads * 128 * 2 (K, V) * 1 B
    assert ssm_state_bytes(config, "fp32") == 384 * MiB  # 256 * 64 * 128 * 4 B * 48 layers
    assert conv_state_bytes(config, "bf16") == 48 * 3 * (256 * 64 + 2 * 8 * 128) * 2
    report = memory_report(config, context=65536, batch=1, kv_dtype="fp8", state_dtype="fp32")
    assert report.crossover_ssm_only_tokens == 65536  # 384 MiB / 6,144 B = 64K tokens exactly
    assert report.crossover_tokens == 66400  # + 5,308,416 B of conv state = 864 more tokens
    assert report.kv_total == 6144 * 65536 == 384 * MiB


def test_nano3_by_hand():
    config = nano3()  # 6 attention, 23 Mamba layers; 2 kv heads x 128; Mamba 64 heads x 64, state 128, 8 groups
    assert kv_bytes_per_token(config, "fp8") == 6 * 2 * 2 * 128 * 1 == 3072
    assert kv_bytes_per_token(config, "bf16") == 6144
    assert ssm_state_bytes(config, "fp32") == 23 * 64 * 64 * 128 * 4 == 46 * MiB
    assert conv_state_bytes(config, "bf16") == 23 * 3 * (4096 + 2048) * 2 == 847_872
    assert mamba_state_bytes(config, "fp32", "bf16") == 48_234_496 + 847_872
    # crossover with bf16 KV: ceil(49,082,368 / 6,144) = 7,989 tokens
    assert memory_report(config, 1000, kv_dtype="bf16").crossover_tokens == 7989


def test_super3_by_hand():
    config = super3()  # 8 attention, 40 Mamba layers; Mamba 128 heads x 64, state 128
    assert kv_bytes_per_token(config, "fp8") == 8 * 2 * 2 * 128 == 4096
    assert kv_bytes_per_token(config, "fp32") == 16384
    assert ssm_state_bytes(config, "fp32") == 40 * 128 * 64 * 128 * 4 == 160 * MiB
    assert ssm_state_bytes(config, "bf16") == 80 * MiB
    # int8: one byte per element plus one fp32 scale per (head, head_dim) row of 128 states
    assert ssm_state_bytes(config, "int8") == 40 * (128 * 64 * 128 + 128 * 64 * 4)
    assert conv_state_bytes(config, "fp32") == 40 * 3 * (8192 + 2048) * 4
    report = memory_report(config, context=131072, batch=4, kv_dtype="fp8", state_dtype="fp32", conv_dtype="bf16")
    assert report.kv_total == 4096 * 131072 * 4 == 2 * 2 ** 30
    assert report.mamba_total == 4 * (160 * MiB + 2_457_600)
    assert report.total == report.kv_total + report.mamba_total


def test_mtp_attention_layer_is_counted_on_request():
    config = ultra3()
    assert kv_bytes_per_token(config, "fp8", include_mtp=True) == 13 * 2 * 2 * 128
    assert kv_bytes_per_token(nano3(), "fp8", include_mtp=True) == 3072  # Nano has no MTP block


def test_int8_accounting_matches_what_state_quant_stores():
    """memory.py's int8 bytes equal the bytes of a real quantized state, including a partial last block."""
    config = tiny(ssm_state_size=200, layers_block_type="M")  # 200 states: one full block of 128 and one of 72
    state = torch.randn(config.mamba_num_heads, config.mamba_head_dim, config.ssm_state_size)
    stored = quantize_state(state, "int8_sr", torch.Generator().manual_seed(0))
    assert ssm_state_bytes(config, "int8") == stored.nbytes
    for dtype, mode in (("fp16", "fp16_rtn"), ("bf16", "bf16_sr"), ("fp32", "fp32")):
        assert ssm_state_bytes(config, dtype) == quantize_state(state, mode).nbytes


def test_accounting_matches_the_allocated_cache():
    from hybridtron.infer.cache import HybridCache  # a broken import must fail this test, not skip it

    config = tiny()
    cache = HybridCache.allocate(config, batch=3, max_len=37, dtype=torch.bfloat16, state_dtype=torch.float32)
    report = memory_report(config, context=37, batch=3, kv_dtype="bf16", state_dtype="fp32", conv_dtype="bf16")
    assert cache.memory_bytes() == report.total


def test_crossover_edges():
    assert crossover_context(0, 100) is None  # no attention layers: the KV cache never catches up
    assert crossover_context(0, 0) == 0
    assert crossover_context(10, 0) == 0  # no Mamba layers
    assert crossover_context(10, 101) == 11


def test_errors_name_the_field():
    with pytest.raises(ValueError, match="kv dtype"):
        kv_bytes_per_token(ultra3(), "fp4")
    with pytest.raises(ValueError, match="state dtype"):
        ssm_state_bytes(ultra3(), "int4")
    with pytest.raises(ValueError, match="batch"):
        memory_report(ultra3(), 10, batch=0)
    with pytest.raises(ValueError, match="context"):
        memory_report(ultra3(), -1)


def test_memory_command(capsys, tmp_path):
    assert main(["memory", "--preset", "ultra3", "--context", "65536", "--kv-dtype", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "6,144 B" in out and "384.00 MiB" in out and "66,400 tokens" in out and "65,536" in out

    config_path = tmp_path / "config.json"
    config_path.write_text(nano3().to_json())
    assert main(["memory", "--config", str(config_path), "--context", "1000", "--batch", "2",
                 "--kv-dtype", "bf16", "--json"]) == 0
    numbers = json.loads(capsys.readouterr().out)
    assert numbers["kv_per_token"] == 6144 and numbers["kv_total"] == 6144 * 1000 * 2
    assert numbers["crossover_tokens"] == 7989 and numbers["batch"] == 2

    assert main(["memory", "--preset", "nano3", "--config", str(tmp_path)]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["memory", "--config", str(tmp_path / "missing")]) == 2
    assert f"--config {tmp_path / 'missing'}: no such directory" in capsys.readouterr().err


def test_memory_command_reads_a_run_directory(capsys, tmp_path):
    """`--config RUN_DIR` reads the run's hf/ export, as `--model` does everywhere; a training checkpoint (a DCP step
    directory) is refused in one line pointing at `hybridtron convert`."""
    (tmp_path / "run" / "hf").mkdir(parents=True)
    (tmp_path / "run" / "hf" / "config.json").write_text(nano3().to_json())
    step = tmp_path / "run" / "checkpoints" / "step_000100"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    printed = {}
    for source in ("run", "run/hf", "run/hf/config.json"):
        assert main(["memory", "--config", str(tmp_path / source), "--context", "1000", "--json"]) == 0
        printed[source] = json.loads(capsys.readouterr().out)
    assert printed["run"] == printed["run/hf"] == printed["run/hf/config.json"]
    assert main(["memory", "--config", str(step)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"hybridtron memory: error: --config {step} is a training checkpoint") and \
        f"hybridtron convert --from {step}" in err and len(err.splitlines()) == 1


def test_slot_bytes_are_what_the_engine_allocates_per_slot(small_config):
    """`slot_bytes` (what `hybridtron memory --budget-gib` divides the budget by) equals an engine's allocation per
    slot, plain and speculative (the drafter's cache and catch-up buffer included), fp32 and an int8 SSM state;
    `memory_budget_gib` gives the engine that many slots."""
    from hybridtron.data.tokenizer import Tokenizer
    from hybridtron.infer.engine import HybridEngine
    from hybridtron.infer.memory import slot_bytes, slots_for_budget
    from hybridtron.model.lm import HybridLM

    config = small_config(vocab_size=640, max_position_embeddings=200)
    model = HybridLM(config).eval()
    tokenizer = Tokenizer.train(["slot accounting " * 50], 600)
    for speculative, state_quant, stored in ((False, "fp32", "fp32"), (True, "fp32", "fp32"),
                                             (True, "int8_sr", "int8")):
        engine = HybridEngine(model, tokenizer, model_name="m", speculative=speculative, state_quant=state_quant,
                              max_slots=3, draft_length=4 if speculative else None)
        batch = engine.scheduler.batch
        positions = config.max_position_embeddings + (5 if speculative else 0)
        per_slot = slot_bytes(config, positions, "fp32", stored, "fp32", include_mtp=speculative)
        assert batch.slot_bytes() == per_slot
        # the slots' rows and the staging row (which needs no catch-up buffer)
        staging = per_slot - (batch.buffer_bytes() if speculative else 0)
        assert batch.memory_bytes() == per_slot * batch.cache.batch_size + staging
        budget = 10.5 * per_slot / 2 ** 30
        assert slots_for_budget(config, budget, positions, "fp32", stored, "fp32", speculative) == 9
        sized = HybridEngine(model, tokenizer, model_name="m", speculative=speculative, state_quant=state_quant,
                             memory_budget_gib=budget, draft_length=4 if speculative else None)
        assert sized.scheduler.batch.slots == 9
    with pytest.raises(ValueError, match="holds no slot"):
        HybridEngine(model, tokenizer, model_name="m", memory_budget_gib=1e-9)
    with pytest.raises(ValueError, match="memory budget"):
        slots_for_budget(config, 0, 100)


def test_memory_command_slots_for_a_budget(capsys):
    config = tiny()
    assert main(["memory", "--preset", "tiny", "--context", "8192", "--kv-dtype", "fp32", "--conv-dtype", "fp32",
                 "--include-mtp", "--budget-gib", "1", "--json"]) == 0
    numbers = json.loads(capsys.readouterr().out)
    from hybridtron.infer.memory import slot_bytes
    per_slot = slot_bytes(config, 8192, "fp32", "fp32", "fp32", include_mtp=True)
    assert numbers["slot_bytes"] == per_slot and numbers["slots_in_budget"] == 2 ** 30 // per_slot - 1
    assert main(["memory", "--preset", "tiny", "--budget-gib", "1"]) == 0
    out = capsys.readouterr().out
    # the defaults (fp8 KV, bf16 conv: the report's serving figures) are not the engine's: the output says so
    assert "slots in 1 GiB" in out and "pass that as --kv-dtype and --conv-dtype" in out
    assert main(["memory", "--preset", "tiny", "--kv-dtype", "fp32", "--conv-dtype", "fp32", "--budget-gib", "1"]) == 0
    assert "--kv-dtype" not in capsys.readouterr().out
    assert main(["memory", "--preset", "ultra3", "--budget-gib", "0.001"]) == 2
    assert "holds no slot" in capsys.readouterr().err
