"""The CPU paged-attention kernel (attention/cpu_paged.py) against the torch reference, on pools
whose every slot that no request wrote holds NaN: a fresh block's tail, padding entries of the
block tables (block 0, never handed out here) and blocks a sliding window released. Masked keys
must not be read (0 × NaN is NaN), by the kernel or by the torch paths around it."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

from kvflow.attention import cpu_paged, kv_quant
from kvflow.attention.metadata import AttentionLayerSpec, AttentionMetadata
from kvflow.attention.torch_reference import TorchReferenceBackend
from kvflow.attention.torch_sdpa import TorchSDPABackend

DIM = 32


def nan_pool_batch(seed: int, block_size: int, heads: int, kv_heads: int, dtype, window: int | None,
                   max_new: int = 20, dim: int = DIM, cases: list[tuple[int, int]] | None = None):
    """A mixed batch (decodes, few-query and longer chunks after a cached prefix, fresh prompts)
    over shuffled blocks of a NaN pool: only the cached positions of each context hold numbers.
    With a window, the blocks that no query of a request can see are released (table entry 0).
    `cases`: (cached, new) per request instead of random ones."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    if cases is None:
        cases = [(rng.randint(1, 90), 1) for _ in range(rng.randint(1, 6))] + \
                [(rng.randint(1, 50), rng.randint(2, max_new)), (0, rng.randint(2, 30)), (rng.randint(1, 40), 24)]
        rng.shuffle(cases)
    total_blocks = 1 + sum(-(-(c + n) // block_size) for c, n in cases)
    physical = list(range(1, total_blocks))  # block 0: padding only, never written
    rng.shuffle(physical)
    cache = torch.full((2, total_blocks, kv_heads, block_size, dim), float("nan"), dtype=dtype)
    tables, slots = [], []
    for cached, new in cases:
        table = [physical.pop() for _ in range(-(-(cached + new) // block_size))]
        for p in range(cached):  # the context written by earlier steps
            cache[:, table[p // block_size], :, p % block_size] = torch.randn(2, kv_heads, dim, generator=gen).to(dtype)
        if window is not None:  # released: no query of this step sees any key of the block
            first_seen = max(0, cached - window + 1)
            table = [0 if (b + 1) * block_size <= first_seen else t for b, t in enumerate(table)]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(cached, cached + new)]
    width = max(len(t) for t in tables) + 2  # trailing padding columns
    query_lens = [n for _, n in cases]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0] + query_lens).cumsum(0), seq_lens=torch.tensor([c + n for c, n in cases]),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        slot_mapping=torch.tensor(slots), block_size=block_size,
        query_lens_cpu=query_lens, seq_lens_cpu=[c + n for c, n in cases],
    )
    tokens = sum(query_lens)
    q, k, v = (torch.randn(tokens, h, dim, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))
    return q, k, v, cache, meta, AttentionLayerSpec(heads, kv_heads, dim, dim**-0.5, window)


@pytest.fixture(scope="module")
def kernel():
    op = cpu_paged.load_kernel()
    assert op is not None, "the kernel did not build here (a C++ compiler is needed: scripts/setup.sh builds it)"
    return op


def _kernel_attention(kernel, q, k, v, cache, meta, layer, tiles: bool | None = None):
    """Every request through the kernel (after the new K/V are written, as the backend does);
    `tiles`: the AMX scores where the CPU has them, or not (None: as the backend would decide)."""
    from kvflow.attention.metadata import write_kv

    write_kv(k, v, cache, meta)
    out = torch.full_like(q, float("nan"))
    if tiles is None:
        tiles = cpu_paged.use_tiles(meta.seq_lens_cpu, layer.num_kv_heads, batch_invariant=False)
    cpu_paged.attend_in_place(kernel, q, cache, meta, layer, torch.arange(meta.num_requests), out, tiles)
    return out


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (3, 1)])
@pytest.mark.parametrize("window", [None, 7])
def test_kernel_matches_reference_fp32(kernel, seed, block_size, heads, kv_heads, window):
    q, k, v, cache, meta, layer = nan_pool_batch(seed, block_size, heads, kv_heads, torch.float32, window)
    expected = TorchReferenceBackend().forward(q, k, v, cache.clone(), meta, layer)
    got = _kernel_attention(kernel, q, k, v, cache, meta, layer)
    assert not expected.isnan().any()
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("block_size, dim", [(16, 32), (32, 64), (16, 128)])  # the bf16 paths: 16-key scores, pairs
@pytest.mark.parametrize("tiles", [True, False])  # scores of up to 16 rows on AMX tiles (where the CPU has them), or not
def test_kernel_matches_reference_bf16(kernel, seed, window, block_size, dim, tiles):
    q, k, v, cache, meta, layer = nan_pool_batch(seed, block_size, 8, 2, torch.bfloat16, window, dim=dim)
    expected = TorchReferenceBackend().forward(q.float(), k.float(), v.float(), cache.float(), meta, layer)
    got = _kernel_attention(kernel, q, k, v, cache, meta, layer, tiles).float()
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)  # the output is rounded to bf16 once


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("tiles", [True, False])
def test_few_query_chunk_rows_see_only_their_keys(kernel, window, block_size, tiles):
    """Chunks of 2-4 queries x G = 4 heads (up to 16 rows: the tile path where the CPU has AMX)
    whose queries' causal and window bounds fall in different sixteens of keys: each row's
    probabilities must stop at its own bounds, not the chunk's."""
    cases = [(30, 4), (13, 4), (46, 3), (62, 2), (31, 1)]
    q, k, v, cache, meta, layer = nan_pool_batch(0, block_size, 8, 2, torch.bfloat16, window, dim=64, cases=cases)
    expected = TorchReferenceBackend().forward(q.float(), k.float(), v.float(), cache.float(), meta, layer)
    got = _kernel_attention(kernel, q, k, v, cache, meta, layer, tiles).float()
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_tiles_are_asked_for_where_they_repay(kernel, batch_invariant, monkeypatch):
    """The backend asks the kernel for AMX scores for a step whose in-place requests hold at least
    TILES_MIN_KEYS (request, KV head) keys, never in batch-invariant mode (whether a step has
    enough keys depends on the batch)."""
    asked = []
    backend = TorchSDPABackend(batch_invariant=batch_invariant)
    backend.kernel = lambda *args: asked.append(args[-1])
    cases, kv_heads = [(30, 1), (50, 1)], 2  # decodes: in place either way
    keys = sum(cached + new for cached, new in cases) * kv_heads
    for min_keys, expected in ((keys, True), (keys + 1, False)):
        monkeypatch.setattr(cpu_paged, "TILES_MIN_KEYS", min_keys)
        q, k, v, cache, meta, layer = nan_pool_batch(0, 16, 4, kv_heads, torch.bfloat16, None, cases=cases)
        backend.forward(q, k, v, cache, meta, layer)
        assert asked.pop() is (expected and not batch_invariant)


