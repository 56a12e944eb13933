"""The matrix optimizers of `train.optimizer` (hybridtron.train.optimizers): single steps of AdamH and MuonH against
their formulas written out here in numpy, plain Muon against torch.optim.Muon and the AdamW part against torch's
AdamW bit for bit, the sphere kept over a run (per expert for stacked experts), the parameter split, the state
round trip and a resumed Trainer, and the one-line errors. The sharded layouts: tests/distributed/test_hyperball_dist.py."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from hybridtron.checkpoint.dcp import CheckpointManager
from hybridtron.model.lm import HybridLM
from hybridtron.train.config import RunConfig, TrainConfig, resume_changes
from hybridtron.train.loop import Trainer
from hybridtron.train.optimizers import MatrixOptimizer, build_optimizer, parameter_split, short_name

BETAS, EPS, LR = (0.9, 0.95), 1e-8, 0.1
NS_A, NS_B, NS_C = 3.4445, -4.7750, 2.0315  # Keller Jordan's quintic Newton-Schulz coefficients


def one_group_optimizer(rule: str, *params, momentum: float = 0.95, weight_decay: float = 0.0):
    return MatrixOptimizer([{"rule": rule, "params": list(params), "weight_decay": weight_decay}], lr=LR,
                           betas=BETAS, eps=EPS, momentum=momentum)


def sphere(p: np.ndarray, u: np.ndarray, radius: float) -> np.ndarray:
    moved = p - LR * radius * u / np.linalg.norm(u)
    return radius * moved / np.linalg.norm(moved)


def newton_schulz_np(x: np.ndarray) -> np.ndarray:
    """The quintic iteration in float64 (torch's runs it in bf16)."""
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / np.linalg.norm(x)
    for _ in range(5):
        gram = x @ x.T
        x = NS_A * x + (NS_B * gram + NS_C * gram @ gram) @ x
    return x.T if tall else x


def test_adamh_first_step_by_hand():
    p0 = np.array([[3.0, 0.0, 1.0], [0.0, 4.0, -2.0]])
    g = np.array([[1.0, -2.0, 0.5], [0.0, 0.25, -4.0]])
    # step 1: the bias-corrected moments are g and g^2, so u = g / (|g| + eps)
    u = g / (np.abs(g) + EPS)
    want = sphere(p0, u, np.linalg.norm(p0))
    param = torch.nn.Parameter(torch.tensor(p0, dtype=torch.float64))
    param.grad = torch.tensor(g)
    one_group_optimizer("adamh", param).step()
    assert np.allclose(param.detach().numpy(), want, atol=1e-12, rtol=0)
    # step 2 with the same gradient: m = g, v = g^2 after bias correction again; the radius stays the first norm
    optimizer = one_group_optimizer("adamh", param2 := torch.nn.Parameter(torch.tensor(p0)))
    for _ in range(2):
        param2.grad = torch.tensor(g)
        optimizer.step()
    assert np.allclose(param2.detach().numpy(), sphere(want, u, np.linalg.norm(p0)), atol=1e-12, rtol=0)
    assert float(optimizer.state[param2]["radius"]) == np.linalg.norm(p0)


def test_adamh_keeps_each_expert_on_its_own_sphere():
    p0 = np.stack([np.array([[1.0, 2.0], [0.0, -1.0]]), np.array([[10.0, 0.0], [3.0, 4.0]])])
    g = np.stack([np.array([[0.5, -1.0], [2.0, 0.0]]), np.array([[1.0, 1.0], [-1.0, 3.0]])])
    u = g / (np.abs(g) + EPS)
    want = np.stack([sphere(p0[e], u[e], np.linalg.norm(p0[e])) for e in range(2)])
    param = torch.nn.Parameter(torch.tensor(p0))
    param.grad = torch.tensor(g)
    optimizer = one_group_optimizer("adamh", param)
    optimizer.step()
    assert np.allclose(param.detach().numpy(), want, atol=1e-12, rtol=0)
    assert optimizer.state[param]["radius"].flatten().tolist() == [np.linalg.norm(p0[0]), np.linalg.norm(p0[1])]


def test_muonh_step_by_hand():
    # a gradient whose singular values are equal: Newton-Schulz keeps its direction, so u / ||u|| = g / ||g||
    p0 = np.array([[1.0, -2.0, 2.0], [0.5, 1.0, 0.0]])
    g = np.array([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0]])
    param = torch.nn.Parameter(torch.tensor(p0, dtype=torch.float32))
    param.grad = torch.tensor(g, dtype=torch.float32)
    one_group_optimizer("muonh", param).step()
    assert np.allclose(param.detach().numpy(), sphere(p0, g, np.linalg.norm(p0)), atol=1e-6, rtol=0)
    # any gradient: Nesterov momentum from a zero buffer is (1 - mu + mu (1 - mu)) g, then the quintic iteration
    generator = np.random.default_rng(0)
    p0, g = generator.standard_normal((4, 6)), generator.standard_normal((4, 6))
    u = newton_schulz_np((1 - 0.95 + 0.95 * 0.05) * g)
    param = torch.nn.Parameter(torch.tensor(p0, dtype=torch.float32))
    param.grad = torch.tensor(g, dtype=torch.float32)
    one_group_optimizer("muonh", param).step()
    got = param.detach().numpy()
    assert abs(np.linalg.norm(got) - np.linalg.norm(p0)) < 1e-5
    # torch iterates in bf16: its orthogonalized matrix is 2% (relative Frobenius) from the float64 one here, so each
    # entry may miss by a few % of a step's typical entry, LR * R / sqrt(size)
    step_entry = LR * np.linalg.norm(p0) / np.sqrt(p0.size)
    assert np.allclose(got, sphere(p0, u, np.linalg.norm(p0)), atol=0.05 * step_entry, rtol=0)


