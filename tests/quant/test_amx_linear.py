"""bf16 products on AMX tiles (quant/amx_linear.py): the float32 product up to the order of its
sums, each row on its own whatever the batch, and where packed bf16 layers take them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvflow.quant import amx_linear, packed_linear

pytestmark = pytest.mark.skipif(not amx_linear.available(), reason="the CPU has no AMX, or the kernel could not be built")


def _close_to_float32(out: torch.Tensor, reference: torch.Tensor) -> None:
    """out is the float32 `reference` rounded to bf16, but for the order of the float sums: within
    one bf16 step (2^-8 relative) plus a float32 rounding's worth of the sum's size."""
    err = (out.float() - reference).abs()
    assert bool((err <= reference.abs() * 2**-8 + 1e-5).all()), float(err.max())


def test_the_panels_hold_each_weight_where_the_tiles_read_it():
    n, k = 48, 96
    weight = torch.arange(n * k, dtype=torch.float32).reshape(n, k).bfloat16()
    panels = amx_linear.pack(weight)
    assert panels.shape == (n // 16, k // 32, 16, 32)
    for p, s, i, j, h in [(0, 0, 0, 0, 0), (1, 2, 7, 5, 1), (2, 1, 15, 15, 1), (2, 2, 3, 9, 0)]:
        assert panels[p, s, i, 2 * j + h] == weight[16 * p + j, 32 * s + 2 * i + h]
    pair = amx_linear.pack_gated(weight, -weight)
    assert pair.shape == (n // 16, 2, k // 32, 16, 32) and torch.equal(pair[:, 1], -panels)


@pytest.mark.parametrize("rows", [1, 15, 16, 17, 32, 33, 47, 130])  # whole and partial 16-row blocks, odd block counts
@pytest.mark.parametrize("n", [48, 64])  # 48: a unit of one panel at the end
@pytest.mark.parametrize("bias", [False, True])
def test_the_product_is_the_float32_one_rounded(rows, n, bias):
    gen = torch.Generator().manual_seed(rows * 7 + n)
    k = 160
    weight = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    x = torch.randn(rows, k, generator=gen).bfloat16()
    out = amx_linear.linear(x, amx_linear.pack(weight), b)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    _close_to_float32(out, F.linear(x.float(), weight.float(), None if b is None else b.float()))


def test_rows_of_a_strided_x_are_read_where_they_lie():
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(32, 64, generator=gen).bfloat16()
    wide = torch.randn(21, 200, generator=gen).bfloat16()
    x = wide[:, 8:72]  # rows 200 apart
    out = amx_linear.linear(x, amx_linear.pack(weight))
    assert torch.equal(out, amx_linear.linear(x.contiguous(), amx_linear.pack(weight)))
    _close_to_float32(out, F.linear(x.float(), weight.float()))


def test_a_row_comes_out_the_same_whatever_rows_share_its_product():
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(96, 576, generator=gen).bfloat16()
    panels = amx_linear.pack(weight)
    pair = amx_linear.pack_gated(weight[:48], weight[48:])
    x = torch.randn(100, 576, generator=gen).bfloat16()
    whole, gated = amx_linear.linear(x, panels), amx_linear.silu_and_mul(x, pair)
    for lo, hi in [(0, 1), (5, 22), (17, 50), (37, 100)]:
        assert torch.equal(amx_linear.linear(x[lo:hi], panels), whole[lo:hi])
        assert torch.equal(amx_linear.silu_and_mul(x[lo:hi], pair), gated[lo:hi])


@pytest.mark.parametrize("rows", [3, 40])
def test_the_gated_form_rounds_silu_of_the_gate_then_the_product(rows):
    gen = torch.Generator().manual_seed(rows)
    gate, up = (torch.randn(2, 64, 128, generator=gen) * 0.3).bfloat16()
    x = (torch.randn(rows, 128, generator=gen) * 2).bfloat16()
    out = amx_linear.silu_and_mul(x, amx_linear.pack_gated(gate, up))
    g, u = F.linear(x.float(), gate.float()), F.linear(x.float(), up.float())
    act = F.silu(g).bfloat16().float()  # oneDNN's swish epilogue writes bf16; the up product multiplies it
    reference = act * u
    assert out.shape == (rows, 64)
    # the sums' order can move g across a bf16 rounding boundary of SiLU(g): two bf16 steps
    err = (out.float() - reference).abs()
    assert bool((err <= reference.abs() * 2**-7 + 1e-4).all()), float(err.max())
    # and nearly always exactly: with SiLU left in float, about one output in four lands elsewhere
    assert (out == reference.bfloat16()).float().mean() >= 0.97


def test_packed_bf16_layers_take_the_kernel_up_to_its_row_bound():
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(64, 96, generator=gen).bfloat16()
    packed = packed_linear.PackedWeight(weight)
    x = torch.randn(amx_linear.MAX_ROWS + 1, 96, generator=gen).bfloat16()
    big = packed_linear.packed_linear(x, packed, None)
    assert packed.panels is None  # more rows than the bound: oneDNN, and no panels laid out
    small = packed_linear.packed_linear(x[:9], packed, None)
    assert packed.panels is not None
    assert torch.equal(small, amx_linear.linear(x[:9], packed.panels))
    _close_to_float32(big, F.linear(x.float(), weight.float()))
    assert not amx_linear.takes(4, (64, 80)) and not amx_linear.takes(4, (72, 96))  # K of 32s, N of 16s
    wide = (amx_linear.WIDE_COLUMNS + 16, 96)
    assert amx_linear.takes(amx_linear.WIDE_MAX_ROWS, wide) and not amx_linear.takes(amx_linear.WIDE_MAX_ROWS + 1, wide)


def test_switched_off_it_leaves_the_product_to_onednn(monkeypatch):
    monkeypatch.setenv(amx_linear.DISABLE_ENV, "0")
    weight = torch.randn(64, 96).bfloat16()
    packed = packed_linear.PackedWeight(weight)
    x = torch.randn(5, 96).bfloat16()
    assert torch.equal(packed_linear.packed_linear(x, packed, None), F.linear(x, weight))
    assert packed.panels is None


def test_bad_operands_are_refused_by_name():
    weight = torch.randn(32, 64).bfloat16()
    panels = amx_linear.pack(weight)
    with pytest.raises(RuntimeError, match="K / 32"):
        amx_linear.linear(torch.randn(4, 96).bfloat16(), panels)
    with pytest.raises(RuntimeError, match="bfloat16"):
        amx_linear.linear(torch.randn(4, 64), panels)
    with pytest.raises(RuntimeError, match="bias"):
        amx_linear.linear(torch.randn(4, 64).bfloat16(), panels, torch.zeros(16))
