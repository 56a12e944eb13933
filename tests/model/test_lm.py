"""HybridLM: the loss and its MTP part, the labels convention, init, input checks, and parameter counts of the
published presets on the meta device."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hybridtron.config import nano3, super3, ultra3
from hybridtron.model.lm import IGNORE_INDEX, PAST_END, HybridLM, mtp_targets


# ------------------------------------------------------------------------------------------ labels convention
def test_mtp_targets_never_cross_an_ignored_label():
    labels = torch.tensor([[5, 6, -100, 7, 8, 9, 10]])
    # depth k at t predicts labels[t+k], only where labels[t..t+k] are all valid
    assert mtp_targets(labels, 1).tolist() == [[6, -100, -100, 8, 9, 10, -100]]
    assert mtp_targets(labels, 2).tolist() == [[-100, -100, -100, 9, 10, -100, -100]]
    assert mtp_targets(labels, 3).tolist() == [[-100, -100, -100, 10, -100, -100, -100]]
    assert (mtp_targets(labels, 7) == IGNORE_INDEX).all()


def test_mtp_targets_against_definition():
    labels = torch.randint(0, 50, (3, 40))
    labels[torch.rand(3, 40) < 0.15] = IGNORE_INDEX
    for depth in (1, 2, 3):
        targets = mtp_targets(labels, depth)
        for b in range(3):
            for t in range(40):
                window = labels[b, t:t + depth + 1]
                valid = t + depth < 40 and bool((window != IGNORE_INDEX).all())
                assert targets[b, t] == (labels[b, t + depth] if valid else IGNORE_INDEX)


# ----------------------------------------------------------------------------------------------------- loss
@pytest.mark.parametrize("depths", [1, 2, 3])
def test_loss_is_ce_plus_weighted_mean_of_depth_ces(small_config, depths):
    config = small_config(mtp_num_depths=depths, mtp_loss_weight=0.3)
    model = HybridLM(config)
    ids = torch.randint(0, config.vocab_size, (2, 15))
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    labels[0, 6] = IGNORE_INDEX  # a document boundary
    out = model(ids, labels)

    assert len(out.mtp_logits) == len(out.mtp_losses) == depths
    lm_loss = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    depth_losses = [F.cross_entropy(logits.flatten(0, 1), mtp_targets(labels, k).flatten(), ignore_index=IGNORE_INDEX)
                    for k, logits in enumerate(out.mtp_logits, start=1)]
    torch.testing.assert_close(out.lm_loss, lm_loss)
    torch.testing.assert_close(torch.stack(out.mtp_losses), torch.stack(depth_losses))
    torch.testing.assert_close(out.loss, lm_loss + 0.3 * sum(depth_losses) / depths)
    # near uniform at init: each CE is close to log(vocab)
    assert abs(lm_loss.item() - math.log(config.vocab_size)) < 0.1
    # one stored block, whatever the depth
    assert sum(1 for name, _ in model.named_parameters() if name.startswith("mtp.layers.0.eh_proj")) == 1


def test_mtp_depths_chain_through_one_shared_block(small_config):
    """Depth k at position t reads the embedding of token t+k and the previous depth's hidden state (h_0 = the
    backbone's normed output), and applies the same block each time."""
    config = small_config(mtp_num_depths=2)
    model = HybridLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 12))
    with torch.no_grad():
        out = model(ids)
        embeddings = model.backbone.embeddings(ids)
        h1 = model.mtp(out.hidden[:, :-1], embeddings[:, 1:])
        h2 = model.mtp(h1[:, :-1], embeddings[:, 2:])
    torch.testing.assert_close(out.mtp_logits[0][:, :-1], model.lm_head(h1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.mtp_logits[1][:, :-2], model.lm_head(h2), rtol=1e-5, atol=1e-6)


def test_mtp_off_and_absent(small_config):
    config = small_config()
    ids = torch.randint(0, config.vocab_size, (1, 9))
    labels = torch.randint(0, config.vocab_size, (1, 9))
    model = HybridLM(config)
    out = model(ids, labels, mtp=False)
    assert out.mtp_logits == [] and out.mtp_losses == []
    torch.testing.assert_close(out.loss, out.lm_loss)
    no_mtp = HybridLM(config.replace(num_nextn_predict_layers=0))
    assert no_mtp.mtp is None and not any(n.startswith("mtp.") for n, _ in no_mtp.named_parameters())
    assert no_mtp(ids, labels).mtp_losses == []


def test_following_ids_give_a_window_the_mtp_inputs_of_the_whole_sequence(small_config):
    """A window of a longer sequence (a context-parallel share) with the ids after it: its backbone and every MTP
    depth compute what the whole sequence computes at its positions; without them its last positions see padding."""
    torch.manual_seed(0)
    config = small_config(mtp_num_depths=2)
    model = HybridLM(config).eval()
    ids = torch.randint(3, config.vocab_size, (2, 24))
    with torch.no_grad():
        whole = model(ids, logits=False)
        window = model(ids[:, :16], logits=False, following_ids=ids[:, 16:18])
        padded = model(ids[:, :16], logits=False)
    torch.testing.assert_close(window.hidden, whole.hidden[:, :16])
    assert len(window.mtp_hidden) == 2
    for got, want in zip(window.mtp_hidden, whole.mtp_hidden):
        torch.testing.assert_close(got, want[:, :16])
    assert not torch.allclose(padded.mtp_hidden[0][:, -1], whole.mtp_hidden[0][:, 15])
    torch.testing.assert_close(padded.mtp_hidden[0][:, :-1], whole.mtp_hidden[0][:, :15])
    with torch.no_grad():  # the last share: fewer following ids than depths, the rest padded as at an end
        short = model(ids[:, :16], logits=False, following_ids=ids[:, 16:17])
    torch.testing.assert_close(short.mtp_hidden[0], whole.mtp_hidden[0][:, :16])
    with torch.no_grad():  # the end marked instead (a rank's tail chunk of the sequence): the same padding
        ended = torch.cat([ids[:, 16:17], torch.full((2, 1), PAST_END)], dim=1)
        marked = model(ids[:, :16], logits=False, following_ids=ended)
    torch.testing.assert_close(marked.mtp_hidden[1], short.mtp_hidden[1], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"following_ids must lie in \[0, vocab_size=\d+\) or PAST_END \(-1\)"):
        model(ids[:, :16], following_ids=torch.full((2, 2), config.vocab_size))


def test_gradients_reach_every_parameter(small_config):
    config = small_config()
    model = HybridLM(config)
    ids = torch.randint(0, config.vocab_size, (2, 24))
    model(ids, torch.roll(ids, -1, 1)).loss.backward()
    no_grad = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert no_grad == []
    assert all(b.grad is None for b in model.router_biases())  # the bias is a buffer, never trained by backprop


def test_forward_rejects_bad_inputs(small_config):
    model = HybridLM(small_config())
    with pytest.raises(ValueError, match=r"vocab_size=128"):
        model(torch.tensor([[1, 128]]))
    with pytest.raises(ValueError, match=r"integer tensor \[batch, time\]"):
        model(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="labels shape"):
        model(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long))


