"""Document masking under context parallelism (`dist.context_parallel` with `seq_idx`), on 2 gloo processes: every
rank's head and tail chunk rows get the logits and MTP logits their documents get alone in one process, and the
parameter gradients summed over the ranks equal those of the documents run alone (fp32). The rows have a document
that crosses both share boundaries (it keeps its incoming state and its keys), ones that start inside a share and
exactly on a share boundary (they start from nothing), a single-token document and a row that is one document.
Ring attention refuses packed documents with one line."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from gloo import differences

from hybridtron.config import ModelConfig, parse_pattern
from hybridtron.distributed.context_parallel import (ContextParallelAttention, apply_context_parallel, chunk_rows,
                                              shard_sequence)
from hybridtron.model.lm import HybridLM

WORLD = 2
# 48 positions: 4 chunks of 12 (rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2)
DOCUMENTS = [[5, 30, 1, 12], [12, 12, 24], [48], [3, 9, 3, 33]]


def _config() -> ModelConfig:
    return ModelConfig(
        vocab_size=64, hidden_size=32, layers_block_type=parse_pattern("M*E-M"), num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=48, mamba_num_heads=4, mamba_head_dim=8, n_groups=2,
        ssm_state_size=8, conv_kernel=4, chunk_size=8, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, moe_shared_expert_intermediate_size=16, moe_latent_size=16, n_group=2,
        topk_group=1, num_nextn_predict_layers=1, max_position_embeddings=64)


def _batch():
    seq_idx = torch.tensor([[index for index, length in enumerate(row) for _ in range(length)] for row in DOCUMENTS])
    ids = torch.randint(0, 64, seq_idx.shape, generator=torch.Generator().manual_seed(5))
    weights = [torch.randn(*seq_idx.shape, 64, generator=torch.Generator().manual_seed(depth)) for depth in (0, 1)]
    in_document = F.pad(seq_idx[:, 1:], (0, 1), value=-1) == seq_idx  # MTP depth 1 scored where t + 1 is t's document
    return ids, seq_idx, weights, in_document


def _alone(model):
    """Each document run alone: the logits and MTP logits assembled into rows, and the parameter gradients."""
    ids, _, weights, in_document = _batch()
    logits = torch.zeros(*ids.shape, 64)
    mtp = torch.zeros(*ids.shape, 64)
    for row, lengths in enumerate(DOCUMENTS):
        start = 0
        for length in lengths:
            end = start + length
            out = model(ids[row:row + 1, start:end])
            mask = in_document[row, start:end, None]
            ((out.logits[0] * weights[0][row, start:end]).sum()
             + (out.mtp_logits[0][0] * weights[1][row, start:end] * mask).sum()).backward()
            logits[row, start:end], mtp[row, start:end] = out.logits[0].detach(), out.mtp_logits[0][0].detach() * mask
            start = end
    return logits, mtp, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check(rank: int):
    torch.manual_seed(0)
    model = HybridLM(_config())
    want_logits, want_mtp, want_grads = _alone(model)
    model.zero_grad()
    apply_context_parallel(model, dist.group.WORLD)
    ids, seq_idx, weights, in_document = _batch()
    own_ids, _, following = shard_sequence(ids, ids, rank, WORLD, 1)
    own = lambda t: chunk_rows(t, rank, WORLD)  # noqa: E731
    out = model(own_ids, following_ids=following, seq_idx=own(seq_idx))
    mask = own(in_document)[..., None]
    ((out.logits * own(weights[0])).sum() + (out.mtp_logits[0] * own(weights[1]) * mask).sum()).backward()
    checks = {"logits": (out.logits, own(want_logits)), "mtp logits": (out.mtp_logits[0] * mask, own(want_mtp))}
    for name, (got, want) in checks.items():
        error = float((got - want).abs().max())
        if not error < 1e-5:
            yield f"{name} differ by {error}"
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad)
        scale = float(want_grads[name].abs().max().clamp(min=1.0))
        error = float((grad - want_grads[name]).abs().max()) / scale
        if not error < 1e-5:
            yield f"the gradient of {name} differs by {error} (relative)"
    for module in model.modules():
        if isinstance(module, ContextParallelAttention):
            module.cp_attention = "ring"
    try:
        model(own_ids, following_ids=following, seq_idx=own(seq_idx))
        yield "ring attention ran packed documents"
    except ValueError as exc:
        if "does not mask packed documents" not in str(exc):
            yield f"ring attention's refusal reads {exc}"


@pytest.mark.timeout(180)
def test_packed_documents_under_context_parallelism_2_get_their_logits_and_gradients_alone():
    reported = differences(_check, WORLD)
    assert not reported, reported
