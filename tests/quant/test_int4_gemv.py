"""kvflow's int4/int8 GEMV with bfloat16 activations (quant/int4_gemv.py): the AVX-512 BF16 kernel
against its scalar loop and against the float product of the dequantized weights, the re-laying
of Int4Planes (the default model's Q4_1 and Q8_0 tensors included), and the layer's choice."""

from __future__ import annotations

import pytest
import torch
from test_gguf_native import default_tensors, gguf_py_dequantize, random_blocks  # noqa: F401 - a fixture

from kvflow.quant import int4_gemv
from kvflow.quant.gguf_blocks import decode
from kvflow.quant.int4_gemv import GROUP, Int4Gemv
from kvflow.quant.int4pack import Int4Planes, _unpack, planes_from_affine

SHAPES = [(100, 96), (960, 576), (576, 1536), (33, 160), (24, 512), (20, 1056)]
# 3, 5 and 33 groups: an odd count is padded; 16 and 48: whole blocks only; 18 and 33: blocks and groups after them


@pytest.fixture(autouse=True, scope="module")
def library():
    if not int4_gemv.load():
        pytest.skip("the int4 GEMV library cannot be built here")


def random_weights(n: int, k: int, bits: int, seed: int = 0) -> Int4Gemv:
    gen = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 2**bits, (n, k), generator=gen)
    scale = torch.rand(n, k // GROUP, generator=gen) * 0.02
    zero = (torch.rand(n, k // GROUP, generator=gen) - 0.5) * 0.1
    return Int4Gemv(u, torch.stack([scale, zero], -1).bfloat16(), bits)


def assert_close_to(out: torch.Tensor, reference: torch.Tensor) -> None:
    """Float sums, one bfloat16 rounding of the output: half a bfloat16 step of the largest value
    bounds the error (a last-place difference in the float sum may cross a rounding boundary)."""
    assert out.dtype == torch.bfloat16 and out.shape == reference.shape
    assert (out.float() - reference).abs().max() <= 2**-8 * reference.abs().max() + 1e-6


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n, k", SHAPES)
def test_kernel_computes_the_float_product(bits, n, k):
    weights = random_weights(n, k, bits)
    w = weights.dequantize()
    for rows in (1, 2, 3, 4, 5, 8):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
        reference = x.float() @ w.t()
        assert_close_to(weights(x), reference)
        for path in (int4_gemv.SCALAR, int4_gemv.BF16_PRODUCTS, int4_gemv.INT8_LEVELS):
            assert_close_to(weights(x, path), reference)


@pytest.mark.parametrize("bits", [4, 8])
def test_int8_levels_miss_the_product_by_their_stated_bound(bits):
    """One row of 4- or 8-bit codes through the two int8 levels: off the float product of the exact
    bfloat16 activations by at most the output's bfloat16 rounding plus, per group, max|x| / 64,516
    (half of a/254, a = max|x| / 127)
    times the group's Σ|w| (float sums add a little slack). Groups of zeros, one outlier among tiny
    values, and an odd group count (the kernel's masked last chunk) included."""
    if not torch.ops.kvflow_int4_gemv.has_int8_levels():
        pytest.skip("no AVX-512 VNNI here: the int8 levels are not built")
    for n, k in SHAPES:
        weights = random_weights(n, k, bits, seed=n)
        w = weights.dequantize()
        gen = torch.Generator().manual_seed(k)
        x = torch.randn(1, k, generator=gen) * torch.logspace(-3, 2, k // GROUP).repeat_interleave(GROUP)
        x[0, :GROUP] = 0  # a group of zeros
        x[0, GROUP + 5] = 300.0  # an outlier among small values
        x = x.bfloat16()
        reference = x.float() @ w.t()
        got = weights(x, int4_gemv.INT8_LEVELS).float()
        group_max = x.float().abs().view(k // GROUP, GROUP).amax(1)  # [G]
        w_abs = w.abs().view(n, k // GROUP, GROUP).sum(2)  # [N, G]
        bound = 2**-8 * reference.abs() + (w_abs * group_max).sum(1) / (127 * 508) + 1e-4 * (w.abs() @ x.float().abs().t()).t()
        assert ((got - reference).abs() <= bound).all()

    # Where one weight alone is 1, the output is that activation as the levels hold it: 0.30078125
    # beside a group maximum of 127 is 76/254 (a = 1): off by 0.0016 ≤ a / 508, visibly.
    u = torch.full((16, 64), 8)
    u[0, 1] = 9
    sz = torch.stack([torch.ones(16, 2), torch.zeros(16, 2)], -1)  # s = 1, z = 0: w = u − 8
    one = Int4Gemv(u, sz.bfloat16(), 4)
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1] = 127.0, 0.30078125
    exact = one(x.bfloat16(), int4_gemv.BF16_PRODUCTS).float()[0, 0]
    levels = one(x.bfloat16(), int4_gemv.INT8_LEVELS).float()[0, 0]
    assert exact == 0.30078125 and levels != exact and abs(levels - 0.30078125) <= 1 / 508


@pytest.mark.parametrize("bits", [4, 8])
def test_int8_levels_carry_nan_and_inf_through(bits):
    """A NaN or an infinity among one row's activations makes every output non-finite, as the float
    product's would be (no int8 level holds them; converting them would give silent garbage)."""
    if not torch.ops.kvflow_int4_gemv.has_int8_levels():
        pytest.skip("no AVX-512 VNNI here: the int8 levels are not built")
    weights = random_weights(40, 1056, bits)  # 33 groups: two blocks and one after them
    for bad in (float("nan"), float("inf"), float("-inf")):
        for at in (37, 1040):  # in a block, after the blocks
            x = torch.randn(1, 1056)
            x[0, at] = bad
            got = weights(x.bfloat16(), int4_gemv.INT8_LEVELS)
            assert not got.float().isfinite().any()


def test_extreme_codes_and_scales():
    """All-zero and all-maximum codes, negative scales: the biased bfloat16 codes stay exact."""
    for bits in (4, 8):
        u = torch.cat([torch.zeros(8, 64), torch.full((8, 64), 2**bits - 1)]).int()
        sz = torch.stack([torch.tensor([-0.03, 0.07]).repeat(16, 1), torch.tensor([0.5, -2.0]).repeat(16, 1)], -1)
        weights = Int4Gemv(u, sz.bfloat16(), bits)
        x = torch.randn(3, 64).bfloat16()
        assert_close_to(weights(x), x.float() @ weights.dequantize().t())


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.0.ffn_down.weight", "token_embd.weight"])
def test_default_model_planes_re_laid(default_tensors, name):  # noqa: F811 - the fixture
    """Q4_1 (one plane) and Q8_0 (two) planes become 4- and 8-bit weights equal to the planes."""
    blocks = default_tensors[name]
    form = decode(blocks)
    planes = Int4Planes(planes_from_affine(form.u, form.scale, form.min, form.bits), form.group, torch.bfloat16, name)
    n, k = blocks.shape
    weights = Int4Gemv.from_planes([_unpack(p, k)[:n] for p in planes.packed], planes.scale_zero, form.group)
    assert weights.bits == (8 if name == "token_embd.weight" else 4)
    w = weights.dequantize()
    torch.testing.assert_close(w, planes.dequantize(torch.float32), rtol=1e-6, atol=1e-7)
    reference = gguf_py_dequantize(blocks)
    assert (w - reference).abs().max() <= 2**-8 * reference.abs().max()  # the planes' bf16 scales
    x = torch.randn(2, k).bfloat16()
    assert_close_to(weights(x), x.float() @ w.t())


def test_wider_groups_repeat_their_scales():
    gen = torch.Generator().manual_seed(0)
    u = torch.randint(0, 16, (64, 256), generator=gen)
    scale, minimum = torch.rand(64, 2, generator=gen) * 0.02, -torch.rand(64, 2, generator=gen) * 0.1
    planes = Int4Planes(planes_from_affine(u, scale, minimum, 4), 128, torch.bfloat16, "wide")
    weights = Int4Gemv.from_planes([_unpack(p, 256)[:64] for p in planes.packed], planes.scale_zero, 128)
    torch.testing.assert_close(weights.dequantize(), planes.dequantize(torch.float32), rtol=1e-6, atol=1e-7)


def test_planes_without_an_exact_form_are_left_to_aten():
    """No GEMV form for: float32 scales; two planes that are not one base-16 number; a combined
    zero that bfloat16 cannot hold; three planes. Two planes that are one number have one."""
    q = [torch.randint(0, 16, (64, 64))] * 3
    planes = Int4Planes(planes_from_affine(q[0], torch.rand(64, 2), torch.rand(64, 2), 4), 32, torch.float32, "f32")
    assert Int4Gemv.from_planes([_unpack(p, 64)[:64] for p in planes.packed], planes.scale_zero, 32) is None
    sz = torch.rand(2, 2, 64, 2).bfloat16()  # [P, K / group, N, 2]: (scale, zero) per plane
    assert Int4Gemv.from_planes(q[:2], sz, 32) is None  # s_1 is not 16·s_0
    sz[1, ..., 0] = sz[0, ..., 0] * 16
    assert Int4Gemv.from_planes(q[:2], sz, 32) is None  # z = z_0 + z_1 − 8·s_0 rounds in bf16
    sz[0, ..., 1], sz[1, ..., 1] = sz[0, ..., 0] * 8, 0  # Q8_0's planes: z = 0
    assert Int4Gemv.from_planes(q[:2], sz, 32).bits == 8
    assert Int4Gemv.from_planes(q, torch.cat([sz, sz[:1]]), 32) is None


def test_layer_uses_it_for_few_bfloat16_rows_only(monkeypatch):
    form = decode(random_blocks("Q4_1", 128, 256))
    layer = Int4Planes(planes_from_affine(form.u, form.scale, form.min, form.bits), form.group, torch.bfloat16, "l")
    if not int4_gemv.fast():
        assert layer.gemv is None  # no AVX-512 BF16: the scalar loop would be slower than aten's kernel
        return
    calls = []
    call = Int4Gemv.__call__
    monkeypatch.setattr(Int4Gemv, "__call__", lambda self, x, *a: calls.append(len(x)) or call(self, x, *a))
    w = layer.dequantize(torch.float32)
    few = int4_gemv.MAX_ROWS
    for rows in (1, few, few + 1):
        x = torch.randn(rows, 256).bfloat16()
        reference = x.float() @ w.t()
        torch.testing.assert_close(layer(x).float(), reference, rtol=2**-7, atol=2**-7 * reference.abs().max())
    assert calls == [1, few]


def test_batch_invariant_it_is_not_used():
    form = decode(random_blocks("Q4_1", 64, 64))
    layer = Int4Planes(planes_from_affine(form.u, form.scale, form.min, 4), 32, torch.bfloat16, "l")
    layer.use_kernel_at_any_rows()
    assert layer.gemv is None


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        Int4Gemv(torch.zeros(4, 32, dtype=torch.int32), torch.ones(4, 1, 2).bfloat16(), 5)
    with pytest.raises(ValueError, match="input width 48 is not a multiple of 32"):
        Int4Gemv(torch.zeros(4, 48, dtype=torch.int32), torch.ones(4, 1, 2).bfloat16(), 4)
    with pytest.raises(ValueError, match=r"scale_zero must be bfloat16 \[4, 1, 2\]"):
        Int4Gemv(torch.zeros(4, 32, dtype=torch.int32), torch.ones(4, 1, 2), 4)
    weights = random_weights(8, 64, 4)
    with pytest.raises(RuntimeError, match="1 to 8 rows, not 9"):
        weights(torch.randn(9, 64).bfloat16())
    with pytest.raises(RuntimeError, match="x and out must be bfloat16"):
        weights(torch.randn(1, 64))


@pytest.mark.parametrize("bits", [4, 8])
def test_rows_are_the_dequantized_rows_bit_for_bit(bits):
    """The embedding lookup (one C++ call) gives `dequantize()[ids]` exactly in float32, and its
    bfloat16 rounding in bfloat16; an id outside the table is an error that names it."""
    for n, k in SHAPES:
        weights = random_weights(n, k, bits, seed=k)
        ids = torch.tensor([0, n - 1, n // 2, 0])
        w = weights.dequantize()
        assert torch.equal(weights.rows(ids), w[ids])
        assert torch.equal(weights.rows(ids, torch.bfloat16), w[ids].bfloat16())
    with pytest.raises(RuntimeError, match="id 100 is outside"):
        weights.rows(torch.tensor([1, 100]))


def test_no_rows_give_no_rows_on_every_path():
    """A step can hand a layer zero rows (an EAGLE head in a step where no request samples): the
    GEMV kernel takes 1 to 8, so the layer answers [0, N] itself, in bfloat16 and float32."""
    gen = torch.Generator().manual_seed(1)
    u = torch.randint(0, 16, (64, 128), generator=gen)
    scale, minimum = torch.rand(64, 4, generator=gen) * 0.02, -torch.rand(64, 4, generator=gen) * 0.1
    layer = Int4Planes(planes_from_affine(u, scale, minimum, 4), 32, torch.bfloat16, "rows")
    assert (layer.gemv is not None) == int4_gemv.fast()  # the path that refused zero rows, where it is built
    for dtype in (torch.bfloat16, torch.float32):
        assert layer(torch.randn(0, 128).to(dtype)).shape == (0, 64)
        assert layer(torch.randn(2, 0, 128).to(dtype)).shape == (2, 0, 64)