def test_init_follows_the_spec(small_config):
    config = small_config(mamba_num_heads=8, n_groups=2, time_step_min=0.01, time_step_max=0.2)
    model = HybridLM(config)
    mixer = model.backbone.layers[0].mixer
    torch.testing.assert_close(mixer.A_log, torch.log(torch.arange(1.0, 9.0)))
    assert (mixer.D == 1).all()
    dt = F.softplus(mixer.dt_bias)
    assert dt.min() >= 0.01 * (1 - 1e-5) and dt.max() <= 0.2 * (1 + 1e-5)
    assert model.lm_head.weight.std().item() == pytest.approx(config.initializer_range, rel=0.05)
    mamba_out_std = mixer.out_proj.weight.std().item()
    assert mamba_out_std == pytest.approx(config.initializer_range / math.sqrt(config.num_hidden_layers), rel=0.1)
    assert all(torch.equal(b, torch.zeros_like(b)) for b in model.router_biases())


def test_initializers_set_every_tensor_once_and_init_draws_nothing_else(small_config):
    """Every parameter and buffer has one initializer; building the model draws from the generator only through
    them (the modules are built on the meta device), so the weights and the generator's state after the build are
    those of running the initializers from the seed on a model built any other way (as a sharded build does)."""
    config = small_config()
    torch.manual_seed(3)
    model = HybridLM(config)
    after_build = torch.get_rng_state()
    names = [name for name, _ in model.initializers()]
    assert sorted(names) == sorted([*dict(model.named_parameters()), *dict(model.named_buffers())])
    assert len(set(names)) == len(names)
    replayed = HybridLM(config, init=False)  # its modules' own initializations drew from the generator
    torch.manual_seed(3)
    replayed.init_weights()
    assert torch.equal(torch.get_rng_state(), after_build)
    for (name, tensor), (_, again) in zip(model.state_dict().items(), replayed.state_dict().items()):
        assert torch.equal(tensor, again), name


# -------------------------------------------------------------------------------------------- parameter counts
@pytest.mark.parametrize("preset, total, active", [(nano3, 31.6e9, 3.2e9), (super3, 120.7e9, 12.2e9),
                                                   (ultra3, 549e9, 55.0e9)])
def test_published_parameter_counts_on_meta(preset, total, active):
    model = HybridLM.on_meta(preset())
    assert all(p.is_meta for p in model.parameters()) and all(b.is_meta for b in model.buffers())
    assert model.num_parameters() == pytest.approx(total, rel=0.01)
    assert model.num_parameters(active=True) == pytest.approx(active, rel=0.01)
    if model.mtp is not None:  # MTP is counted apart: one attention + one MoE layer and the eh_proj
        mtp = sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))
        assert model.num_parameters(include_mtp=True) == model.num_parameters() + mtp


def test_num_parameters_matches_a_hand_count(small_config):
    config = small_config(layers_block_type=("moe",), num_nextn_predict_layers=0, moe_latent_size=None)
    model = HybridLM(config)
    H, V, E, I, Is = (config.hidden_size, config.vocab_size, config.n_routed_experts, config.moe_intermediate_size,
                      config.moe_shared_expert_intermediate_size)
    k = config.num_experts_per_tok
    rest = H + E * H + 2 * H * Is + H + V * H  # block norm, router, shared expert, norm_f, lm_head
    assert model.num_parameters() == V * H + rest + E * 2 * I * H
    assert model.num_parameters(active=True) == rest + k * 2 * I * H
