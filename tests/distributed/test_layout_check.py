"""A run's `[dist]` layout is checked with the planner's rules before any process group exists."""

from __future__ import annotations

import pytest

from hybridtron.cli import main as cli_main
from hybridtron.distributed.config import DistConfig
from hybridtron.distributed.mesh import check_run_layout, init_parallel


def check(config, model, world, batch_size=4, grad_accum=2, seq_len=32):
    return check_run_layout(config, model, world, batch_size=batch_size, grad_accum=grad_accum, seq_len=seq_len)


def test_dp_shard_takes_the_rest_of_the_world(small_config):
    layout = check(DistConfig(tp=2, ep=2), small_config(), 4)
    assert (layout.dp_shard, layout.tp, layout.ep, layout.efsdp) == (2, 2, 2, 2)
    assert check(DistConfig(), small_config(), 1).world == 1


@pytest.mark.parametrize("config, world, batch, reason", [
    (DistConfig(tp=4), 4, 4, "tp 4 does not divide n_groups 2 (Mamba's B/C and gated norm split by group)"),
    (DistConfig(tp=3), 6, 4, "tp 3 does not divide vocab_size 128 (the vocab-parallel embedding and lm_head)"),
    (DistConfig(ep=3), 3, 3, "ep 3 does not divide 8 experts"),
    (DistConfig(tp=2, dp_shard=1), 4, 4, "= 2 != 4 GPUs"),
    (DistConfig(pp=2), 2, 4, None),  # valid: 2 micro-batches per step, 2 stages
    (DistConfig(pp=4), 4, 4, "2 micro-batches per DP rank < pp 4 (1F1B needs one per stage)"),
    (DistConfig(dp_shard=3), 3, 4, "8 sequences per iteration do not split over dp 3 x micro-batch 1"),
    (DistConfig(dp_shard=4), 4, 6, "data.batch_size 6 does not split over dp_replicate x dp_shard = 4"),
    (DistConfig(cp=2), 2, 4, "context parallelism splits the fixed-length rows of pretraining and SFT"),
    (DistConfig(tp=2, etp=2), 2, 4, None),  # valid: each expert's width split over the TP group
    (DistConfig(etp=2), 2, 4, "etp 2 is neither 1 nor tp 1"),
    (DistConfig(tp=2, etp=2, ep=4), 4, 4, "ep 4 x etp 2 does not divide dp_shard x cp x tp = 4"),
    (DistConfig(tp=4), 6, 4, "= 4 does not divide the 6 processes"),
])
def test_each_bad_layout_fails_with_its_one_line_reason(small_config, config, world, batch, reason):
    if reason is None:
        check(config, small_config(), world, batch_size=batch)
        return
    with pytest.raises(ValueError) as error:
        check(config, small_config(), world, batch_size=batch)
    assert reason in str(error.value) and "\n" not in str(error.value)


TP8 = dict(num_attention_heads=8, num_key_value_heads=8, mamba_num_heads=8, n_groups=8)  # a model tp = 8 splits


@pytest.mark.parametrize("config, world, seq_len, model, reason", [
    (DistConfig(cp=2, ep=2), 2, 32, {}, None),  # valid where the run splits its sequences by position (pretraining)
    (DistConfig(cp=2, tp=2), 4, 32, {}, None),  # each cp chunk cut into tp sequence shards
    (DistConfig(cp=2, tp=8), 16, 48, TP8, r"data.seq_len 48 does not split over 2 x cp 2 x tp 8"),
    (DistConfig(cp=2, pp=2), 4, 32, {}, None),  # each pipeline carries its share (2 micro-batches per step)
    (DistConfig(cp=8), 8, 32, {}, "leaves chunks of 2 positions; the Mamba conv reads the previous 3"),
])
def test_context_parallel_layouts_fail_with_their_reason(small_config, config, world, seq_len, model, reason):
    def run():
        return check_run_layout(config, small_config(**model), world, batch_size=4, grad_accum=2, seq_len=seq_len,
                                context_parallel=True)
    if reason is None:
        assert run().cp == 2
        return
    with pytest.raises(ValueError, match=reason):
        run()


def test_the_reason_is_the_planners(small_config):
    from hybridtron.distributed.costs import cluster_for
    from hybridtron.distributed.layout import Layout, Workload, check_layout

    planner = check_layout(small_config(), cluster_for("h100", 8), Workload(seq_len=32, tokens_per_iter=256),
                           Layout(tp=8))
    with pytest.raises(ValueError, match=planner.reason.replace("(", r"\(").replace(")", r"\)")):
        check(DistConfig(tp=8), small_config(), 8, batch_size=8)


def test_a_single_process_with_the_default_layout_builds_no_process_group(small_config, monkeypatch):
    import torch.distributed as dist

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert init_parallel(DistConfig(), small_config(), batch_size=4, grad_accum=1, seq_len=32).distributed is False
    assert not dist.is_initialized()


def test_one_torchrun_process_on_cpu_builds_a_process_group_only_when_a_backend_is_named(small_config, monkeypatch):
    """Under torchrun a world of one is a plain process on CPU with `backend=auto`; on CUDA (and on CPU with
    `dist.backend=gloo`, which is how this path is tested without a GPU) it is a mesh of one on the distributed
    path. Outside torchrun, where no rendezvous exists, a named backend changes nothing."""
    import socket

    import torch
    import torch.distributed as dist

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    args = dict(batch_size=4, grad_accum=1, seq_len=32)
    assert not init_parallel(DistConfig(backend="gloo"), small_config(), **args).distributed  # not launched by torchrun
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    for name, value in {"TORCHELASTIC_RUN_ID": "test", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                        "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    if not torch.cuda.is_available():
        assert init_parallel(DistConfig(), small_config(), **args).distributed is False
        assert not dist.is_initialized()
    parallel = init_parallel(DistConfig(backend="gloo"), small_config(), **args)
    try:
        assert (parallel.world, parallel.rank, parallel.device.type, dist.get_backend()) == (1, 0, "cpu", "gloo")
        assert parallel.is_main and parallel.meshes["data"].size() == 1
    finally:
        parallel.close()


def test_dist_section_parses_and_validates(pretrain_config):
    config = pretrain_config("dist.tp=2", "dist.ep=4", "dist.pp_schedule=gpipe")
    assert (config.dist.tp, config.dist.ep, config.dist.dp_shard, config.dist.pp_schedule) == (2, 4, -1, "gpipe")
    assert "[dist]" in config.to_toml()
    with pytest.raises(ValueError, match="dist.dp_shard must be >= 1 or -1"):
        pretrain_config("dist.dp_shard=0")
    with pytest.raises(ValueError, match="dist.pp_schedule must be one of"):
        pretrain_config("dist.pp_schedule=zigzag")
    assert pretrain_config("dist.cp_attention=ring").dist.cp_attention == "ring"
    with pytest.raises(ValueError, match="dist.cp_attention must be one of all-gather, ring, got 'alltoall'"):
        pretrain_config("dist.cp_attention=alltoall")
    with pytest.raises(ValueError, match="unknown dist fields"):
        pretrain_config("dist.sp=2")


def test_pretrain_rejects_a_bad_layout_before_writing_anything(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")  # as torchrun sets it; the check runs before any process group is made
    out = tmp_path / "run"
    code = cli_main(["pretrain", "--preset", "tiny", "--out", str(out), "--set", "dist.tp=4", "--quiet"])
    assert code == 2
    assert "tp 4 does not divide n_groups 2 (Mamba's B/C and gated norm split by group)" in capsys.readouterr().err
    assert not out.exists()
