"""bf16 products on 16-column panels (quant/panel_linear.py), on AMX tiles and on AVX-512 BF16 dot
products (each way the CPU has): the float32 product up to the order of its sums, each row on its
own whatever the batch, and where packed bf16 layers take them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvflow.quant import packed_linear, panel_linear

pytestmark = pytest.mark.skipif(not panel_linear.available(), reason="no AVX-512 BF16 here, or the kernel could not be built")
# dot products wherever the kernel runs; tiles too where the CPU has AMX
WAYS = [False, True] if panel_linear.available() and panel_linear.has_tiles() else [False]
ways = pytest.mark.parametrize("tiles", WAYS, ids=lambda t: "tiles" if t else "dots")


def _close_to_float32(out: torch.Tensor, reference: torch.Tensor) -> None:
    """out is the float32 `reference` rounded to bf16, but for the order of the float sums: within
    one bf16 step (2^-8 relative) plus a float32 rounding's worth of the sum's size."""
    err = (out.float() - reference).abs()
    assert bool((err <= reference.abs() * 2**-8 + 1e-5).all()), float(err.max())


def test_the_panels_hold_each_weight_where_the_tiles_read_it():
    n, k = 48, 96
    weight = torch.arange(n * k, dtype=torch.float32).reshape(n, k).bfloat16()
    panels = panel_linear.pack(weight)
    assert panels.shape == (n // 16, k // 32, 16, 32)
    for p, s, i, j, h in [(0, 0, 0, 0, 0), (1, 2, 7, 5, 1), (2, 1, 15, 15, 1), (2, 2, 3, 9, 0)]:
        assert panels[p, s, i, 2 * j + h] == weight[16 * p + j, 32 * s + 2 * i + h]
    pair = panel_linear.pack_gated(weight, -weight)
    assert pair.shape == (n // 16, 2, k // 32, 16, 32)
    assert torch.equal(pair[:, 0], panels) and torch.equal(pair[:, 1], -panels)


# tiles: whole and partial 16-row blocks, odd block counts; dots: every block size up to 12 rows
# (1, 5, 11, 12), blocks split evenly (13: 7 + 6; 25: 9 + 8 + 8)
@pytest.mark.parametrize("rows", [1, 5, 11, 12, 13, 15, 16, 17, 25, 32, 33, 47, 130])
@pytest.mark.parametrize("n", [48, 64])  # 48: a unit of one panel at the end
@pytest.mark.parametrize("bias", [False, True])
@ways
def test_the_product_is_the_float32_one_rounded(rows, n, bias, tiles):
    gen = torch.Generator().manual_seed(rows * 7 + n)
    k = 160
    weight = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    x = torch.randn(rows, k, generator=gen).bfloat16()
    out = panel_linear.linear(x, panel_linear.pack(weight), b, tiles)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    _close_to_float32(out, F.linear(x.float(), weight.float(), None if b is None else b.float()))


@ways
def test_rows_of_a_strided_x_are_read_where_they_lie(tiles):
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(32, 64, generator=gen).bfloat16()
    wide = torch.randn(21, 200, generator=gen).bfloat16()
    x = wide[:, 8:72]  # rows 200 apart
    out = panel_linear.linear(x, panel_linear.pack(weight), tiles=tiles)
    assert torch.equal(out, panel_linear.linear(x.contiguous(), panel_linear.pack(weight), tiles=tiles))
    _close_to_float32(out, F.linear(x.float(), weight.float()))


@ways
def test_a_row_comes_out_the_same_whatever_rows_share_its_product(tiles):
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(96, 576, generator=gen).bfloat16()
    panels = panel_linear.pack(weight)
    pair = panel_linear.pack_gated(weight[:48], weight[48:])
    x = torch.randn(100, 576, generator=gen).bfloat16()
    whole, gated = panel_linear.linear(x, panels, tiles=tiles), panel_linear.silu_and_mul(x, pair, tiles)
    for lo, hi in [(0, 1), (5, 22), (17, 50), (37, 100)]:
        assert torch.equal(panel_linear.linear(x[lo:hi], panels, tiles=tiles), whole[lo:hi])
        assert torch.equal(panel_linear.silu_and_mul(x[lo:hi], pair, tiles), gated[lo:hi])


@pytest.mark.parametrize("rows", [3, 40])
@ways
def test_the_gated_form_rounds_silu_of_the_gate_then_the_product(rows, tiles):
    gen = torch.Generator().manual_seed(rows)
    gate, up = (torch.randn(2, 64, 128, generator=gen) * 0.3).bfloat16()
    x = (torch.randn(rows, 128, generator=gen) * 2).bfloat16()
    out = panel_linear.silu_and_mul(x, panel_linear.pack_gated(gate, up), tiles)
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
    x = torch.randn(panel_linear.MAX_ROWS + 1, 96, generator=gen).bfloat16()
    big = packed_linear.packed_linear(x, packed, None)
    assert packed.panels is None  # more rows than the bound: oneDNN, and no panels laid out
    small = packed_linear.packed_linear(x[:9], packed, None)
    assert packed.panels is not None
    assert torch.equal(small, panel_linear.linear(x[:9], packed.panels))
    _close_to_float32(big, F.linear(x.float(), weight.float()))
    assert not panel_linear.takes(4, (64, 80)) and not panel_linear.takes(4, (72, 96))  # K of 32s, N of 16s
    wide = (panel_linear.WIDE_COLUMNS + 16, 96)
    assert panel_linear.takes(panel_linear.WIDE_MAX_ROWS, wide) and not panel_linear.takes(panel_linear.WIDE_MAX_ROWS + 1, wide)


def test_where_it_cannot_run_the_product_is_onednns(monkeypatch):
    monkeypatch.setattr(panel_linear, "available", lambda: False)
    weight = torch.randn(64, 96).bfloat16()
    packed = packed_linear.PackedWeight(weight)
    x = torch.randn(5, 96).bfloat16()
    assert torch.equal(packed_linear.packed_linear(x, packed, None), F.linear(x, weight))
    assert packed.panels is None


def test_bad_operands_are_refused_by_name():
    weight = torch.randn(32, 64).bfloat16()
    panels = panel_linear.pack(weight)
    with pytest.raises(RuntimeError, match="K / 32"):
        panel_linear.linear(torch.randn(4, 96).bfloat16(), panels)
    with pytest.raises(RuntimeError, match="bfloat16"):
        panel_linear.linear(torch.randn(4, 64), panels)
    with pytest.raises(RuntimeError, match="bias"):
        panel_linear.linear(torch.randn(4, 64).bfloat16(), panels, torch.zeros(16))


@pytest.mark.skipif(WAYS != [False, True], reason="one way here: the CPU has no AMX tiles")
def test_tiles_and_dot_products_differ_by_at_most_a_rounding():
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(96, 576, generator=gen).bfloat16()
    x = torch.randn(40, 576, generator=gen).bfloat16()
    panels = panel_linear.pack(weight)
    tiles, dots = panel_linear.linear(x, panels, tiles=True), panel_linear.linear(x, panels, tiles=False)
    reference = F.linear(x.float(), weight.float())
    _close_to_float32(tiles, reference)
    _close_to_float32(dots, reference)
    assert (tiles == dots).float().mean() >= 0.95  # the same sums in another order: nearly always one rounding


def test_tiles_are_asked_for_only_where_there_are_tiles():
    weight = torch.randn(32, 64).bfloat16()
    x = torch.randn(4, 64).bfloat16()
    if not torch.ops.kvflow_panel_linear.has_tiles():
        assert not panel_linear.has_tiles()
        with pytest.raises(RuntimeError, match="tiles=True, but no AMX here"):
            panel_linear.linear(x, panel_linear.pack(weight), tiles=True)
    else:
        assert panel_linear.has_tiles()