def test_plain_muon_is_torchs_muon_and_stacks_are_per_expert():
    torch.manual_seed(0)
    ours, theirs = torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(6, 4))
    theirs.data.copy_(ours.data)
    stack = torch.nn.Parameter(torch.randn(2, 6, 4))
    experts = [torch.nn.Parameter(stack.detach()[e].clone()) for e in range(2)]
    optimizer = one_group_optimizer("muon", ours, stack, weight_decay=0.1)
    reference = torch.optim.Muon([theirs, *experts], lr=LR, weight_decay=0.1, momentum=0.95)
    for _ in range(3):
        grad = torch.randn(6, 4)
        stack_grad = torch.randn(2, 6, 4)
        ours.grad, theirs.grad, stack.grad = grad, grad.clone(), stack_grad
        for e, expert in enumerate(experts):
            expert.grad = stack_grad[e].clone()
        optimizer.step()
        reference.step()
    assert torch.equal(ours, theirs)
    assert all(torch.equal(stack[e], experts[e]) for e in range(2))


def test_the_adamw_share_is_torchs_adamw_bit_for_bit(small_config):
    torch.manual_seed(0)
    model = HybridLM(small_config())
    rest = {name for name, _ in parameter_split(model, "muonh")["adamw"]}
    for name, p in model.named_parameters():  # the matrices frozen, so both models see the same gradients
        p.requires_grad_(name in rest)
    twin = copy.deepcopy(model)
    config = TrainConfig(optimizer="muonh", adam_lr=2e-3, weight_decay=0.1)
    ours = build_optimizer(model, config)
    named = [(n, p) for n, p in twin.named_parameters() if n in rest]
    theirs = torch.optim.AdamW([{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
                                {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}],
                               lr=2e-3, betas=(config.beta1, config.beta2), eps=config.eps, foreach=True)
    ids = torch.randint(3, 128, (2, 16))
    for _ in range(2):
        for m in (model, twin):
            m(ids, torch.roll(ids, -1, 1)).loss.backward()
        for group in ours.param_groups:
            group["lr"] = 3e-3 * group.get("lr_ratio", 1.0)
        ours.step()
        theirs.step()
        ours.zero_grad(), theirs.zero_grad(), twin.zero_grad()
    weights = dict(model.named_parameters())
    assert all(torch.equal(weights[name], p) for name, p in named)


def test_default_is_torchs_adamw_as_before(small_config):
    model = HybridLM(small_config())
    optimizer = build_optimizer(model, TrainConfig())
    assert type(optimizer) is torch.optim.AdamW
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.1, 0.0]
    assert all(p.dim() >= 2 for p in optimizer.param_groups[0]["params"])


@pytest.mark.parametrize("name", ["adamh", "muonh"])
def test_every_hyperball_matrix_keeps_its_initial_norm_over_50_steps(small_config, name):
    torch.manual_seed(0)
    model = HybridLM(small_config(vocab_size=256))
    optimizer = build_optimizer(model, TrainConfig(optimizer=name, lr=0.05))
    spheres = parameter_split(model, name)
    matrices = spheres.get("adamh", []) + spheres.get("muonh", [])
    stacked = [(n, p) for n, p in matrices if p.dim() == 3]
    assert stacked, "the preset has stacked experts"

    def norms():
        return {n: torch.linalg.vector_norm(p.detach().double(), dim=tuple(range(p.dim() - 2, p.dim())))
                for n, p in matrices}

    initial = norms()
    for _ in range(50):
        ids = torch.randint(3, 256, (2, 16))
        model(ids, torch.randint(3, 256, (2, 16))).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    for n, norm in norms().items():
        assert torch.allclose(norm, initial[n], rtol=1e-5, atol=0), n  # per expert for the stacks


