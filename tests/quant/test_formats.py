"""Round-trip bounds of each number format, its edge values, and refusal of NaN/inf."""

from __future__ import annotations

import pytest
import torch

from kvflow.quant.awq import _pack_awq, _unpack_awq
from kvflow.quant.formats import (
    E2M1_VALUES,
    e2m1_decode,
    e2m1_encode,
    e8m0_decode,
    fp8_per_channel,
    int4_per_group,
    int8_per_channel,
    mxfp4_per_block,
    pack_nibbles,
    unpack_nibbles,
)


def test_int8_error_is_at_most_half_a_step():
    w = torch.randn(64, 96)
    w[3] = 0  # an all-zero row keeps a usable scale
    q, scale = int8_per_channel(w, "w")
    assert q.dtype == torch.int8 and q.abs().max() <= 127 and torch.all(q[3] == 0)
    assert torch.all((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_error_is_at_most_half_a_step(group):
    w = torch.randn(16, 256)
    u, scale, minimum = int4_per_group(w, group, "w")
    back = (u.view(16, -1, group).float() * scale[..., None] + minimum[..., None]).view(16, 256)
    assert u.max() <= 15
    assert torch.all((back - w).abs().view(16, -1, group) <= scale[..., None] / 2 + 1e-6)
    assert torch.equal(unpack_nibbles(pack_nibbles(u)), u)


def test_fp8_keeps_three_mantissa_bits():
    w = torch.randn(8, 64)
    q, scale = fp8_per_channel(w, "w")
    back = q.float() * scale[:, None]
    normal = w.abs() >= 2**-6 * scale[:, None]  # below E4M3's smallest normal the step is absolute
    assert torch.all(((back - w).abs() <= w.abs() * 2**-4 + 1e-9)[normal])
    assert torch.allclose(back.abs().amax(1), w.abs().amax(1), rtol=2**-4)


def test_e2m1_edge_values_ties_and_saturation():
    assert torch.equal(e2m1_decode(e2m1_encode(E2M1_VALUES)), E2M1_VALUES)
    assert torch.equal(e2m1_decode(e2m1_encode(-E2M1_VALUES[1:])), -E2M1_VALUES[1:])
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert e2m1_decode(e2m1_encode(ties)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # to the even code
    assert e2m1_decode(e2m1_encode(torch.tensor([7.0, -100.0, 6.01]))).tolist() == [6.0, -6.0, 6.0]


def test_e8m0_scales_are_powers_of_two_putting_the_block_max_in_4_to_8():
    w = torch.randn(4, 64) * torch.tensor([1e-3, 1.0, 50.0, 0.0])[:, None]
    codes, scales = mxfp4_per_block(w, "w")
    s = e8m0_decode(scales)
    assert torch.equal(torch.log2(s), torch.log2(s).round())
    amax = w.view(4, 2, 32).abs().amax(-1)
    assert torch.all(((amax / s) >= 4) & ((amax / s) < 8) | (amax == 0))
    back = e2m1_decode(codes).view(4, 2, 32) * s[..., None]
    assert torch.all(back[3] == 0)
    # half of the widest E2M1 step (4 → 6), or the clip of [6, 8) to 6: at most 2 · s
    assert torch.all((back - w.view(4, 2, 32)).abs() <= 2 * s[..., None])


@pytest.mark.parametrize("quantize", [lambda w: int8_per_channel(w, "blk.3.w"), lambda w: fp8_per_channel(w, "blk.3.w"),
                                      lambda w: int4_per_group(w, 32, "blk.3.w"), lambda w: mxfp4_per_block(w, "blk.3.w")])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_and_inf_are_refused_naming_the_tensor(quantize, bad):
    w = torch.randn(4, 64)
    w[1, 7] = bad
    with pytest.raises(ValueError, match="blk.3.w: the weight holds NaN or inf"):
        quantize(w)


def test_awq_packing_round_trips_in_its_interleaved_order():
    values = torch.randint(0, 16, (3, 16), dtype=torch.int32)
    packed = _pack_awq(values)
    assert packed.shape == (3, 2) and packed.dtype == torch.int32
    assert torch.equal(_unpack_awq(packed), values)
    one = torch.zeros(1, 8, dtype=torch.int32)
    one[0, 1] = 5  # column 1 sits in nibble 4 (order 0 2 4 6 1 3 5 7)
    assert _pack_awq(one).item() == 5 << 16
