"""Shared fixtures: every test starts from the same seed, and `small_config` builds a model config with all four
layer kinds that runs in milliseconds on a CPU."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from xdist.scheduler import LoadScopeScheduling

from hybridtron.checkpoint import save_pretrained
from hybridtron.config import ModelConfig, parse_pattern
from hybridtron.data.chat import save_tokenizer_files
from hybridtron.data.tokenizer import Tokenizer
from hybridtron.model.lm import HybridLM

# Tests run tiny tensors, where intra-op threads cost more in synchronisation than they save; on a busy CPU the
# OpenMP barriers of 2 threads turn a 5 us matmul into 5 ms. One thread is also the more reproducible setting.
torch.set_num_threads(1)


# The modules that take longest (measured; most of them keep two or more processes busy at once: torchrun worlds,
# RL role processes, Ray actors), the longest first. scripts/test.sh runs the suite on two pytest-xdist workers with
# `--dist loadgroup`: each module is a group, run on one worker (its module fixtures built once), and these start
# first, so that both workers end on short modules together. (One worker running every multi-process module in turn
# would be the long pole: they are half the suite's time.)
LONGEST_MODULES = (
    "tests/distributed/test_dist_checkpoints.py", "tests/experiments/test_ladder.py", "tests/distributed/test_dist_rl.py",
    "tests/with_vllm/test_vllm_rollouts.py", "tests/with_vllm/test_vllm_exports.py",
    "tests/post/test_roles.py", "tests/distributed/test_parallel_layouts.py", "tests/train/test_pretrain.py",
    "tests/post/test_grpo.py", "tests/train/test_run_scaffold.py", "tests/post/test_mopd.py",
    "tests/recipe/test_pipeline.py", "tests/distributed/test_dist_sft.py", "tests/distributed/test_hyperball_dist.py",
    "tests/distributed/test_ring_attention.py", "tests/train/test_monitor.py", "tests/train/test_report.py",
    "tests/train/test_fault_injection.py", "tests/distributed/test_document_mask_layouts.py", "tests/train/test_golden.py",
    "tests/infer/test_compiled_decode.py", "tests/train/test_preflight.py",
)


class ModuleGroupScheduling(LoadScopeScheduling):
    """`--dist loadgroup` with this suite's groups, its modules, decided here from the node ids: `LONGEST_MODULES`
    first, then the rest with the most tests first. pytest-xdist's own loadgroup reads the groups from `@group`
    suffixes it writes into the node ids in each worker; pytest 9.2's structured node ids drop that write
    (pytest-xdist issue 1386), and every test was then scheduled on its own, module fixtures built on both workers."""

    def _split_scope(self, nodeid: str) -> str:
        return nodeid.split("::", 1)[0]

    def _assign_work_unit(self, node) -> None:
        longest = next((module for module in LONGEST_MODULES if module in self.workqueue), None)
        if longest is not None:
            self.workqueue.move_to_end(longest, last=False)
        super()._assign_work_unit(node)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: `-p no:xdist` runs have no such hook
def pytest_xdist_make_scheduler(config, log):
    return ModuleGroupScheduling(config, log) if config.getvalue("dist") == "loadgroup" else None


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _small_config(**overrides) -> ModelConfig:
    base = dict(
        vocab_size=128, hidden_size=48, layers_block_type=parse_pattern("M*E-ME"),
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, intermediate_size=64,
        mamba_num_heads=4, mamba_head_dim=8, n_groups=2, ssm_state_size=8, conv_kernel=4, chunk_size=8,
        n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, moe_shared_expert_intermediate_size=32,
        moe_latent_size=16, routed_scaling_factor=2.5, n_group=4, topk_group=2,
        num_nextn_predict_layers=1, max_position_embeddings=256,
    )
    base.update(overrides)
    return ModelConfig(**base)


@pytest.fixture(scope="session")  # a pure function: module-scoped fixtures may use it too
def small_config():
    """`small_config(**overrides)`: Mamba, attention, LatentMoE (grouped routing) and dense layers, with MTP."""
    return _small_config


def _random_policy(directory: Path, config: ModelConfig, words: list[str], *, texts: int = 300) -> Path:
    """`directory` made an HF checkpoint of a random `config` model (seed 0) with a 512-token chat tokenizer trained on
    `texts` strings of 30 random `words` (the vocabulary of the prompts its test samples), its context the model's."""
    tokenizer = Tokenizer.train([" ".join(random.Random(i).choices(words, k=30)) for i in range(texts)], 512)
    torch.manual_seed(0)
    save_pretrained(HybridLM(config), directory)
    save_tokenizer_files(tokenizer, directory, model_max_length=config.max_position_embeddings)
    return directory


