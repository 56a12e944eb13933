"""Random Hadamard Transform: orthogonality, TE's construction, and invariance of the wgrad GEMM."""

from __future__ import annotations

import pytest
import torch

from hybridtron.numerics.hadamard import (
    TE_RHT_SIGNS,
    hadamard_chunks_,
    random_hadamard_transform,
    rht_matrix,
    sylvester_hadamard,
    te_rht_matrix,
)


def test_sylvester_and_rht_matrix():
    h16 = sylvester_hadamard(16)
    assert set(h16.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(h16 @ h16.t(), 16 * torch.eye(16))
    assert torch.equal(h16, h16.t())
    h = rht_matrix()
    assert torch.equal(h, torch.diag(torch.tensor(TE_RHT_SIGNS, dtype=torch.float32)) @ h16 / 4)
    assert torch.allclose(h @ h.t(), torch.eye(16), atol=2 * torch.finfo(torch.float32).eps)
    with pytest.raises(ValueError, match="power of two"):
        sylvester_hadamard(12)


def test_transform_is_te_chunked_product():
    """TE's reference: x.t().contiguous().view(-1, 16) @ H -- chunks of 16 tokens per feature."""
    x = torch.randn(64, 24)
    expected = (x.t().contiguous().view(-1, 16) @ rht_matrix()).view(24, 64).t()
    assert torch.allclose(random_hadamard_transform(x, dim=0), expected, rtol=0, atol=1e-6)
    assert torch.allclose(random_hadamard_transform(x.t(), dim=1), expected.t(), rtol=0, atol=1e-6)


def test_cached_matrix_and_chunk_product_into_a_buffer():
    assert te_rht_matrix() is te_rht_matrix("cpu")  # built once per device
    assert torch.equal(te_rht_matrix(), rht_matrix())
    x = torch.randn(24, 64)
    out = torch.empty(24 * 4, 16)
    assert hadamard_chunks_(x.view(-1, 16), out=out) is out
    assert torch.equal(out.view(24, 64), random_hadamard_transform(x, dim=1))


def test_transform_then_gemm_equals_gemm_to_fp32_rounding():
    """Over tokens, (H^T dY)^T (H^T X) = dY^T X. The transformed GEMM's deviation from the exact (fp64) product
    stays within a small multiple of the plain fp32 GEMM's own rounding error."""
    dy, x = torch.randn(256, 48) * 3, torch.randn(256, 40)
    exact = dy.double().t() @ x.double()
    plain_error = (dy.t() @ x - exact).abs().max()
    transformed = random_hadamard_transform(dy, dim=0).t() @ random_hadamard_transform(x, dim=0)
    assert (transformed - exact).abs().max() <= 4 * plain_error


def test_zero_padding_stays_zero_and_size_is_checked():
    x = torch.nn.functional.pad(torch.randn(16, 8), (0, 0, 0, 16))
    y = random_hadamard_transform(x, dim=0)
    assert torch.allclose(y[:16].square().sum(0), x[:16].square().sum(0), rtol=1e-5)  # norm-preserving per chunk
    assert (y[16:] == 0).all()  # an all-zero chunk (token padding) stays zero
    with pytest.raises(ValueError, match="multiple of 16"):
        random_hadamard_transform(torch.randn(20, 8), dim=0)
