"""The output layer's gradient accumulation in a chosen dtype, Megatron-style (the report's divergence 1).

Megatron keeps a ``main_grad`` buffer beside each parameter. With gradient-accumulation fusion, each wgrad GEMM
adds its result straight into that buffer (``C = dY^T X + C`` in the GEMM epilogue: an fp32 accumulator, one
rounding to the buffer's dtype on store); the buffer becomes the gradient the optimizer sees once all
micro-batches are done. lm_head is applied 1 + D times per micro-batch (the main head and each MTP depth), so
it receives 1 + D such additions per micro-batch, the MTP ones scaled by their loss weight (0.05 per depth).

Nemotron 3 Ultra lowered the output layer's buffer from FP32 to BF16 (so data-parallel reductions could travel in
BF16) and diverged at about 8T tokens. BF16 keeps 7 mantissa bits (8 significant): a sum s in [2^e, 2^(e+1))
is stored to the nearest multiple of 2^(e-7), so an addend smaller than half of that -- about 2^8 times smaller
than the running sum -- rounds away entirely, and one a few times larger keeps only a bit or two. The MTP
contributions, 20x smaller than the main head's per micro-batch and added to a sum of many micro-batches,
were lost; MTP loss spiked first. The fix was FP32 accumulation.

``train.grad_accum_dtype = "bf16"`` reproduces that: :func:`apply_output_grad_accumulation` swaps lm_head for a
:class:`MainGradLinear` (same Parameters, same state-dict names) whose autograd Function adds each application's
wgrad into a bf16 ``main_grad``; :func:`flush_main_grads` hands it to ``weight.grad`` before the optimizer step.
With ``"fp32"`` nothing is swapped: autograd already sums every contribution into the fp32 ``weight.grad``.

:func:`record_output_wgrads` and :func:`mtp_survival` measure how much of the MTP contribution survives the
accumulation, against an fp64 sum of the same addends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridtron.numerics.linear import QuantLinear, emulated_linear

ACCUM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def accumulate_(buffer: Tensor, addend: Tensor) -> Tensor:
    """``buffer += addend`` as a GEMM epilogue does it: the sum formed in fp32, rounded once to buffer's dtype."""
    if buffer.dtype == torch.float32:
        return buffer.add_(addend.float())
    return buffer.copy_(buffer.float() + addend.float())


class _AccumulateWgrad(torch.autograd.Function):
    """Identity on the weight; backward adds this one application's weight gradient into ``owner.main_grad``
    and sends nothing to the Parameter itself (each application gets its own node, so no summing first)."""

    @staticmethod
    def forward(ctx, weight: Tensor, owner: "MainGradLinear", application: int) -> Tensor:
        ctx.owner, ctx.application = owner, application
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, wgrad: Tensor):
        ctx.owner.accumulate(wgrad, ctx.application)
        return None, None, None


class MainGradLinear(nn.Module):
    """An output layer (nn.Linear or QuantLinear) whose wgrad is accumulated into ``main_grad`` of ``dtype``.

    Holds the wrapped layer's Parameters (``weight``, ``bias``: state-dict names unchanged); a QuantLinear's
    ``recipe``, SR stream and ``stats`` are kept (as plain attributes, not a submodule, which would register the
    Parameters a second time), so the GEMMs stay as the precision policy set them. ``main_grad`` is
    a non-persistent buffer (not checkpointed: it is empty between optimizer steps). ``applications`` counts
    forward calls (0 = the main head, k = MTP depth k when reset before each forward); ``recorder``, when a
    list, receives ``(application, fp32 wgrad)`` of every backward, in the order backward produces them.
    """

    def __init__(self, linear: nn.Module, dtype: str = "bf16"):
        super().__init__()
        if not isinstance(linear, (nn.Linear, QuantLinear)):
            raise ValueError(f"MainGradLinear wraps an nn.Linear or QuantLinear, got {type(linear).__name__}")
        if dtype not in ACCUM_DTYPES:
            raise ValueError(f"grad_accum_dtype must be one of {', '.join(ACCUM_DTYPES)}, got {dtype!r}")
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)
        quantized = isinstance(linear, QuantLinear)
        self.recipe = linear.recipe if quantized else None
        self.stats = linear.stats if quantized else None
        self.sr_generators = linear.sr_generators if quantized else None  # continue the wrapped layer's SR stream
        self.accum_dtype = dtype
        self.register_buffer("main_grad", torch.zeros_like(linear.weight, dtype=ACCUM_DTYPES[dtype]),
                             persistent=False)
        self.applications = 0
        self.recorder: list[tuple[int, Tensor]] | None = None

    def applied_weight(self) -> Tensor:
        """The weight of one application: its gradient goes to ``main_grad`` (what the RL log-prob passes multiply
        by when they apply the head themselves, `hybridtron.distributed.head`)."""
        weight = _AccumulateWgrad.apply(self.weight, self, self.applications)
        self.applications += 1
        return weight

    def forward(self, x: Tensor) -> Tensor:
        weight = self.applied_weight()
        if self.recipe is None:
            return F.linear(x, weight, self.bias)
        return emulated_linear(x, weight, self.bias, self.recipe, self.sr_generators, self.stats)

    def accumulate(self, wgrad: Tensor, application: int) -> None:
        if self.recorder is not None:
            self.recorder.append((application, wgrad.detach().float().clone()))
        accumulate_(self.main_grad, wgrad)

    def set_accum_dtype(self, dtype: str) -> None:
        """Accumulate in `dtype` from now on (the monitor's rollback can switch bf16 -> fp32). Only between
        optimizer steps, when the buffer has been flushed and holds nothing."""
        if dtype not in ACCUM_DTYPES:
            raise ValueError(f"grad_accum_dtype must be one of {', '.join(ACCUM_DTYPES)}, got {dtype!r}")
        if self.main_grad.any():
            raise RuntimeError("set_accum_dtype: main_grad holds an unflushed gradient")
        self.main_grad = torch.zeros_like(self.main_grad, dtype=ACCUM_DTYPES[dtype])
        self.accum_dtype = dtype

    @torch.no_grad()
    def flush(self) -> None:
        """main_grad -> weight.grad (in the weight's dtype), then zero the buffer for the next step."""
        grad = self.main_grad.to(self.weight.dtype, copy=True)  # a copy even when the dtypes agree: zeroed below
        self.weight.grad = grad if self.weight.grad is None else self.weight.grad + grad
        self.main_grad.zero_()

    def extra_repr(self) -> str:
        recipe = f", format={self.recipe.format}" if self.recipe is not None else ""
        return (f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}, "
                f"bias={self.bias is not None}{recipe}, grad_accum_dtype={self.accum_dtype}")


