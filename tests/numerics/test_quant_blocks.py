"""The block-quantization core shared by NVFP4 and MXFP8: the block matrix round trip, block maxima, row chunks,
zero signs and the E4M3 helpers against torch's casts."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from hybridtron.numerics import blocks


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_block_matrix_round_trip(dtype, dim):
    x = torch.randn(3, 20, 5).to(dtype)
    matrix, d = blocks.to_block_matrix(x, dim, 16)
    moved = x.movedim(dim, -1)
    assert d == dim % 3 and matrix.dtype == torch.float32
    assert matrix.shape == (moved.numel() // moved.shape[-1], -(-moved.shape[-1] // 16) * 16)
    assert (matrix[:, moved.shape[-1]:] == 0).all()  # zero padding
    assert torch.equal(blocks.from_block_matrix(matrix, x.shape, d), x.float())
    aligned = torch.randn(4, 32)
    assert blocks.to_block_matrix(aligned, -1, 16)[0].data_ptr() == aligned.data_ptr()  # no copy needed
    with pytest.raises(ValueError, match="dim=3"):
        blocks.to_block_matrix(x, 3, 16)
    with pytest.raises(ValueError, match="floating-point"):
        blocks.to_block_matrix(torch.ones(4, dtype=torch.int32), 0, 16)


def test_blockwise_amax_chunks_and_nan(monkeypatch):
    monkeypatch.setattr(blocks, "_CHUNK_ELEMENTS", 64)  # several chunks, the last one short
    matrix = torch.randn(11, 48)
    chunks = blocks.row_chunks(matrix)
    assert chunks[0] == (0, 1) and chunks[-1] == (10, 11) and len(chunks) == 11
    expected = matrix.abs().view(11, 3, 16).amax(dim=-1)
    assert torch.equal(blocks.blockwise_amax(matrix, 16), expected)
    matrix[4, 20] = float("nan")
    assert torch.isnan(blocks.blockwise_amax(matrix, 16)[4, 1])
    with pytest.raises(ValueError, match="NaN or Inf"):
        blocks.check_finite(blocks.blockwise_amax(matrix, 16).max(), "test")
    assert blocks.row_chunks(torch.empty(0, 16)) == [] and blocks.blockwise_amax(torch.empty(0, 16), 16).shape == (0, 1)


def test_restore_zero_signs():
    x = torch.tensor([-1e-9, 1e-9, -2.0, 3.0, -0.0])
    y = torch.tensor([0.0, 0.0, -2.0, 3.0, 0.0])  # a rounding of x: zeros lost x's sign
    blocks.restore_zero_signs_(y, x, torch.empty(5, dtype=torch.int32))
    assert torch.equal(bits(y), bits(torch.tensor([-0.0, 0.0, -2.0, 3.0, -0.0])))


def test_e4m3_helpers_match_torch_casts():
    # Every E4M3 value, the midpoints between neighbours (ties) and their fp32 neighbours.
    codes = torch.arange(0, 0x7F, dtype=torch.uint8)
    grid = codes.view(torch.float8_e4m3fn).float()
    mid = (grid[:-1] + grid[1:]) / 2
    x = torch.cat([grid, mid, torch.nextafter(mid, torch.tensor(0.0)), torch.nextafter(mid, torch.tensor(500.0))])
    x = torch.cat([x, torch.rand(10000) * 448, torch.rand(10000) * 2**-6])
    assert torch.equal(bits(blocks.e4m3_round(x)), bits(blocks.e4m3_round_ref(x)))
    all_bytes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    assert torch.equal(bits(blocks.e4m3_from_bytes(all_bytes)), bits(all_bytes.view(torch.float8_e4m3fn).float()))


def test_scratch_reuses_one_buffer_per_name():
    a = blocks.scratch("test.a", (4, 8), torch.float32, torch.device("cpu"))
    b = blocks.scratch("test.a", (2, 3), torch.float32, torch.device("cpu"))
    assert b.data_ptr() == a.data_ptr() and b.shape == (2, 3)
    c = blocks.scratch("test.b", (2, 3), torch.float32, torch.device("cpu"))
    assert c.data_ptr() != a.data_ptr()


def test_numerics_modules_use_only_each_others_public_names():
    root = Path(blocks.__file__).parent
    siblings = {path.stem for path in root.glob("*.py")}
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hybridtron"):
                private = [alias.name for alias in node.names if alias.name.startswith("_")]
                assert not private, f"{path.name} imports private names {private} from {node.module}"
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in siblings
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                raise AssertionError(f"{path.name}:{node.lineno} uses {node.value.id}.{node.attr}")
