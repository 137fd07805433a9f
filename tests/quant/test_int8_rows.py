"""w8a8's CPU path (quant/int8_rows.py): the C++ rounding gives the torch reference's codes, and
oneDNN's packed GEMM the torch path's products up to float rounding, batch-invariantly."""

from __future__ import annotations

import pytest
import torch

from kvflow.quant import int8_rows
from kvflow.quant.formats import int8_per_channel
from kvflow.quant.w8a8 import W8A8Channel, quantize_rows

pytestmark = pytest.mark.skipif(not int8_rows.available(), reason="no C++ compiler or oneDNN here")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [576, 1536, 37])  # 37: the scalar tail after 16-wide vectors
def test_codes_and_scales_are_the_torch_reference(dtype, width):
    torch.manual_seed(0)
    x = (torch.randn(70, width) * torch.rand(70, 1) * 10).to(dtype)
    x[3] = 0  # a row of zeros: scale 1, codes 128
    x[5, 7] = -1e4  # an outlier sets its row's scale
    codes, scales = int8_rows.quantize_rows(x)
    ref_codes, ref_scales = quantize_rows(x.float())
    assert torch.equal(codes.to(torch.int32) - 128, ref_codes.to(torch.int32))
    assert torch.equal(scales, ref_scales[:, 0])
    assert scales[3] == 1 and torch.all(codes[3] == 128) and codes[5, 7] == 1


def test_strided_rows_are_read_in_place():
    x = torch.randn(8, 200)[:, :150]  # rows 200 apart, unit stride within
    codes, scales = int8_rows.quantize_rows(x)
    ref_codes, ref_scales = quantize_rows(x.contiguous())
    assert torch.equal(codes.to(torch.int32) - 128, ref_codes.to(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_product_is_the_torch_paths_and_batch_invariant(dtype):
    torch.manual_seed(1)
    q, scale = int8_per_channel(torch.randn(960, 576) * 0.05, "qkv")
    layer = W8A8Channel(q, scale)
    assert layer.onednn is not None
    x = torch.randn(100, 576).to(dtype)
    y = layer(x)
    reference = layer.torch_forward(x)  # _int_mm: the same codes and integer sums
    assert y.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7  # bfloat16: the GEMM's output rounds, then the row scale
    assert ((y.float() - reference.float()).abs() <= tolerance * reference.float().abs().amax(1, keepdim=True)).all()
    for rows in (slice(0, 1), slice(7, 10), slice(40, 100)):  # a row's result whatever its batch
        assert torch.equal(layer(x[rows]), y[rows])


def test_without_the_library_the_torch_path_runs(monkeypatch):
    monkeypatch.setattr(int8_rows, "load", lambda: False)  # as where it cannot be built
    q, scale = int8_per_channel(torch.randn(64, 32), "w")
    layer = W8A8Channel(q, scale)
    assert not int8_rows.available() and layer.onednn is None
    x = torch.randn(3, 32)
    torch.testing.assert_close(layer(x), layer.torch_forward(x), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_dense_product_in_tiles_is_the_dequantized_weights(dtype):
    """int8 weight-only above the kernel's rows: the C++ dequantization is torch's q·scale exactly,
    and the tiled product (a head wider than one tile) the dense one's up to float sums."""
    torch.manual_seed(2)
    n = int8_rows.DEQUANTIZE_ROWS * 2 + 100  # two whole tiles and a part
    q, scale = int8_per_channel(torch.randn(n, 64), "head")
    scale = scale.to(dtype)
    tile = torch.empty(n, 64, dtype=dtype)
    torch.ops.kvflow_int8_rows.dequantize_rows(tile, q, scale)
    exact = q.to(dtype) * scale[:, None]
    assert torch.equal(tile, exact)
    x = torch.randn(40, 64).to(dtype)
    y = int8_rows.dequantized_product(x, q, scale)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, exact), rtol=0, atol=0 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_row_with_nan_or_infinity_comes_out_nan_and_spares_the_others(bad):
    """As the torch path: the row's product is NaN, not a finite value that hides the fault."""
    q, scale = int8_per_channel(torch.randn(64, 40), "w")
    layer = W8A8Channel(q, scale)
    x = torch.randn(5, 40)
    x[2, 37] = bad  # in the scalar tail after the 16-wide vectors
    x[3, 4] = bad
    y = layer(x)
    assert y[2].isnan().all() and y[3].isnan().all()
    keep = [0, 1, 4]
    assert torch.equal(y[keep], layer(x[keep]))
    assert layer.torch_forward(x)[2].isnan().all()