def apply_output_grad_accumulation(model: nn.Module, dtype: str) -> MainGradLinear | None:
    """Swap ``model.lm_head`` for a MainGradLinear accumulating in ``dtype``; "fp32" leaves the model as is
    (autograd's fp32 ``weight.grad`` is that accumulation already). Apply after :func:`apply_precision`."""
    if dtype not in ACCUM_DTYPES:
        raise ValueError(f"train.grad_accum_dtype must be one of {', '.join(ACCUM_DTYPES)}, got {dtype!r}")
    if dtype == "fp32":
        return None
    model.lm_head = MainGradLinear(model.lm_head, dtype)
    return model.lm_head


def set_output_accumulation(model: nn.Module, dtype: str) -> None:
    """Switch every MainGradLinear of the model to accumulate in `dtype` (a rollback's bf16 -> fp32 switch); between
    optimizer steps, when the buffers are empty."""
    for module in model.modules():
        if isinstance(module, MainGradLinear) and module.accum_dtype != dtype:
            module.set_accum_dtype(dtype)


def flush_main_grads(model: nn.Module) -> None:
    """Before the optimizer step (after the last micro-batch): every main_grad becomes its weight's grad."""
    for module in model.modules():
        if isinstance(module, MainGradLinear):
            module.flush()


# ----------------------------------------------------------------------------------------- measurement
def record_output_wgrads(model: nn.Module, micro_batches: list) -> list[tuple[int, Tensor]]:
    """Forward and backward each micro-batch (an (input_ids, labels) pair, or a `hybridtron.data.batch.TokenBatch`,
    whose seq_idx goes to the model too; loss / M, as the trainer does); return lm_head's wgrad additions
    in the order backward made them: ``(application, fp32 tensor)``, 0 = the main head, k = MTP depth k.

    The model is left as it was (lm_head restored, gradients cleared)."""
    original = model.lm_head
    if isinstance(original, MainGradLinear):
        raise ValueError("record_output_wgrads: lm_head is already a MainGradLinear; pass the unconverted model")
    head = MainGradLinear(original, "fp32")
    head.recorder = []
    model.lm_head = head
    try:
        for batch in micro_batches:  # TokenBatch is the data layer's, above this one: read by its fields
            input_ids, labels = (batch.input_ids, batch.labels) if hasattr(batch, "labels") else batch
            seq_idx = getattr(batch, "seq_idx", None)
            head.applications = 0
            masked = {} if seq_idx is None else {"seq_idx": seq_idx}
            (model(input_ids, labels, **masked).loss / len(micro_batches)).backward()
        return head.recorder
    finally:
        model.lm_head = original
        model.zero_grad(set_to_none=True)


def accumulate_in(contributions: list[tuple[int, Tensor]], dtype: str, skip_mtp: bool = False) -> Tensor:
    """Sum the additions in order into a zero buffer of ``dtype`` (one rounding per addition); fp64 result."""
    buffer = torch.zeros_like(contributions[0][1], dtype=ACCUM_DTYPES[dtype])
    for application, wgrad in contributions:
        if not (skip_mtp and application > 0):
            accumulate_(buffer, wgrad)
    return buffer.double()


@dataclass(frozen=True)
class MTPSurvival:
    """How much of the MTP additions to lm_head's wgrad an accumulation in ``dtype`` keeps.

    survived: the change the MTP additions make to the accumulated gradient, projected on their exact (fp64)
        sum, as a fraction of it: 1 = all kept, 0 = all lost.
    error: |accumulated - exact total| / |exact MTP sum| (how large the rounding error is next to the MTP part).
    mtp_share: |exact MTP sum| / |exact total|.
    """

    dtype: str
    survived: float
    error: float
    mtp_share: float


def mtp_survival(contributions: list[tuple[int, Tensor]], dtype: str) -> MTPSurvival:
    exact_total = sum(w.double() for _, w in contributions)
    exact_mtp = sum(w.double() for a, w in contributions if a > 0)
    if not isinstance(exact_mtp, Tensor):
        raise ValueError("mtp_survival: no MTP additions recorded (does the model have an MTP block?)")
    with_mtp = accumulate_in(contributions, dtype)
    without_mtp = accumulate_in(contributions, dtype, skip_mtp=True)
    mtp_norm2 = float((exact_mtp * exact_mtp).sum())
    survived = float(((with_mtp - without_mtp) * exact_mtp).sum()) / mtp_norm2
    error = float((with_mtp - exact_total).norm()) / mtp_norm2 ** 0.5
    return MTPSurvival(dtype, survived, error, mtp_norm2 ** 0.5 / float(exact_total.norm()))
