"""Random Hadamard Transform (RHT) for the NVFP4 weight-gradient GEMM.

Recipe (TE ``NVFP4BlockScaling``, arXiv 2509.25149 Sec. 4.2): ``H = (1/4) diag(s) H16`` with H16 the 16x16
Sylvester Hadamard matrix and one fixed sign vector ``s`` for the whole run (TE's
``[1,1,1,-1,1,-1,-1,-1,-1,-1,-1,1,-1,1,-1,-1]``). Both wgrad operands, dY^T and X^T, are transformed in
chunks of 16 along the token dimension -- each chunk ``v`` (a row vector of 16 consecutive tokens) becomes
``v @ H``, as in TE's ``x.view(-1, 16) @ H`` -- before they are quantized. Because ``H H^T = I`` the transform
cancels inside the dot product over tokens, ``(dY^T H)(X^T H)^T = dY^T X``, while spreading outliers of a
16-token chunk over all 16 entries, which shrinks the block amax the E2M1 grid has to cover.
"""

from __future__ import annotations

import torch
from torch import Tensor

RHT_SIZE = 16
TE_RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def sylvester_hadamard(size: int, dtype: torch.dtype = torch.float32, device=None) -> Tensor:
    """The ±1 Hadamard matrix of order ``size`` (a power of two) by Sylvester's construction."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {size}")
    h = torch.ones((1, 1), dtype=dtype, device=device)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return h


def rht_matrix(signs=TE_RHT_SIGNS, dtype: torch.dtype = torch.float32, device=None) -> Tensor:
    """``H = diag(signs) H_n / sqrt(n)`` for n = len(signs); orthogonal, so ``H H^T = I``."""
    n = len(signs)
    sign = torch.tensor(signs, dtype=dtype, device=device)
    if not bool(((sign == 1) | (sign == -1)).all()):
        raise ValueError(f"RHT signs must all be +1 or -1, got {tuple(signs)}")
    return sign[:, None] * sylvester_hadamard(n, dtype, device) / n**0.5


_TE_MATRICES: dict[torch.device, Tensor] = {}


def te_rht_matrix(device=None) -> Tensor:
    """:func:`rht_matrix` with TE's signs in fp32, built once per device (the wgrad GEMMs apply it every step).
    Shared: do not modify it."""
    device = torch.device("cpu") if device is None else torch.device(device)
    if device not in _TE_MATRICES:
        _TE_MATRICES[device] = rht_matrix(device=device)
    return _TE_MATRICES[device]


def hadamard_chunks_(chunks: Tensor, out: Tensor) -> Tensor:
    """``out <- chunks @ H`` (TE's matrix) for fp32 ``[n, 16]`` views, the product
    :func:`random_hadamard_transform` computes along a contiguous last dim, written into a caller's buffer."""
    return torch.mm(chunks, te_rht_matrix(chunks.device), out=out)


def random_hadamard_transform(x: Tensor, dim: int = 0, matrix: Tensor | None = None) -> Tensor:
    """Apply ``H`` (default: :func:`rht_matrix` with TE's signs) to chunks of 16 along ``dim``.

    ``x.shape[dim]`` must be a multiple of the transform size (pad tokens with zeros first: zero rows stay
    zero). Computed in fp32; returns fp32.
    """
    h = te_rht_matrix(x.device) if matrix is None else matrix.to(device=x.device, dtype=torch.float32)
    size = h.shape[0]
    if x.ndim == 0:
        raise ValueError("random_hadamard_transform expects a tensor with at least one dimension")
    d = dim % x.ndim
    if x.shape[d] % size:
        raise ValueError(
            f"random_hadamard_transform: size {x.shape[d]} along dim {dim} is not a multiple of {size}; pad it first"
        )
    moved = x.to(torch.float32).movedim(d, -1).contiguous()
    return (moved.view(-1, size) @ h).view(moved.shape).movedim(-1, d)  # one 2-D GEMM over all chunks