def test_the_split_by_name_pattern(small_config):
    model = HybridLM(small_config())
    patterns = {optimizer: {rule: {short_name(n) for n, _ in named}
                            for rule, named in parameter_split(model, optimizer).items()}
                for optimizer in ("adamh", "muonh", "muon")}
    rest = {"embeddings", "norm", "norm_f", "enorm", "hnorm", "final_layernorm", "dt_bias", "A_log", "D", "conv1d",
            "conv1d.bias"}
    hidden = {"in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate", "fc1_latent_proj",
              "fc2_latent_proj", "experts.up_proj", "experts.down_proj", "shared_experts.up_proj",
              "shared_experts.down_proj", "up_proj", "down_proj", "eh_proj"}
    assert patterns["adamh"] == {"adamw": rest, "adamh": hidden | {"lm_head"}}
    assert patterns["muonh"] == {"adamw": rest, "muonh": hidden, "adamh": {"lm_head"}}
    assert patterns["muon"] == {"adamw": rest | {"lm_head"}, "muon": hidden}


def train_a_little(model, optimizer, steps: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(3, 128, (2, 16), generator=generator)
        model(ids, torch.roll(ids, -1, 1)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("name", ["adamh", "muonh", "muon"])
def test_state_dict_round_trip_resumes_bit_for_bit(small_config, name):
    torch.manual_seed(0)
    config = TrainConfig(optimizer=name)
    model = HybridLM(small_config())
    optimizer = build_optimizer(model, config)
    train_a_little(model, optimizer, 2, seed=1)
    resumed = copy.deepcopy(model)
    for p in resumed.parameters():  # a fresh optimizer over moved weights: its own radius would be the moved norm
        p.data.mul_(1.5)
    fresh = build_optimizer(resumed, config)
    fresh.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    resumed.load_state_dict(model.state_dict())
    train_a_little(model, optimizer, 2, seed=2)
    train_a_little(resumed, fresh, 2, seed=2)
    weights = dict(resumed.named_parameters())
    assert all(torch.equal(weights[n], p) for n, p in model.named_parameters())


def test_a_trainer_resumes_from_a_checkpoint_bit_for_bit(tmp_path, small_config):
    from test_trainer import CopyObjective, CopyTask  # the trainer tests' toy task

    def make(directory):
        model = HybridLM(small_config())
        config = TrainConfig(steps=6, lr=1e-2, warmup_steps=1, checkpoint_every=3, val_every=1000, optimizer="muonh")
        return Trainer(model, CopyObjective(), CopyTask(model.config.vocab_size), config,
                       CheckpointManager(directory, keep=3))

    torch.manual_seed(0)
    whole = make(tmp_path / "whole")
    whole.train()
    torch.manual_seed(0)
    first = make(tmp_path / "resumed")
    first.train(until=3)
    first.checkpoints.wait()
    torch.manual_seed(7)
    second = make(tmp_path / "resumed")
    second.load_checkpoint(second.checkpoints.latest())
    second.train()
    weights = dict(second.model.named_parameters())
    assert all(torch.equal(weights[n], p) for n, p in whole.model.named_parameters())


def test_errors_are_one_line(small_config, pretrain_config):
    with pytest.raises(ValueError, match=r"train.optimizer must be one of adamw, adamh, muonh, muon, got 'sgd'"):
        pretrain_config("train.optimizer=sgd")
    model = HybridLM(small_config())
    with torch.no_grad():
        model.backbone.layers[1].mixer.o_proj.weight.zero_()
    with pytest.raises(ValueError, match=r"backbone\.layers\.1\.mixer\.o_proj\.weight has a zero initial norm"):
        build_optimizer(model, TrainConfig(optimizer="adamh"))
    build_optimizer(model, TrainConfig(optimizer="muon"))  # plain Muon keeps no sphere: a zero matrix is fine


def test_resume_refuses_another_optimizer_and_accepts_its_hyperparameters():
    saved = RunConfig(train=TrainConfig(optimizer="adamh"))
    applied, refused = resume_changes(saved, RunConfig(train=TrainConfig(optimizer="muonh", adam_lr=1e-3)))
    assert [change.key for change in refused] == ["train.optimizer"]
    assert [change.key for change in applied] == ["train.adam_lr"]