@pytest.fixture(scope="session")  # a pure function: module-scoped fixtures may use it too
def random_policy():
    """`random_policy(directory, config, words, texts=300)`: a random policy checkpoint with its chat tokenizer."""
    return _random_policy


def _pretrain_config(*overrides: str, preset: str | None = None, config: str | Path | None = None):
    from hybridtron.cli import build_parser
    from hybridtron.train.pretrain import COMMAND

    argv = ["pretrain", *(["--preset", preset] if preset else []), *(["--config", str(config)] if config else []),
            *(arg for override in overrides for arg in ("--set", override))]
    return COMMAND.resolve(build_parser(load="pretrain").parse_args(argv))[0]


@pytest.fixture(scope="session")
def pretrain_config():
    """`pretrain_config(*overrides, preset=, config=)`: the RunConfig `hybridtron pretrain [--preset P] [--config F]
    --set OVERRIDE ...` runs with, resolved by the run scaffold as the command line is."""
    return _pretrain_config


def _decoding_model(config: ModelConfig) -> HybridLM:
    model = HybridLM(config).eval()
    with torch.no_grad():
        for bias in model.router_biases():
            bias.uniform_(-0.05, 0.05)
    return model


@pytest.fixture(scope="session")
def decoding_model():
    """`decoding_model(config)`: a model in eval mode with a random router bias, so that every layer and every
    routing choice moves the logits a decoding test compares."""
    return _decoding_model


def _seq_idx_by_hand(ids_BT: torch.Tensor, bos: int) -> torch.Tensor:
    seq_idx = torch.zeros_like(ids_BT)
    for r in range(ids_BT.shape[0]):
        for t in range(1, ids_BT.shape[1]):
            seq_idx[r, t] = seq_idx[r, t - 1] + int(ids_BT[r, t] == bos)
    return seq_idx


@pytest.fixture(scope="session")
def seq_idx_by_hand():
    """`seq_idx_by_hand(ids_BT, bos)`: the document mask spelled out, position by position: each row starts at
    document 0 and moves to the next at every bos after its first position."""
    return _seq_idx_by_hand


def _trained_run(root: Path, preset: str) -> Path:
    import argparse

    from hybridtron.train import pretrain

    overrides = ["data.families=json,text,functional", "data.vocab_size=512", "model.vocab_size=512",
                 f"data.cache_dir={root / 'cache'}", "data.seq_len=64", "data.batch_size=4", "data.val_batches=2",
                 "train.val_every=1000", "train.checkpoint_every=1000", "train.warmup_steps=5", "train.lr=3e-3"]
    args = argparse.Namespace(preset=preset, out=str(root / "run"), steps=30, config=None, overrides=overrides,
                              resume=False, quiet=True, print_config=False)
    assert pretrain.run(args) == 0
    return root / "run"


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
    """A run directory of `hybridtron pretrain` trained for 30 steps on a few stdlib families (a 512-token vocabulary,
    64-token rows): a checkpoint whose weights have moved from their initialization, for parity tests on real text.
    Built once per session (about 15 s)."""
    return _trained_run(tmp_path_factory.mktemp("trained"), "tiny")


@pytest.fixture(scope="session")
def trained_dense_run(tmp_path_factory):
    """`trained_run` of the `tiny-dense` preset (Mamba-2, attention and MLP layers: what vLLM's CPU backend runs)."""
    return _trained_run(tmp_path_factory.mktemp("trained_dense"), "tiny-dense")
