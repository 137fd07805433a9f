"""Float weights packed once for oneDNN (quant/packed_linear.py): the same products as F.linear,
used by unquantized bf16 layers on CPU, and never for other dtypes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvflow.model.layers.linear import MergedColumnParallelLinear
from kvflow.quant import packed_linear


@pytest.mark.parametrize("rows", [1, 3, 64, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_product_equals_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=gen).bfloat16()
    b = torch.randn(96, generator=gen).bfloat16() if bias else None
    x = torch.randn(2, rows, 64, generator=gen).bfloat16()
    packed = packed_linear.pack_weight(weight)
    assert torch.equal(packed_linear.packed_linear(x, packed, b), F.linear(x, weight, b))


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


def test_float32_and_switched_off_layers_stay_unpacked(monkeypatch):
    assert getattr(_layer(torch.float32), "packed_weight", None) is None
    monkeypatch.setenv(packed_linear.DISABLE_ENV, "0")
    assert getattr(_layer(torch.bfloat16), "packed_weight", None) is None
