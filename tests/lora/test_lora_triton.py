"""The LoRA shrink/expand Triton kernels against the torch forms of `LoRABatch.add_lora`: fused
and single layers, adapters of ranks 8 and 16 in layers of max rank 16, rows without an adapter,
segments of odd lengths, float32 and bfloat16. Without a GPU they run under TRITON_INTERPRET=1
(tests/conftest.py); with one, on it. Sizes are tiny so the interpreter takes seconds.
"""

from __future__ import annotations

import sys

import pytest
import torch

triton = pytest.importorskip("triton")

from kvflow.lora import layers as lora_layers  # noqa: E402
from kvflow.lora.batch import LoRABatch  # noqa: E402
from kvflow.lora.layers import LoRAContext, LoRALinear  # noqa: E402
from kvflow.lora.triton_ops import add_lora, lora_expand_launch, lora_shrink_launch  # noqa: E402
from kvflow.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MAX_LORAS, MAX_RANK = 3, 16
LAYERS = {
    "qkv": lambda: QKVParallelLinear(24, 8, 4, 2),  # slices of 32, 16 and 16 columns
    "gate_up": lambda: MergedColumnParallelLinear(24, [40, 40]),
    "down": lambda: RowParallelLinear(40, 24),
}


def _lora_layer(make_layer, dtype: torch.dtype, seed: int) -> LoRALinear:
    """Slot 0 rank 16, slot 1 rank 8 leaving slice 1 alone, slot 2 rank 8: random weights."""
    gen = torch.Generator().manual_seed(seed)
    base = make_layer().to(dtype)
    lora = LoRALinear(base, MAX_LORAS, MAX_RANK, LoRAContext(), dtype, DEVICE)
    for slot, rank in enumerate((16, 8, 8)):
        lora.set_slot(slot, {i: (torch.randn(rank, base.input_size, generator=gen).to(dtype) / 4,
                                 torch.randn(size, rank, generator=gen).to(dtype) / 4)
                             for i, size in enumerate(base.output_sizes) if not (slot == 1 and i == 1)})
    return lora


ROW_SLOTS = [
    [0, 0, 0, 2, 2, -1, -1, 1, 1, 1, 1],  # sorted runs, odd lengths, a run without an adapter
    [2, -1, 0, 2, 1, 1, -1, 0, 0],  # interleaved: a run per row or two
    [-1] * 3 + [1] * 70,  # one long run: two row tiles of 64 in one segment
    [1],  # one decode row
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("row_slots", ROW_SLOTS)
def test_kernels_match_the_torch_forms(layer, row_slots, dtype):
    lora = _lora_layer(LAYERS[layer], dtype, seed=len(row_slots))
    x = (torch.randn(len(row_slots), lora.input_size, generator=torch.Generator().manual_seed(1))).to(dtype).to(DEVICE)
    batch = LoRABatch.build(row_slots, dtype, DEVICE, masked=False)
    y = torch.randn(len(row_slots), sum(lora.output_sizes), generator=torch.Generator().manual_seed(2)).to(dtype)
    y = y.to(DEVICE)
    expected = y.clone()
    batch.add_lora(expected, x, lora.lora_a, lora.lora_b)
    got = y.clone()
    add_lora(got, x, lora.lora_a, lora.lora_b, batch, MAX_RANK, lora.out_slices)
    plain = [r for r, s in enumerate(row_slots) if s < 0]
    assert torch.equal(got[plain], y[plain])  # rows without an adapter get exactly nothing
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:  # t and the sum are rounded to bf16 where torch rounds them; summation order differs
        torch.testing.assert_close(got.float(), expected.float(), rtol=2**-6, atol=2**-6)
        assert (got != expected).float().mean().item() < 0.05


def test_a_segment_without_an_adapter_adds_nothing():
    """A segment table may carry slot -1 runs: their programs write nothing, neither t nor y."""
    lora = _lora_layer(LAYERS["qkv"], torch.float32, seed=0)
    x = torch.randn(5, lora.input_size, device=DEVICE)
    batch = LoRABatch.build([0, 0, 0, 1, 1], device=DEVICE, masked=False)
    with_gap = LoRABatch([(0, 0, 2), (-1, 2, 3), (1, 3, 5)], 5, 0, None,
                         torch.tensor([[0, 0, 2], [-1, 2, 3], [1, 3, 5]], dtype=torch.int32, device=DEVICE))
    y, got = torch.zeros(5, 64, device=DEVICE), torch.zeros(5, 64, device=DEVICE)
    batch.add_lora(y, x, lora.lora_a, lora.lora_b)
    add_lora(got, x, lora.lora_a, lora.lora_b, with_gap, MAX_RANK, lora.out_slices)
    assert torch.equal(got[2], torch.zeros(64, device=DEVICE))
    torch.testing.assert_close(got[[0, 1, 3, 4]], y[[0, 1, 3, 4]], rtol=1e-5, atol=1e-5)


def test_launch_shapes_follow_the_segments():
    """Decode segments take one 16-row tile; a long one tiles of 64; ranks pad to tl.dot's 16."""
    x, a = torch.empty(70, 24, device="meta"), torch.empty(MAX_LORAS, 3 * 8, 24, device="meta")
    decode = LoRABatch.build([0, 1, 1, 2], device="meta", masked=False)
    shrink, t = lora_shrink_launch(x[:4], a, decode)
    assert shrink.grid == (3, 1, 1) and shrink.constexprs["BLOCK_M"] == 16 and shrink.constexprs["BLOCK_R"] == 32
    assert t.shape == (4, 24)
    prefill = LoRABatch.build([0] * 70, device="meta", masked=False)
    expand = lora_expand_launch(torch.empty(70, 100, device="meta"), torch.empty(70, 8, device="meta"),
                                torch.empty(MAX_LORAS, 8, 100, device="meta"), prefill)
    assert expand.grid == (1, 2, 2) and expand.constexprs["BLOCK_M"] == 64 and expand.constexprs["BLOCK_R"] == 16


def test_wrong_row_count_is_an_error():
    lora = _lora_layer(LAYERS["down"], torch.float32, seed=0)
    batch = LoRABatch.build([0, 1], device=DEVICE, masked=False)
    with pytest.raises(RuntimeError, match="got 3 rows in a step of 2 tokens"):
        add_lora(torch.zeros(3, 24), torch.zeros(3, 40), lora.lora_a, lora.lora_b, batch, MAX_RANK, lora.out_slices)


def test_layer_takes_the_kernels_only_on_cuda(monkeypatch):
    assert lora_layers.lora_kernels_for(torch.zeros(1)) is None
    lora = _lora_layer(LAYERS["gate_up"], torch.float32, seed=3)
    row_slots = [0, 0, 1, -1, 2]
    x = torch.randn(5, lora.input_size, device=DEVICE)
    lora.context.batch = LoRABatch.build(row_slots, device=DEVICE, masked=False)
    expected = lora(x) if DEVICE.type == "cpu" else None
    calls = []
    monkeypatch.setattr(lora_layers, "lora_kernels_for", lambda x: lambda *a: (calls.append(a), add_lora(*a)))
    got = lora(x)
    assert len(calls) == 1
    if expected is not None:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_missing_triton_falls_back_to_torch(monkeypatch):
    lora_layers._load_kernels.cache_clear()
    monkeypatch.setattr(lora_layers, "triton_installed", lambda: False)
    monkeypatch.setitem(sys.modules, "triton", None)
    try:
        assert lora_layers._load_kernels() is None
    finally:
        lora_layers._load_kernels.cache_clear()
