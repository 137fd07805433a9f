"""Float weights packed once for oneDNN (quant/packed_linear.py): the same products as F.linear,
used by unquantized bf16 layers on CPU, and never for other dtypes. The oneDNN tests run as where
the panel kernel cannot be built (its products sum in another order: tests/quant/test_panel_linear.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvflow.model.layers.linear import MergedColumnParallelLinear
from kvflow.quant import layouts, packed_linear, panel_linear


@pytest.fixture
def onednn_only(monkeypatch):
    monkeypatch.setattr(panel_linear, "available", lambda: False)


@pytest.mark.parametrize("rows", [1, 3, 64, 130, 200, 1100])  # x has 2 * rows: 400 is a middle count
@pytest.mark.parametrize("bias", [False, True])
def test_packed_product_equals_f_linear(rows, bias, onednn_only):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=gen).bfloat16()
    b = torch.randn(96, generator=gen).bfloat16() if bias else None
    x = torch.randn(2, rows, 64, generator=gen).bfloat16()
    packed = packed_linear.PackedWeight(weight)
    assert torch.equal(packed_linear.packed_linear(x, packed, b), F.linear(x, weight, b))


@pytest.mark.parametrize("amx", [True, False])
def test_the_layout_for_middle_row_counts_is_packed_when_one_first_asks_on_amx(amx, onednn_only, monkeypatch):
    """Where the CPU has AMX tiles the 1-row layout is laid out for middle row counts (it paid
    there); elsewhere (it did not: docs/performance-journal.md, issue 40) it never is."""
    monkeypatch.setattr(panel_linear, "has_tiles", lambda: amx)
    weight = torch.randn(96, 64).bfloat16()
    packed = packed_linear.PackedWeight(weight)
    low, high = packed_linear.MIDDLE_ROWS
    for rows in (1, low - 1, high + 1):
        assert packed.for_rows(rows) is packed.main
    assert packed.middle is None  # nothing asked for it: one packed copy in memory
    x = torch.randn(low, 64).bfloat16()
    assert torch.equal(packed_linear.packed_linear(x, packed, None), F.linear(x, weight))
    assert (packed.middle is not None) == amx
    assert packed.for_rows(high) is (packed.middle if amx else packed.main)
    assert packed.for_rows(high + 1) is packed.main


def _layer(dtype):
    torch.manual_seed(0)
    layer = MergedColumnParallelLinear(64, [48, 48], bias=False, prefix="mlp.gate_up_proj")
    layer.weight.data = torch.randn(96, 64).to(dtype)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def test_unquantized_bf16_layer_runs_packed():
    layer = _layer(torch.bfloat16)
    assert getattr(layer, "packed_weight", None) is not None
    x = torch.randn(5, 64).bfloat16()
    assert torch.equal(layer(x), F.linear(x, layer.weight))
    assert "packed_weight" not in layer.state_dict()


def test_float32_layers_stay_unpacked():
    assert getattr(_layer(torch.float32), "packed_weight", None) is None


# -- SiLU(gate) * up in one pass (GatedPair) and where it runs ----------------------------------------------
def _silu_mul_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x.float(), weight.float()).chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("rows", [1, 5, 64, 130])
def test_gated_pair_is_silu_of_gate_times_up(rows):
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(2 * 48, 64, generator=gen) * 0.2).bfloat16()
    x = torch.randn(2, rows, 64, generator=gen).bfloat16()
    out = packed_linear.GatedPair(weight)(x)
    assert out.shape == (2, rows, 48) and out.dtype == torch.bfloat16
    reference = _silu_mul_reference(x, weight)
    # one rounding of the result, where the unfused chain rounds gate, up, SiLU and the product
    torch.testing.assert_close(out.float(), reference, rtol=2**-7, atol=1e-3)


def test_the_mlp_takes_the_one_pass_form_and_leaves_it_to_hooks_tiles_and_lora():
    from kvflow.lora.layers import LoRAContext, LoRALinear
    from kvflow.model.layers.batch_invariant import RowTiledMethod
    from kvflow.model.layers.mlp import GatedMLP

    torch.manual_seed(0)
    mlp = GatedMLP(64, 48, None, "mlp")
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        layer.weight.data = (torch.randn_like(layer.weight) * 0.2).bfloat16()
        layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(7, 64).bfloat16()
    gate, up = mlp.gate_up_proj(x).chunk(2, -1)
    unfused = mlp.down_proj(F.silu(gate) * up)  # the bf16 chain, rounded at every step
    reference = F.linear(_silu_mul_reference(x, mlp.gate_up_proj.weight), mlp.down_proj.weight.float())
    out = mlp(x)
    assert getattr(mlp.gate_up_proj, "gated", None) is not None  # it ran
    assert (out.float() - reference).abs().max() <= (unfused.float() - reference).abs().max()  # no worse

    seen = []
    hook = mlp.gate_up_proj.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape))
    mlp(x)
    assert seen == [x.shape]  # a hooked layer (calibration's) is called, not bypassed
    hook.remove()
    assert RowTiledMethod(mlp.gate_up_proj.quant_method).silu_and_mul(mlp.gate_up_proj, x) is None
    assert LoRALinear(mlp.gate_up_proj, 1, 4, LoRAContext(), torch.bfloat16, torch.device("cpu")).silu_and_mul(x) is None
    float_mlp = GatedMLP(64, 48, None, "mlp")
    float_mlp.gate_up_proj.quant_method.process_weights_after_loading(float_mlp.gate_up_proj)
    assert float_mlp.gate_up_proj.silu_and_mul(x.float()) is None  # float32: the reference path


def test_int4_planes_take_the_one_pass_form_only_where_they_would_take_the_dense_copy():
    from kvflow.quant.int4pack import KERNEL_MAX_ROWS, Int4Planes, planes_from_affine

    gen = torch.Generator().manual_seed(5)
    u = torch.randint(0, 16, (96, 64), generator=gen, dtype=torch.uint8)
    scale, minimum = torch.rand(96, 2, generator=gen) * 0.02, -torch.rand(96, 2, generator=gen) * 0.15
    planes = Int4Planes(planes_from_affine(u, scale, minimum, 4), 32, torch.bfloat16, "mlp.gate_up_proj")
    few = planes.max_kernel_rows
    assert few >= KERNEL_MAX_ROWS
    assert planes.silu_and_mul(torch.randn(few, 64).bfloat16()) is None  # the GEMV's or the int4 kernel's rows
    x = torch.randn(few + 1, 64, generator=gen).bfloat16()
    torch.testing.assert_close(planes.silu_and_mul(x).float(), _silu_mul_reference(x, planes.dequantize()),
                               rtol=2**-7, atol=1e-3)
    planes.use_kernel_at_any_rows()  # batch-invariant: the int4 kernel, whatever the rows
    assert planes.silu_and_mul(x) is None


@pytest.mark.parametrize("amx", [True, False])
def test_gated_pairs_keep_onednn_halves_only_where_they_pay(amx, monkeypatch):
    """Past the panel kernel's rows a pair's oneDNN halves (a second copy of the weight) paid on a
    Xeon with AMX, not on the AMD EPYC (docs/performance-journal.md, issue 40): elsewhere the pair holds
    its panels alone, and a product of more rows runs unfused, bit for bit the layer's own product
    and the activation kernel."""
    from kvflow.model.layers import cpu_ops
    from kvflow.model.layers.mlp import GatedMLP

    if not panel_linear.available():
        pytest.skip("no AVX-512 BF16 here: no panel kernel")
    monkeypatch.setattr(panel_linear, "has_tiles", lambda: amx)
    weight = torch.randn(2 * 48, 64).bfloat16()
    pair = packed_linear.GatedPair(weight)
    assert pair.panels is not None and (pair.gate is not None) == amx
    assert pair.takes(panel_linear.MAX_ROWS) and pair.takes(panel_linear.MAX_ROWS + 1) == amx
    assert len(pair.layouts()[layouts.GATED]) == (3 if amx else 1)  # the halves (for 512 rows) and the panels
    if amx:
        return  # the products below would ask this CPU's panel kernel for tiles
    mlp = GatedMLP(64, 48, None, "mlp")
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        layer.weight.data = (torch.randn_like(layer.weight) * 0.2).bfloat16()
        layer.quant_method.process_weights_after_loading(layer)
    many = torch.randn(panel_linear.MAX_ROWS + 1, 64).bfloat16()
    assert mlp.gate_up_proj.silu_and_mul(many) is None and getattr(mlp.gate_up_proj, "gated", None) is None
    assert mlp.gate_up_proj.silu_and_mul_plan(many.shape[0], torch.bfloat16) is None
    unfused = mlp.down_proj(cpu_ops.silu_and_mul(mlp.gate_up_proj(many)))
    assert torch.equal(mlp(many), unfused)
