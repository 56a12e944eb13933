"""`torchrun ... -m hybridtron pretrain` end to end on gloo: the same losses as one process, sharded checkpoints
that resume at another world size and layout (4 -> 2 -> 1, 1 -> 2) with the loss curve continuing exactly, an HF
export gathered from the shards, `hybridtron convert`, and a kill -9 of one rank that torchrun's restart recovers
from the last complete checkpoint."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from hybridtron.checkpoint import load_pretrained

STEPS = 6
FAST = ["--preset", "tiny", "--quiet", "--set", "data.families=json,text", "--set", "data.seq_len=32",
        "--set", "data.batch_size=4", "--set", "data.vocab_size=512", "--set", "model.vocab_size=512",
        "--set", "data.val_batches=1", "--set", "train.val_every=5", "--set", "train.checkpoint_every=2",
        "--set", "train.keep_checkpoints=10", "--set", "train.warmup_steps=2", "--set", "train.grad_accum=2",
        "--set", "train.threads=1"]
TOLERANCE = 1e-5
GRAD_NORM_TOLERANCE = 5e-5


def command(world: int, out: Path, *extra: str, restarts: int = 0) -> list[str]:
    launcher = [sys.executable, "-m", "hybridtron"] if world == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
         "--max-restarts", str(restarts), "-m", "hybridtron"]
    return [*launcher, "pretrain", "--out", str(out), *FAST, *extra]


def environment(cache: Path) -> dict:
    return {**os.environ, "HYBRIDTRON_CACHE": str(cache), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


# A Python warning ("...: UserWarning: ...") or a torch logging warning of a rank ("[rank0]:W1205 ..."): a run prints
# none (the ones torch printed once: FSDP2's "returned a view tensor", ShardedTensor's deprecation, DTensor's
# "sequential all_gather operations", see dist/parallelize.py, dist/state.py and dist/step.py)
WARNING = re.compile(r"\w+Warning: |^\[rank\d+\]:W\d{4} ", re.MULTILINE)


def run(world: int, out: Path, cache: Path, *extra: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """A run that ends well and prints no warning (every layout of this module's runs passes here)."""
    done = subprocess.run(command(world, out, *extra), capture_output=True, text=True, timeout=timeout,
                          env=environment(cache))
    assert done.returncode == 0, done.stderr[-4000:]
    assert not WARNING.search(done.stderr), done.stderr[-4000:]
    return done


def records(run_dir: Path) -> dict[int, dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {line["step"]: line for line in lines}


def assert_same_curve(got: dict[int, dict], want: dict[int, dict], steps) -> None:
    """Losses equal to 1e-5 x max(1, loss) and the gradient norm (a sum over ranks in another order) to
    GRAD_NORM_TOLERANCE of itself. The fp32 rounding of a few steps' updates in another order of reductions is a
    few 1e-6 of the loss, on some CPUs' GEMM kernels just over 1e-5 absolute; Adam's near-sign updates carry it
    into the small late gradients, whose norm drifts to ~1e-5 of itself by step 6 (measured on an AVX2 EPYC:
    0 at step 1, 2e-7 at 2, 6e-6 at 4, 1.07e-5 at 6). A lost or doubled shard moves both by percents."""
    for step in steps:
        for key in ("loss", "lm_loss", "mtp_loss_1", "mtp_loss_2", "val_loss", "grad_norm"):
            if key in want[step]:
                bound = GRAD_NORM_TOLERANCE * abs(want[step][key]) if key == "grad_norm" \
                    else TOLERANCE * max(1.0, abs(want[step][key]))
                assert abs(got[step][key] - want[step][key]) <= bound, (step, key, got[step][key], want[step][key])


def interrupted_copy(run_dir: Path, target: Path, keep_step: int) -> Path:
    """A copy of a finished run as if it had stopped right after the checkpoint of `keep_step`."""
    shutil.copytree(run_dir, target)
    for path in (target / "checkpoints").glob("step_*"):
        if int(path.name.removeprefix("step_")) > keep_step:
            shutil.rmtree(path)
    return target


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The single-process reference and the same run on 4 processes as 2 pipeline stages of TP 2 (DP x TP x EP
    runs against one process in test_parallel_layouts.py)."""
    root = tmp_path_factory.mktemp("dist_runs")
    cache = root / "cache"
    run(1, root / "single", cache, "--steps", str(STEPS))
    run(4, root / "world4", cache, "--steps", str(STEPS), "--set", "dist.pp=2", "--set", "dist.tp=2")
    return root, cache


@pytest.mark.timeout(600)
def test_four_processes_train_and_export_what_one_process_does(runs):
    root, _ = runs
    reference, world4 = records(root / "single"), records(root / "world4")
    assert_same_curve(world4, reference, range(1, STEPS + 1))
    ours, theirs = load_pretrained(root / "world4" / "hf"), load_pretrained(root / "single" / "hf")
    assert ours.state_dict().keys() == theirs.state_dict().keys()  # gathered, Mamba's packed TP layout put back
    # Adam turns fp32 noise in the tiny gradients of rare tokens' embedding rows into differences near 1e-3
    assert max(float((a - b).abs().max()) for a, b in zip(ours.state_dict().values(),
                                                          theirs.state_dict().values())) < 2e-3
    ids = torch.randint(3, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        losses = [float(model(ids, torch.roll(ids, -1, 1)).loss) for model in (ours, theirs)]
    assert abs(losses[0] - losses[1]) <= TOLERANCE
    assert json.loads((root / "world4" / "run_config.json").read_text())["dist"]["tp"] == 2


@pytest.mark.timeout(300)
def test_one_torchrun_process_on_the_distributed_path_trains_what_a_plain_process_does(runs, tmp_path):
    """A one-GPU run is torchrun with one process (a mesh of one, NCCL); `dist.backend=gloo` takes the same path on
    CPU."""
    root, cache = runs
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                           "-m", "hybridtron", "pretrain", "--out", str(tmp_path / "one"),
                           *[arg for arg in FAST if arg != "--quiet"], "--steps", str(STEPS),
                           "--set", "dist.backend=gloo"],
                          capture_output=True, text=True, timeout=240, env=environment(cache))
    assert done.returncode == 0, done.stderr[-4000:]
    assert "[dist] 1 process on cpu (gloo), layout dp_replicate=1,dp_shard=1," in done.stderr
    assert_same_curve(records(tmp_path / "one"), records(root / "single"), range(1, STEPS + 1))
    assert (tmp_path / "one" / "hf" / "config.json").is_file()


@pytest.mark.timeout(600)
def test_a_world_4_checkpoint_resumes_at_world_2_and_1_in_other_layouts(runs, tmp_path):
    """PP 2 x TP 2 on 4 processes -> DP 2 x EP 2 on 2 -> one process."""
    root, cache = runs
    reference = records(root / "single")
    at_2 = interrupted_copy(root / "world4", tmp_path / "at2", keep_step=4)
    run(2, at_2, cache, "--resume", "--set", "dist.pp=1", "--set", "dist.tp=1", "--set", "dist.ep=2")
    assert_same_curve(records(at_2), reference, range(5, STEPS + 1))
    at_1 = interrupted_copy(root / "world4", tmp_path / "at1", keep_step=2)
    run(1, at_1, cache, "--resume", "--set", "dist.pp=1", "--set", "dist.tp=1")
    assert_same_curve(records(at_1), reference, range(3, STEPS + 1))


@pytest.mark.timeout(600)
def test_a_world_4_checkpoint_resumes_on_two_processes_with_context_parallelism(runs, tmp_path):
    """PP 2 x TP 2 -> CP 2 x EP 2: each rank half of every sequence's positions, the validation loss included (a
    mean over both shares' targets)."""
    root, cache = runs
    resumed = interrupted_copy(root / "world4", tmp_path / "cp2", keep_step=4)
    run(2, resumed, cache, "--resume", "--set", "dist.pp=1", "--set", "dist.tp=1", "--set", "dist.cp=2",
        "--set", "dist.ep=2")
    got, want = records(resumed), records(root / "single")
    assert "val_loss" in got[STEPS] and any(key.startswith("mtp_loss_") for key in got[STEPS])
    assert_same_curve(got, want, range(5, STEPS + 1))


@pytest.mark.timeout(600)
def test_a_world_4_checkpoint_resumes_with_context_and_pipeline_parallelism(runs, tmp_path):
    """PP 2 x TP 2 -> CP 2 x PP 2 with the interleaved schedule (two stages per rank): each pipeline carries the ids
    past its share that MTP reads, and the validation loss, computed on the last stage (both of a rank's stages run
    for it), is a mean over both shares' targets. Also a pipeline resumed in another layout and stage cut: each
    stage keeps its own optimizer groups (the checkpoint's group 0 is one stage's)."""
    root, cache = runs
    resumed = interrupted_copy(root / "world4", tmp_path / "cp2pp2", keep_step=4)
    run(4, resumed, cache, "--resume", "--set", "dist.tp=1", "--set", "dist.cp=2",
        "--set", "dist.pp_schedule=interleaved-1f1b")
    got, want = records(resumed), records(root / "single")
    assert "val_loss" in got[STEPS] and any(key.startswith("mtp_loss_") for key in got[STEPS])
    assert_same_curve(got, want, range(5, STEPS + 1))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", [["--set", "dist.tp=2"], ["--set", "dist.tp=2", "--set", "dist.etp=2"]],
                         ids=["tp", "tp_etp"])
def test_a_single_process_checkpoint_resumes_on_two_processes_with_tp(runs, tmp_path, layout):
    """Into TP 2, and into TP 2 with each expert's width split over the TP ranks (ETP 2)."""
    root, cache = runs
    resumed = interrupted_copy(root / "single", tmp_path / "tp2", keep_step=4)
    done = run(2, resumed, cache, "--resume", *layout)
    assert "resumed from" in done.stderr and "step_000004" in done.stderr
    assert_same_curve(records(resumed), records(root / "single"), range(5, STEPS + 1))


def kill_one_rank_after_the_first_checkpoint(out: Path, cache: Path) -> subprocess.Popen:
    """A 2-process run under torchrun (`--max-restarts 1`) whose last worker is killed with SIGKILL once its first
    checkpoint is on disk; returns the finished torchrun process (its stderr read)."""
    job = subprocess.Popen(command(2, out, "--steps", str(STEPS), "--set", "dist.ep=2", restarts=1),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment(cache),
                           start_new_session=True)
    try:
        first = out / "checkpoints" / "step_000002"
        deadline = time.time() + 240
        while not first.exists() and job.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert first.exists(), "no checkpoint appeared"
        workers = [int(pid) for pid in subprocess.run(["pgrep", "-P", str(job.pid)], capture_output=True,
                                                      text=True).stdout.split()]
        assert workers, "torchrun has no workers"
        os.kill(workers[-1], signal.SIGKILL)  # one rank, mid-run: torchrun then stops the others
        job.stderr_text = job.communicate(timeout=240)[1]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    return job


@pytest.mark.timeout(600)
def test_kill_9_of_one_rank_then_torchrun_restarts_it_from_the_last_complete_checkpoint(runs, tmp_path):
    """torchrun's own restart (`--max-restarts 1`): the restarted workers find the checkpoints and resume from the
    last complete one (`train.run.restarted_by_torchrun`; a save the kill cut short is neither listed nor left
    behind), and the job ends well with the uninterrupted curve. A restart by hand (`--resume` after torchrun gave
    up) takes the same path through the run directory as the resumes above."""
    root, cache = runs
    out = tmp_path / "restarted"
    job = kill_one_rank_after_the_first_checkpoint(out, cache)
    assert job.returncode == 0, job.stderr_text[-4000:]
    resumed = re.search(r"resumed from (\S+)", job.stderr_text)
    assert resumed, job.stderr_text[-4000:]
    step = int(Path(resumed.group(1)).name.removeprefix("step_"))
    assert 2 <= step < STEPS  # the kill came before the end, after the first checkpoint
    assert not list((out / "checkpoints").glob("*.tmp-*"))
    assert_same_curve(records(out), records(root / "single"), range(1, STEPS + 1))
    assert (out / "hf" / "config.json").is_file()


@pytest.mark.timeout(300)
def test_convert_turns_a_sharded_checkpoint_into_the_hf_export_and_back_and_round_trips(runs, tmp_path):
    """DCP -> HF -> DCP -> HF: the intermediate DCP loads into a model, and converting it again (with the config.json
    and tokenizer files written beside it) gives the first HF export byte for byte."""
    import torch.distributed.checkpoint as dcp

    from hybridtron.cli import main as cli_main
    from hybridtron.model.lm import HybridLM

    root, _ = runs
    step = root / "world4" / "checkpoints" / f"step_{STEPS:06d}"
    assert cli_main(["convert", "--from", str(step), "--to", str(tmp_path / "hf")]) == 0
    converted = load_pretrained(tmp_path / "hf").state_dict()
    exported = load_pretrained(root / "world4" / "hf").state_dict()
    assert all(torch.equal(converted[k], exported[k]) for k in exported)
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    assert cli_main(["convert", "--from", str(tmp_path / "hf"), "--to", str(tmp_path / "dcp")]) == 0
    model = HybridLM(load_pretrained(tmp_path / "hf").config, init=False)
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # DCP says it loads in one process: intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
    assert all(torch.equal(state["model"][k], exported[k]) for k in exported)
    assert cli_main(["convert", "--from", str(tmp_path / "dcp"), "--to", str(tmp_path / "hf_again")]) == 0
    first = sorted(path.name for path in (tmp_path / "hf").iterdir())
    assert first == sorted(path.name for path in (tmp_path / "hf_again").iterdir())
    for name in first:
        assert (tmp_path / "hf" / name).read_bytes() == (tmp_path / "hf_again" / name).read_bytes(), name


def test_convert_of_a_run_in_progress_takes_the_tokenizer_of_the_model_it_began_with(tmp_path, small_config,
                                                                                     capsys):
    """A post-training run has no HF export until it ends: its checkpoints convert with the tokenizer files of
    `base_model` (GRPO, SFT) or `student` (MOPD); with neither, the conversion says what is missing."""
    import torch.distributed.checkpoint as dcp

    from hybridtron.checkpoint.hf import save_pretrained
    from hybridtron.cli import main as cli_main
    from hybridtron.model.lm import HybridLM

    config = small_config()
    model = HybridLM(config)
    base = tmp_path / "base"
    save_pretrained(model, base)
    (base / "tokenizer.json").write_text('{"fake": "tokenizer"}')
    for key in ("base_model", "student"):
        run_dir = tmp_path / key
        step = run_dir / "checkpoints" / "step_000010"
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save({"model": model.state_dict()}, checkpoint_id=str(step))
        (run_dir / "run_config.json").write_text(json.dumps({key: str(base), "model": config.to_hf(),
                                                             "train": {}}))
        assert cli_main(["convert", "--from", str(step), "--to", str(tmp_path / f"hf_{key}")]) == 0
        assert (tmp_path / f"hf_{key}" / "tokenizer.json").read_text() == '{"fake": "tokenizer"}'
    (tmp_path / "student" / "run_config.json").write_text(json.dumps({"model": config.to_hf(), "train": {}}))
    capsys.readouterr()
    assert cli_main(["convert", "--from", str(tmp_path / "student" / "checkpoints" / "step_000010"),
                     "--to", str(tmp_path / "no_tokenizer")]) == 0
    assert "convert: no tokenizer found" in capsys.readouterr().out
    assert (tmp_path / "no_tokenizer" / "config.json").is_file()