def quantized_nan_pool(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """nan_pool_batch's pool as a quantized one (kv_quant.py): the written positions' codes and
    scales; every other byte 0xFF, which is NaN as a bfloat16 scale (and as an E4M3 or E5M2 code)."""
    _, blocks, kv_heads, block_size, dim = cache.shape
    packed = torch.full((2, blocks, kv_heads, block_size * (dim + 2)), 255, dtype=torch.uint8).view(dtype)
    written = ~cache[0, :, 0, :, 0].isnan()  # [blocks, block_size]
    where = written.nonzero()
    kv_quant.write(cache[0][where[:, 0], :, where[:, 1]], cache[1][where[:, 0], :, where[:, 1]], packed,
                   where[:, 0], where[:, 1], block_size)
    return packed


# fp8 codes below the format's smallest normal (exponent bits zero, mantissa bits not), and a
# magnitude, relative to a vector's largest number, whose codes fall there.
SUBNORMALS = {torch.float8_e4m3fn: (0x78, 0x07, 3e-5), torch.float8_e5m2: (0x7C, 0x03, 1e-9)}


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("codes", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size, dim, window", [(16, 64, None), (32, 128, 5), (16, 32, None), (1, 64, 7)])
def test_kernel_reads_a_quantized_pool_in_place(kernel, seed, codes, query_dtype, block_size, dim, window):
    """Codes and scales read where they lie (with AVX-512 at head_dim 64 and 128 on whole
    sixteens of keys; other widths and block sizes widened to float first) give the oracle's
    attention over the same codes: code x scale is exact in float32, so only the order of the sums
    differs (and, for bfloat16 queries, the output's one rounding)."""
    q, k, v, cache, meta, layer = nan_pool_batch(seed, block_size, 8, 2, torch.float32, window, dim=dim)
    # Dimensions of every size in each vector: codes near zero (fp8 subnormals) are read too.
    tiny = SUBNORMALS.get(codes, (0, 0, 3e-5))[2]
    magnitude = torch.tensor([1.0, tiny, 1e-4, 1e-2]).repeat(dim // 4)
    cache, k, v = cache * magnitude, k * magnitude, v * magnitude
    packed = quantized_nan_pool(cache, codes)
    if codes in SUBNORMALS:
        exponent, mantissa, _ = SUBNORMALS[codes]
        bits = kv_quant.split(packed, block_size)[0].view(torch.uint8)
        assert bool(((bits & exponent == 0) & (bits & mantissa != 0)).any())  # subnormal codes are in the pool
    expected = TorchReferenceBackend().forward(q, k, v, packed.clone(), meta, layer)
    assert not expected.isnan().any()
    got = _kernel_attention(kernel, q.to(query_dtype), k, v, packed, meta, layer)
    tolerance = dict(atol=2e-5, rtol=1e-5) if query_dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), expected, **tolerance)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("dim", [32, 128])
def test_backend_dispatch_matches_reference_on_nan_pool(kernel, seed, window, dim):
    """The torch_sdpa backend with the kernel: the requests `cpu_paged.takes` in place (few-query
    ones; narrow heads' chunks after a cached prefix), the rest on the torch paths (wide heads'
    24-query chunk, fresh prompts), none of them touched by the NaN in unwritten slots."""
    q, k, v, cache, meta, layer = nan_pool_batch(seed, 16, 6, 2, torch.float32, window, dim=dim)
    expected = TorchReferenceBackend().forward(q, k, v, cache.clone(), meta, layer)
    backend = TorchSDPABackend()
    assert backend.kernel is not None
    got = backend.forward(q, k, v, cache, meta, layer)
    plan = next(p for key, p in meta.plans.items() if key[0] == "torch_sdpa")
    in_place = set(plan.in_place.tolist())
    lens = list(zip(meta.query_lens_cpu, meta.seq_lens_cpu))
    assert in_place == {i for i, (n, s) in enumerate(lens) if not (n == s and window is None)
                        and cpu_paged.takes(n, s, dim)}
    long_chunk = next(i for i, (n, s) in enumerate(lens) if n == 24)  # after a cached prefix
    assert (long_chunk in in_place) == (dim <= cpu_paged.LONG_CHUNK_MAX_HEAD_DIM)
    if window is None:
        assert len(in_place) < meta.num_requests  # the fresh prompt: SDPA
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(2))
def test_torch_path_is_nan_safe(seed):
    q, k, v, cache, meta, layer = nan_pool_batch(seed, 16, 6, 2, torch.float32, 7)
    expected = TorchReferenceBackend().forward(q, k, v, cache.clone(), meta, layer)
    backend = TorchSDPABackend()
    backend.kernel = None  # as where it cannot be built: the gather + matmul path
    torch.testing.assert_close(backend.forward(q, k, v, cache, meta, layer), expected, atol=2e-5, rtol=1e-5)


def test_bad_block_table_entry_is_an_error_not_a_wild_read(kernel):
    q, k, v, cache, meta, layer = nan_pool_batch(0, 16, 4, 4, torch.float32, None)
    meta.block_tables[0, 0] = cache.shape[1] + 5
    with pytest.raises(RuntimeError, match="block table entry"):
        _kernel_attention(kernel, q, k, v, cache, meta, layer)


def test_no_compiler_falls_back_to_the_torch_path(tmp_path):
    """A machine where the kernel was never built and no compiler runs: a warning, then torch."""
    script = (
        "import torch\n"
        "from kvflow.attention.torch_sdpa import TorchSDPABackend\n"
        "backend = TorchSDPABackend()\n"
        "print('kernel', backend.kernel)\n"
    )
    env = dict(os.environ, KVFLOW_CACHE_DIR=str(tmp_path), CXX=str(tmp_path / "no-such-compiler"),
               PATH=str(tmp_path), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "kernel None" in result.stdout
    assert "paged-attention kernel is unavailable" in result.stderr
