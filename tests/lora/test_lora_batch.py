"""A batch's adapter deltas against a row-by-row reference, on a fused layer whose slices have
different widths, adapters of several ranks (below the layer's max rank) and a slice one adapter
leaves alone, rows in any order, in both forms a step can take (per segment, masked)."""

from __future__ import annotations

import pytest
import torch

from kvflow.lora.batch import LoRABatch
from kvflow.lora.layers import LoRAContext, LoRALinear
from kvflow.model.layers.linear import QKVParallelLinear, RowParallelLinear

MAX_LORAS, MAX_RANK = 3, 4


def _adapters(layer, gen) -> dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """slot → slice → (A [r, in], B [out, r]): ranks 1..4, and slot 1 leaves slice 1 alone."""
    adapters = {}
    for slot, rank in enumerate((4, 2, 1)):
        adapters[slot] = {i: (torch.randn(rank, layer.input_size, generator=gen),
                              torch.randn(size, rank, generator=gen))
                          for i, size in enumerate(layer.output_sizes) if not (slot == 1 and i == 1)}
    return adapters


def _reference(x, y, adapters, row_slots, out_sizes) -> torch.Tensor:
    y = y.clone()
    for row, slot in enumerate(row_slots):
        if slot < 0:
            continue
        col = 0
        for index, size in enumerate(out_sizes):
            if index in adapters[slot]:
                a, b = adapters[slot][index]
                y[row, col:col + size] += (x[row] @ a.t()) @ b.t()
            col += size
    return y


@pytest.mark.parametrize("make_layer", [lambda: QKVParallelLinear(6, 2, 4, 2), lambda: RowParallelLinear(6, 5)])
@pytest.mark.parametrize("row_slots", [
    [0, 0, 0, 2, 2, -1, -1, 1],  # sorted runs
    [2, -1, 0, 2, 1, 1, -1, 0, 0, 2],  # interleaved: a run per row
    [-1, 1, 1, 1],  # one adapter of three slots
    [0, 1, 2, 2],  # every slot
    [0, 0, 2, -1, 2],  # slot 1 holds an adapter no row uses, inside the masked form's slot range
])
@pytest.mark.parametrize("masked", [False, True])
def test_deltas_equal_the_row_by_row_formula(make_layer, row_slots, masked):
    gen = torch.Generator().manual_seed(0)
    base = make_layer()
    with torch.no_grad():
        base.weight.copy_(torch.randn(base.weight.shape, generator=gen))
    lora = LoRALinear(base, MAX_LORAS, MAX_RANK, LoRAContext(), torch.float32, torch.device("cpu"))
    adapters = _adapters(base, gen)
    for slot, slices in adapters.items():
        lora.set_slot(slot, slices)
    x = torch.randn(len(row_slots), base.input_size, generator=gen)
    lora.context.batch = LoRABatch.build(row_slots, masked=masked)
    assert (lora.context.batch.masked is not None) == masked
    expected = _reference(x, base(x), adapters, row_slots, base.output_sizes)
    got = lora(x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    plain = [r for r, s in enumerate(row_slots) if s < 0]
    assert torch.equal(got[plain], base(x)[plain])  # rows without an adapter get exactly nothing


def test_batch_segments():
    assert LoRABatch.build([-1, -1]) is None
    assert LoRABatch.build([-1, 2, 2, 0, -1, 0]).segments == [(2, 1, 3), (0, 3, 4), (0, 5, 6)]
    assert LoRABatch.build([1] * 5).segments == [(1, 0, 5)]


def test_form_follows_the_shape():
    """Decode-like steps (few rows per adapter) take the masked form; one adapter, or many rows
    per adapter (prefill), the segment loop; the mask covers exactly the slots in use's range."""
    decode = LoRABatch.build([s for s in range(4) for _ in range(8)])  # 32 rows, 4 adapters
    assert decode.masked is not None and decode.masked.first_slot == 0 and decode.masked.num_slots == 4
    assert LoRABatch.build([3] * 32).masked is None
    assert LoRABatch.build([s for s in range(4) for _ in range(512)]).masked is None


def test_masked_form_picks_each_rows_own_products():
    """Slots 5..7 (6 unused): the shrink's product of row r and slot 5 + j is r·3 + j. Each slot
    gathers its own rows' (padded to 2, the most a slot has: slot 6 has none), and only real
    entries are picked, into the rows with an adapter; the base row (1) is in none."""
    gap = LoRABatch.build([5, -1, 7, 5], masked=True).masked
    assert (gap.first_slot, gap.num_slots, gap.width) == (5, 3, 2)
    assert gap.gather.tolist() == [0 * 3 + 0, 3 * 3 + 0, 0 * 3 + 1, 0 * 3 + 1, 2 * 3 + 2, 2 * 3 + 2]
    assert gap.picks.tolist() == [0, 1, 4] and gap.rows.tolist() == [0, 3, 2]
