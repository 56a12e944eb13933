"""The output layer's Megatron-style gradient accumulation (divergence 1): exact in fp32, lossy in bf16."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridtron.model.lm import HybridLM
from hybridtron.numerics.grad_accum import (
    MainGradLinear, accumulate_, accumulate_in, apply_output_grad_accumulation, flush_main_grads, mtp_survival,
    record_output_wgrads,
)
from hybridtron.numerics.policy import apply_precision


def micro_batches(count: int, batch: int, seq: int, vocab: int, seed: int = 1):
    """Token ids drawn from a Zipf law (frequent tokens, as text), labels the next token."""
    probs = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.multinomial(probs, batch * (seq + 1), replacement=True, generator=generator).view(batch, seq + 1)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def test_accumulate_rounds_once_to_the_buffer_dtype():
    one = lambda dtype: torch.ones(3, dtype=dtype)  # noqa: E731
    # bf16 around 1.0: spacing 2^-7, so an addend below half of it (2^-8) vanishes, a tie goes to even (1.0).
    addend = torch.tensor([2.0 ** -9, 2.0 ** -8, 2.0 ** -8 + 2.0 ** -16])
    assert accumulate_(one(torch.bfloat16), addend).tolist() == [1.0, 1.0, 1.0 + 2.0 ** -7]
    assert accumulate_(one(torch.float32), addend).tolist() == (1.0 + addend).tolist()
    # 256 addends of 2^-9 each: fp32 sums them to 1.5; bf16 never moves off 1.0 -- the running sum is 2^9 times
    # larger than each addend, which falls off the end of bf16's 7 stored mantissa bits every time.
    bf16, fp32 = one(torch.bfloat16), one(torch.float32)
    for _ in range(256):
        accumulate_(bf16, torch.full((3,), 2.0 ** -9))
        accumulate_(fp32, torch.full((3,), 2.0 ** -9))
    assert bf16.tolist() == [1.0] * 3 and fp32.tolist() == [1.5] * 3


def train_grads(model, batches, convert):
    """Weight gradients after the micro-batches, as the Trainer computes them (loss / M, flush at the end)."""
    convert(model)
    for input_ids, labels in batches:
        (model(input_ids, labels).loss / len(batches)).backward()
    flush_main_grads(model)
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("recipe", [None, "nvfp4"])
def test_fp32_main_grad_equals_autograd_accumulation(small_config, recipe):
    """With an fp32 buffer the wrapped output layer gives autograd's gradients (to fp32 summation order) -- also
    when lm_head is an NVFP4 QuantLinear (same SR stream): the wrapper changes only where wgrads are summed."""
    torch.manual_seed(0)
    reference = HybridLM(small_config())
    batches = micro_batches(3, 2, 16, 128)
    expected_model = HybridLM(small_config())
    expected_model.load_state_dict(reference.state_dict())
    wrapped_model = HybridLM(small_config())
    wrapped_model.load_state_dict(reference.state_dict())

    def precision(model):
        if recipe is not None:
            apply_precision(model, recipe, "all")

    expected = train_grads(expected_model, batches, precision)
    got = train_grads(wrapped_model, batches,
                      lambda m: (precision(m), setattr(m, "lm_head", MainGradLinear(m.lm_head, "fp32"))))
    assert got.keys() == expected.keys()
    for name in expected:
        if name == "lm_head.weight":
            torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-7)
        else:  # dgrad is untouched: everything upstream is bit-identical
            assert torch.equal(got[name], expected[name]), name
    assert wrapped_model.lm_head.main_grad.abs().max() == 0  # flushed and zeroed


def test_bf16_main_grad_is_lossy_and_flushes_to_fp32(small_config):
    torch.manual_seed(0)
    model = HybridLM(small_config())
    head = apply_output_grad_accumulation(model, "bf16")
    assert isinstance(head, MainGradLinear) and model.lm_head is head
    for input_ids, labels in micro_batches(4, 2, 16, 128):
        (model(input_ids, labels).loss / 4).backward()
        assert model.lm_head.weight.grad is None  # nothing reaches the Parameter until the flush
    buffer = head.main_grad.clone()
    flush_main_grads(model)
    assert head.weight.grad.dtype == torch.float32 and torch.equal(head.weight.grad, buffer.float())
    assert head.main_grad.abs().max() == 0


def test_the_accumulation_dtype_changes_only_when_the_buffer_is_empty(small_config):
    model = HybridLM(small_config())
    head = apply_output_grad_accumulation(model, "bf16")
    input_ids, labels = micro_batches(1, 2, 16, 128)[0]
    model(input_ids, labels).loss.backward()
    with pytest.raises(RuntimeError, match="unflushed"):
        head.set_accum_dtype("fp32")
    flush_main_grads(model)
    head.set_accum_dtype("fp32")
    assert head.accum_dtype == "fp32" and head.main_grad.dtype == torch.float32
    with pytest.raises(ValueError, match="grad_accum_dtype must be one of"):
        head.set_accum_dtype("fp8")


@pytest.mark.parametrize("recipe", [None, "nvfp4"])
def test_wrapper_keeps_state_dict_names_and_parameters(small_config, recipe):
    model = HybridLM(small_config())
    if recipe is not None:
        apply_precision(model, recipe, "all")
    keys, weight = list(model.state_dict()), model.lm_head.weight
    assert apply_output_grad_accumulation(model, "fp32") is None and model.lm_head.weight is weight
    apply_output_grad_accumulation(model, "bf16")
    assert list(model.state_dict()) == keys  # main_grad is not persistent: not in checkpoints
    assert model.lm_head.weight is weight
    assert [n for n, _ in model.named_parameters()].count("lm_head.weight") == 1
    with pytest.raises(ValueError, match="grad_accum_dtype"):
        apply_output_grad_accumulation(model, "fp16")


def test_recorded_additions_are_one_per_application(small_config):
    model = HybridLM(small_config())
    additions = record_output_wgrads(model, micro_batches(2, 1, 16, 128))
    depths = model.config.mtp_num_depths
    assert len(additions) == 2 * (1 + depths)
    assert sorted(a for a, _ in additions[: 1 + depths]) == list(range(1 + depths))
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight.grad is None  # left as it was
    exact = sum(w.double() for _, w in additions)
    torch.testing.assert_close(accumulate_in(additions, "fp32"), exact, rtol=1e-5, atol=1e-9)


def test_mtp_contribution_survives_fp32_but_not_bf16(small_config):
    """Divergence 1 measured. Each micro-batch adds the main head's wgrad and, 20x smaller (loss weight 0.05 per
    depth), each MTP depth's. The running sum grows with the micro-batches while the addends do not, so ever more
    MTP addends fall below half a bf16 spacing of the sum (2^-8 of it) and vanish. A stream that cycles through 8
    micro-batches makes the sum grow as a coherent gradient does, at no extra compute. fp32 keeps all of it."""
    torch.manual_seed(0)
    model = HybridLM(small_config())
    additions = record_output_wgrads(model, micro_batches(8, 2, 32, 128))
    per_micro_batch = 1 + model.config.mtp_num_depths
    kept = {}
    for count in (16, 64, 512):
        stream = (additions * (count // 8))[: count * per_micro_batch]
        fp32, bf16 = mtp_survival(stream, "fp32"), mtp_survival(stream, "bf16")
        assert 0.02 < fp32.mtp_share < 0.2  # the MTP part is a few percent of lm_head's gradient
        assert fp32.survived == pytest.approx(1.0, abs=1e-5) and fp32.error < 1e-4, count
        kept[count] = bf16
    assert kept[16].survived > 0.95  # few micro-batches: bf16 still holds the MTP part, roughly
    assert kept[16].survived > kept[64].survived > kept[512].survived
    assert kept[512].survived < 0.5  # most of it lost
    assert kept[512].error > 1.0  # and the rounding error outweighs what is left of it


def test_trainer_uses_the_bf16_buffer_as_the_output_layer_gradient(small_config, tmp_path):
    from hybridtron.train.config import TrainConfig
    from hybridtron.train.loop import Trainer
    from hybridtron.train.objectives import LoaderBatches, PretrainObjective

    torch.manual_seed(0)
    model = HybridLM(small_config())
    apply_output_grad_accumulation(model, "bf16")
    before = model.lm_head.weight.detach().clone()
    config = TrainConfig(steps=1, grad_accum=3, warmup_steps=1, grad_clip=0.0)
    trainer = Trainer(model, PretrainObjective(), LoaderBatches(iter(micro_batches(3, 2, 16, 128)), 3), config,
                      checkpoints=None)
    seen = {}  # the gradient the optimizer steps with

    def capture(optimizer, args, kwargs):
        seen["grad"] = model.lm_head.weight.grad.clone()

    trainer.optimizer.register_step_pre_hook(capture)
    trainer.train()
    assert seen["grad"].abs().max() > 0
    assert torch.equal(seen["grad"], seen["grad"].bfloat16().float())  # it came out of the bf16 buffer
    assert not torch.equal(model.lm_head.weight, before) and model.lm_head.main_grad.abs().max() == 0
