"""The CPU KV-write op (attention/cpu_kv_write.py) against torch's index_put path of write_kv
(what runs where the op cannot be built): the same bits in the pool (a copy), negative slots
skipped, a slot past the pool refused before anything is written."""

from __future__ import annotations

import contextlib

import pytest
import torch

from kvflow.attention import cpu_kv_write, kv_quant
from kvflow.attention.metadata import AttentionMetadata, write_kv

BLOCKS, KV_HEADS, BLOCK_SIZE, DIM = 6, 3, 4, 18
CODES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
# fp8 codes below the format's smallest normal: exponent bits zero, mantissa bits not.
SUBNORMAL_BITS = {torch.float8_e4m3fn: (0x78, 0x07), torch.float8_e5m2: (0x7C, 0x03)}


def meta_for(slots: list[int]) -> AttentionMetadata:
    n = len(slots)
    return AttentionMetadata(query_start_loc=torch.tensor([0, n]), seq_lens=torch.tensor([n]),
                             block_tables=torch.zeros(1, 1, dtype=torch.long), slot_mapping=torch.tensor(slots),
                             block_size=BLOCK_SIZE, query_lens_cpu=[n], seq_lens_cpu=[n])


@contextlib.contextmanager
def writer(op: str, monkeypatch):
    """Writes through the op ("op"), or through torch as where the op cannot be built ("torch")."""
    with monkeypatch.context() as patch:
        if op == "torch":
            patch.setattr(cpu_kv_write, "load_writer", lambda: None)
        yield


def projections(tokens: int, dtype: torch.dtype, dim: int = DIM):
    """k and v as the attention front hands them over: strided views of one qkv output."""
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (2 + 2 * KV_HEADS) * dim, generator=gen).to(dtype)
    _, k, v = qkv.split([2 * dim, KV_HEADS * dim, KV_HEADS * dim], -1)
    return k.unflatten(-1, (KV_HEADS, dim)), v.unflatten(-1, (KV_HEADS, dim))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots", [[5], [0, 1, 2, 3, 4, 23], [9, -1, 13, -1, 20, 2, 3]])
def test_op_writes_the_bits_torch_writes(slots, dtype, monkeypatch):
    k, v = projections(len(slots), dtype)
    pools = {}
    for way in ("op", "torch"):
        with writer(way, monkeypatch):
            pool = torch.full((2, BLOCKS, KV_HEADS, BLOCK_SIZE, DIM), float("nan"), dtype=dtype)
            write_kv(k, v, pool, meta_for(slots))
            pools[way] = pool
    written = pools["op"][~pools["op"].isnan()]
    assert written.numel() == 2 * sum(s >= 0 for s in slots) * KV_HEADS * DIM  # nothing else touched
    assert torch.equal(pools["op"].nan_to_num(7.0), pools["torch"].nan_to_num(7.0))


def test_op_is_taken_for_a_cpu_pool():
    k, v = projections(2, torch.float32)
    pool = torch.zeros(2, BLOCKS, KV_HEADS, BLOCK_SIZE, DIM)
    assert cpu_kv_write.try_write(k, v, pool, torch.tensor([0, 5]))
    assert not cpu_kv_write.try_write(k, v, pool.bfloat16(), torch.tensor([0, 5]))  # a cast: torch's
    assert torch.equal(pool[1, 1, :, 1], v[1])


def test_a_slot_past_the_pool_is_refused_and_nothing_is_written():
    k, v = projections(2, torch.float32)
    pool = torch.zeros(2, BLOCKS, KV_HEADS, BLOCK_SIZE, DIM)
    with pytest.raises(RuntimeError, match=f"slot {BLOCKS * BLOCK_SIZE} is past the pool of {BLOCKS * BLOCK_SIZE}"):
        cpu_kv_write.try_write(k, v, pool, torch.tensor([0, BLOCKS * BLOCK_SIZE]))
    assert not pool.any()


