"""The layout of a vLLM engine (hybridtron.distributed.vllm_layout): what the model allows, miles' layout for Ultra, the RL
section's fields, and `hybridtron plan --rollout`."""

import json

import pytest

from hybridtron.cli import main
from hybridtron.config import preset
from hybridtron.distributed.costs import cluster_for
from hybridtron.distributed.vllm_layout import EngineLayout, check_engine_layout, plan_engine
from hybridtron.post.grpo import GRPOConfig


def test_ultra_on_a_32_gpu_engine_is_miles_layout():
    result = plan_engine(preset("ultra3"), cluster_for("h200", 32), "h200")
    assert result.layout == EngineLayout(tensor_parallel=8, data_parallel=4, expert_parallel=True)
    assert result.layout.expert_ranks == 32  # EP 32: 16 of the 512 experts on each GPU
    assert result.layout.serve_flags() == ("--tensor-parallel-size 8 --data-parallel-size 4 --enable-expert-parallel "
                                           "--gpu-memory-utilization 0.9")
    assert 0 < result.dense_gib + result.expert_gib < result.budget_gib


def test_a_dense_model_on_one_gpu_and_on_two():
    tiny = preset("tiny-dense")
    assert plan_engine(tiny, cluster_for("h100", 1, gpus_per_node=1), "h100").layout == EngineLayout()
    two = plan_engine(tiny, cluster_for("h100", 2, gpus_per_node=2), "h100").layout
    assert two == EngineLayout(tensor_parallel=2) and two.engine_args() == {"tensor_parallel_size": 2}


@pytest.mark.parametrize("layout, message", [
    (EngineLayout(tensor_parallel=16), "grpo.vllm_tensor_parallel=16: 16 must divide the 8 Mamba groups"),
    (EngineLayout(tensor_parallel=3), "grpo.vllm_tensor_parallel=3: 3 must divide the 64 attention heads"),
    (EngineLayout(tensor_parallel=8, data_parallel=3, expert_parallel=True),
     "grpo.vllm_expert_parallel=true: the 512 routed experts do not spread evenly over tp x dp = 24 GPUs"),
    (EngineLayout(gpu_memory_utilization=1.5), "grpo.vllm_gpu_memory_utilization=1.5: must be in"),
])
def test_layouts_the_model_cannot_take_are_one_line(layout, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        check_engine_layout(preset("ultra3"), layout, "grpo")


def test_expert_parallel_needs_experts():
    with pytest.raises(ValueError, match="vllm_expert_parallel=true: the model has no MoE layer"):
        check_engine_layout(preset("tiny-dense"), EngineLayout(expert_parallel=True), "mopd")


def test_the_rl_section_carries_the_layout():
    config = GRPOConfig(vllm_tensor_parallel=2, vllm_expert_parallel=True)
    assert config.vllm_layout() == EngineLayout(tensor_parallel=2, expert_parallel=True)
    with pytest.raises(ValueError, match=r"grpo.vllm_gpu_memory_utilization must be in \(0, 1\]"):
        GRPOConfig(vllm_gpu_memory_utilization=0).validate()
    with pytest.raises(ValueError, match="grpo.vllm_data_parallel must be >= 1, got 0"):
        GRPOConfig(vllm_data_parallel=0).validate()


def test_plan_rollout_prints_the_serve_flags_and_the_settings(capsys):
    assert main(["plan", "--preset", "ultra3", "--gpus", "32", "--gpu", "h200", "--rollout"]) == 0
    out = capsys.readouterr().out
    assert "vllm serve DIR --tensor-parallel-size 8 --data-parallel-size 4 --enable-expert-parallel" in out
    assert """--speculative-config '{"method": "mtp", "num_speculative_tokens": 3}'""" in out
    assert "vllm_tensor_parallel = 8\n  vllm_data_parallel = 4\n  vllm_expert_parallel = true" in out
    assert main(["plan", "--preset", "ultra3", "--gpus", "32", "--gpu", "h200", "--rollout", "--json"]) == 0
    layout = json.loads(capsys.readouterr().out)["layout"]
    assert (layout["tensor_parallel"], layout["data_parallel"], layout["expert_parallel"]) == (8, 4, True)


def test_plan_rollout_refuses_weights_that_do_not_fit(capsys):
    assert main(["plan", "--preset", "ultra3", "--gpus", "8", "--gpu", "h100", "--rollout"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "the bf16 weights take 130.6 GiB per GPU, more than 0.9 of a h100's 80 GiB" in err
