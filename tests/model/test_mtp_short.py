"""Sequences too short for some MTP depth: with T <= k tokens (or documents of <= k tokens) depth k has no target.
Such a depth has weight zero: the loss is finite, equals CE + mtp_loss_weight / D x the sum of the other depths' CE,
and so does its gradient, in a whole row, in rows padded per document and in packed rows (seq_idx)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridtron.model.lm import IGNORE_INDEX, HybridLM, mtp_targets

DEPTHS = 2
WEIGHT = 0.3


def shifted(ids_BT: torch.Tensor, seq_idx_BT: torch.Tensor | None = None) -> torch.Tensor:
    """The next token of each position, IGNORE_INDEX at each row's (each document's) last."""
    labels = F.pad(ids_BT[:, 1:], (0, 1), value=IGNORE_INDEX)
    if seq_idx_BT is not None:
        labels[:, :-1][seq_idx_BT[:, 1:] != seq_idx_BT[:, :-1]] = IGNORE_INDEX
    return labels


def reference_loss(out, labels_BT: torch.Tensor) -> torch.Tensor:
    """F.cross_entropy of the next token + WEIGHT / DEPTHS x each MTP depth's, the terms without a target left out."""
    loss = torch.zeros(())
    for depth, logits in enumerate([out.logits, *out.mtp_logits]):
        targets = mtp_targets(labels_BT, depth) if depth else labels_BT
        if (targets != IGNORE_INDEX).any():
            ce = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX)
            loss = loss + (WEIGHT / DEPTHS if depth else 1.0) * ce
    return loss


def gradients(model) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def check_loss_and_gradient(model, ids_BT, labels_BT, seq_idx_BT=None) -> list[int]:
    """The model's loss and gradient against `reference_loss`'s; each depth's count of targets."""
    out = model(ids_BT, labels_BT, seq_idx=seq_idx_BT)
    assert torch.isfinite(out.loss) and all(torch.isfinite(loss) for loss in out.mtp_losses)
    out.loss.backward()
    got = gradients(model)
    assert all(torch.isfinite(grad).all() for grad in got.values())

    reference = model(ids_BT, labels_BT, seq_idx=seq_idx_BT)
    expected_loss = reference_loss(reference, labels_BT)
    if expected_loss.requires_grad:  # else nothing to predict at all: every gradient is zero
        expected_loss.backward()
    expected = gradients(model)
    torch.testing.assert_close(out.loss, expected_loss)
    for name, grad in got.items():  # an empty depth still reaches the MTP block, with a zero gradient
        torch.testing.assert_close(grad, expected.get(name, torch.zeros_like(grad)), msg=name)
    assert expected.keys() <= got.keys()
    for loss, count in zip(out.mtp_losses, out.mtp_target_counts):
        assert count > 0 or loss.item() == 0.0
    return out.mtp_target_counts


@pytest.fixture(scope="module")
def model(small_config):
    torch.manual_seed(0)
    return HybridLM(small_config(mtp_num_depths=DEPTHS, mtp_loss_weight=WEIGHT))


@pytest.mark.parametrize("length, shift, counts", [
    (1, False, [0, 0]), (2, False, [1, 0]),  # the issue's: T = 1 broke on shapes in mtp_targets, T = 2 gave NaN
    (1, True, [0, 0]), (2, True, [0, 0]), (DEPTHS + 1, True, [1, 0]), (DEPTHS + 2, True, [2, 1])])
def test_a_depth_without_targets_has_weight_zero(model, length, shift, counts):
    """`shift`: labels are the next tokens (the last position has none), else every position has a label."""
    ids = torch.randint(3, model.config.vocab_size, (1, length))
    labels = shifted(ids) if shift else torch.randint(3, model.config.vocab_size, (1, length))
    assert check_loss_and_gradient(model, ids, labels) == counts


def test_mtp_targets_of_rows_shorter_than_the_depth():
    labels = torch.tensor([[7]])
    assert mtp_targets(labels, 1).tolist() == mtp_targets(labels, 3).tolist() == [[IGNORE_INDEX]]
    assert mtp_targets(torch.tensor([[7, 8]]), 1).tolist() == [[8, IGNORE_INDEX]]


def test_documents_as_padded_rows(model):
    # one document a row, padded: lengths 1, 2, 3 = D + 1; depth 2 has no target in any of them
    ids = torch.randint(3, model.config.vocab_size, (3, 3))
    labels = shifted(ids)
    labels[0, :] = IGNORE_INDEX
    labels[1, 1:] = IGNORE_INDEX
    assert check_loss_and_gradient(model, ids, labels) == [1, 0]


@pytest.mark.parametrize("documents, counts", [((1, 2, 3), [1, 0]), ((1, 4, 2), [2, 1])])
def test_packed_documents(model, documents, counts):
    """Short documents packed in one row (seq_idx): no MTP target crosses a boundary, an empty depth adds nothing,
    and a depth with targets in one document only is scored there."""
    seq_idx = torch.cat([torch.full((n,), d) for d, n in enumerate(documents)])[None]
    ids = torch.randint(3, model.config.vocab_size, seq_idx.shape)
    assert check_loss_and_gradient(model, ids, shifted(ids, seq_idx), seq_idx) == counts