@pytest.mark.parametrize("codes", CODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots", [[5], [9, -1, 13, -1, 20, 2, 3]])
@pytest.mark.parametrize("dim", [DIM, 64])  # 64: the 16-wide path
def test_op_quantizes_to_the_bits_kv_quant_writes(codes, dtype, slots, dim, monkeypatch):
    """A quantized pool (kv_quant.py): the op's codes and scales equal kv_quant.write's, bit for
    bit, for vectors of every magnitude: zero (the smallest scale), tiny (fp8 subnormals), an
    outlier, huge; bytes of unwritten slots untouched."""
    k, v = projections(len(slots), dtype, dim)
    magnitudes = torch.tensor([0.0, 1e-30, 1e-4, 1.0, 3e3, 1e30])
    k = k * magnitudes[torch.arange(len(slots)) % len(magnitudes)].to(dtype)[:, None, None]
    # Codes near zero: E4M3 subnormals from ~2^-18 of a vector's largest number, E5M2's from ~2^-30.
    v = v * torch.tensor([1.0, 3e-5, 1e-4, 1e-2, 3e-10, 1e-9]).repeat(dim)[:dim].to(dtype)
    v[0, 0, 1] = 500.0  # an outlier sets its vector's scale
    pools = {}
    for way in ("op", "torch"):
        with writer(way, monkeypatch):
            pool = torch.full((2, BLOCKS, KV_HEADS, BLOCK_SIZE * (dim + 2)), 0xA5, dtype=torch.uint8).view(codes)
            write_kv(k, v, pool, meta_for(slots))
            pools[way] = pool.view(torch.uint8)
    if codes in SUBNORMAL_BITS:
        exponent, mantissa = SUBNORMAL_BITS[codes]
        assert bool(((pools["op"] & exponent == 0) & (pools["op"] & mantissa != 0)).any())
    assert torch.equal(pools["op"], pools["torch"])
    untouched = (pools["op"] == 0xA5).sum().item()
    assert untouched >= 2 * KV_HEADS * (BLOCKS * BLOCK_SIZE - sum(s >= 0 for s in slots)) * (dim + 2)


def test_quantized_op_is_taken_for_a_cpu_pool():
    k, v = projections(2, torch.bfloat16)
    pool = torch.zeros(2, BLOCKS, KV_HEADS, BLOCK_SIZE * (DIM + 2), dtype=torch.int8)
    assert cpu_kv_write.try_write(k, v, pool, torch.tensor([0, 5]))
    assert pool[1, 1, :, DIM:2 * DIM].any()  # slot 5: block 1, offset 1


@pytest.mark.parametrize("codes", CODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [DIM, 64])
def test_quantized_write_gives_back_the_round_trip(codes, dtype, dim, monkeypatch):
    """write_kv(read_back=True) returns K and V as the cache gives them back (a fresh prompt
    attends to these): kv_quant.round_trip's bits, from the op and from torch alike, padding rows
    included. Without read_back (steps with no fresh prompt) nothing is made: k and v come back."""
    slots = [9, -1, 13, 20]
    k, v = projections(len(slots), dtype, dim)
    for way in ("op", "torch"):
        with writer(way, monkeypatch):
            pool = torch.zeros(2, BLOCKS, KV_HEADS, BLOCK_SIZE * (dim + 2), dtype=codes)
            k_back, v_back = write_kv(k, v, pool, meta_for(slots), read_back=True)
            assert torch.equal(k_back, kv_quant.round_trip(k, codes))
            assert torch.equal(v_back, kv_quant.round_trip(v, codes))
            pool_after_read_back = pool.clone()
            k_given, v_given = write_kv(k, v, pool, meta_for(slots))
            assert k_given is k and v_given is v  # no round trip made
            assert torch.equal(pool.view(torch.uint8), pool_after_read_back.view(torch.uint8))  # the same bits stored


def _codes_at_every_tie(codes: torch.dtype, top: float) -> torch.Tensor:
    """Every finite non-negative value of the format below `top`, the midpoint between each two
    neighbours (a tie: rounded to the even code) and the floats just either side of it."""
    values = torch.arange(0, 128, dtype=torch.uint8).view(codes).float()
    values = values[values.isfinite() & (values < top)]
    mid = (values[:-1] + values[1:]) / 2  # exact in float32
    inf = torch.full_like(mid, float("inf"))
    return torch.cat([values, mid, torch.nextafter(mid, inf), torch.nextafter(mid, -inf)])


@pytest.mark.parametrize("codes", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_op_rounds_fp8_ties_and_subnormals_as_torch(codes, dtype):
    """The op's fp8 rounding against torch's `.to(codes)`, bit for bit, at every tie of the
    format (nearest, ties to even), on both sides of each, in the subnormals and at the top; both
    signs. Each vector's largest number sets its scale to exactly 1, so x / scale is x itself;
    64-wide vectors take the AVX-512 path, 18-wide ones the scalar one. A vector holding a NaN
    gets a NaN scale and NaN codes (0x7F or 0xFF, by the sign) as in torch, whichever comes after
    the NaN in it."""
    qmax = torch.finfo(codes).max
    top = qmax / (1 + 2**-8) * 0.9999  # the scale: top x (1 + 2^-8) / qmax, which rounds to 1.0
    x = _codes_at_every_tie(codes, top)
    x = torch.cat([x, -x]).to(dtype).float().unique()  # what a bfloat16 input can hold
    for dim in (64, DIM):
        rows = torch.cat([x, x.new_zeros(-len(x) % (dim - 1))]).view(-1, dim - 1)
        k = torch.cat([rows.new_full((len(rows), 1), top), rows], 1).to(dtype)[:, None, :].contiguous()
        k[-1, 0, 1:4] = torch.tensor([float("nan"), -float("nan"), 1.0])
        blocks = -(-len(k) // BLOCK_SIZE)
        pool = torch.zeros(2, blocks, 1, BLOCK_SIZE * (dim + 2), dtype=codes)
        torch.ops.kvflow_cpu_kv.write_kv_quantized(pool[0], pool[1], k, k, torch.arange(len(k)), None, None)
        got_codes, scales = kv_quant.split(pool, BLOCK_SIZE)
        got_codes, scales = got_codes[0].reshape(-1, dim)[:len(k)], scales[0].reshape(-1)[:len(k)]
        assert bool((scales[:-1] == 1.0).all()) and scales[-1].isnan()
        want = (k[:, 0].float() / scales.float()[:, None]).to(codes)
        assert torch.equal(got_codes.view(torch.uint8), want.view(torch.uint8))
        assert bool(got_codes[-1].float().isnan().all())  # x / NaN: every code of the NaN vector
