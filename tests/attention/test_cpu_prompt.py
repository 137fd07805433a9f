"""The prompt-attention kernel (attention/cpu_prompt.py), on AMX tiles where the CPU has them and on
AVX-512 BF16 dot products, against float32 attention of the same bfloat16 inputs: its error is
within SDPA's own error in bfloat16 (plus a rounding)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from test_cpu_paged import nan_pool_batch

from kvflow.attention import cpu_prompt
from kvflow.attention.torch_reference import TorchReferenceBackend
from kvflow.attention.torch_sdpa import TorchSDPABackend

kernel = cpu_prompt.load()
pytestmark = pytest.mark.skipif(kernel is None, reason="no AVX-512 BF16 (or no C++ compiler) here")
# Each way the kernel multiplies here: dot products, and tiles where there is AMX.
WAYS = [False, True] if kernel is not None and torch.ops.kvflow_cpu_prompt.has_tiles() else [False]


def _way(tiles: bool):
    return functools.partial(torch.ops.kvflow_cpu_prompt.prompt_attention, tiles=tiles)


def _qkv(length: int, heads: int, kv_heads: int, seed: int = 0):
    """Views of one projection output, as the model hands them over (rows wider than a head)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(length, (heads + 2 * kv_heads) * 64, generator=gen).bfloat16()
    q = qkv[:, :heads * 64].view(length, heads, 64)
    k = qkv[:, heads * 64:(heads + kv_heads) * 64].view(length, kv_heads, 64)
    v = qkv[:, (heads + kv_heads) * 64:].view(length, kv_heads, 64)
    return q, k, v


def _sdpa(q, k, v):
    """Causal attention of q, the last n of k's L positions (query i sees keys [0, L - n + i]), as
    SDPA computes it in q's dtype."""
    n, length = q.shape[0], k.shape[0]
    mask = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                         scale=0.125, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(0, 1)


def _assert_as_close_as_sdpa_in_bfloat16(out, q, k, v):
    """out's error against float32 attention is within SDPA's own in bfloat16 (plus a rounding)."""
    exact = _sdpa(q.float(), k.float(), v.float())
    sdpa_error = (_sdpa(q, k, v).float() - exact).abs().max().item()
    error = (out.float() - exact).abs().max().item()
    assert error <= max(2 * sdpa_error, 2**-8), (error, sdpa_error)


@pytest.mark.parametrize("tiles", WAYS)
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("length", [1, 7, 16, 17, 33, 100, 290])
def test_matches_float32_attention_as_closely_as_sdpa_in_bfloat16(heads, kv_heads, length, tiles):
    q, k, v = _qkv(length, heads, kv_heads, seed=length)
    out = torch.full((length, heads, 64), float("nan"), dtype=torch.bfloat16)
    _way(tiles)(out, q, k, v, 0.125)
    _assert_as_close_as_sdpa_in_bfloat16(out, q, k, v)


@pytest.mark.parametrize("tiles", WAYS)
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 1)])
@pytest.mark.parametrize("length,n", [(40, 8), (100, 37), (290, 33), (64, 64), (33, 1), (300, 270)])
def test_a_chunk_after_a_prefix_sees_the_prefix_and_its_own_earlier_keys(heads, kv_heads, length, n, tiles):
    """The queries are the last n of the keys' positions: query i sees keys [0, length - n + i]."""
    q, k, v = _qkv(length, heads, kv_heads, seed=length + n)
    q = q[length - n:]
    out = torch.full((n, heads, 64), float("nan"), dtype=torch.bfloat16)
    _way(tiles)(out, q, k, v, 0.125)
    _assert_as_close_as_sdpa_in_bfloat16(out, q, k, v)


@pytest.mark.parametrize("tiles", WAYS)
def test_causal_rows_see_no_later_key(tiles):
    """Changing the last key and value moves only the last query's output."""
    q, k, v = _qkv(40, 9, 3)
    before = torch.empty(40, 9, 64, dtype=torch.bfloat16)
    _way(tiles)(before, q, k, v, 0.125)
    k2, v2 = k.clone(), v.clone()
    k2[-1], v2[-1] = 7.0, -7.0
    after = torch.empty(40, 9, 64, dtype=torch.bfloat16)
    _way(tiles)(after, q, k2, v2, 0.125)
    assert torch.equal(before[:-1], after[:-1]) and not torch.equal(before[-1], after[-1])


@pytest.mark.skipif(len(WAYS) < 2, reason="no AMX here: one way only")
def test_tiles_and_dot_products_differ_by_at_most_a_rounding():
    """The same products, summed in another order: each output within a bfloat16 rounding or two."""
    q, k, v = _qkv(290, 9, 3, seed=5)
    tiles, dots = (torch.empty(290, 9, 64, dtype=torch.bfloat16) for _ in range(2))
    _way(True)(tiles, q, k, v, 0.125)
    _way(False)(dots, q, k, v, 0.125)
    torch.testing.assert_close(tiles.float(), dots.float(), atol=2**-7, rtol=2**-7)


def test_tiles_are_asked_for_only_where_there_are_tiles():
    """The loaded kernel multiplies on tiles exactly where there is AMX; asked for tiles where there
    are none, it refuses by name."""
    assert kernel.keywords["tiles"] == (len(WAYS) == 2)
    if len(WAYS) == 1:
        q, k, v = _qkv(8, 9, 3)
        with pytest.raises(RuntimeError, match="no AMX here"):
            _way(True)(torch.empty(8, 9, 64, dtype=torch.bfloat16), q, k, v, 0.125)


def test_what_it_refuses():
    q, k, v = _qkv(8, 9, 3)
    assert cpu_prompt.takes(q, k, v)
    assert not cpu_prompt.takes(q.float(), k.float(), v.float())
    assert not cpu_prompt.takes(q, k.contiguous(), v)  # k and v laid out differently
    assert cpu_prompt.takes(q[2:], k, v) and not cpu_prompt.takes(torch.cat([q, q]), k, v)  # n <= L queries
    with pytest.raises(RuntimeError, match="last n of k's"):  # and the kernel itself refuses more queries than keys
        kernel(torch.empty(16, 9, 64, dtype=torch.bfloat16), torch.cat([q, q]), k, v, 0.125)


@pytest.mark.parametrize("seed", range(3))
def test_the_backend_writes_its_fresh_prompts_through_the_kernel(seed):
    """torch_sdpa in bfloat16 with 64-wide heads: each fresh prompt's rows of the step's output are
    the kernel's (written where they lie), the rest of the batch as before; all within bf16 of the
    float32 reference, and near the SDPA path's output."""
    q, k, v, cache, meta, layer = nan_pool_batch(seed, 16, 9, 3, torch.bfloat16, None, dim=64)
    starts = meta.query_start_loc.tolist()
    fresh = [slice(starts[i], starts[i + 1]) for i, (n, s) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu))
             if n == s]
    assert fresh  # the batch has a fresh prompt
    calls = []
    backend = TorchSDPABackend()
    original = backend.prompt_kernel
    backend.prompt_kernel = lambda out, *args: calls.append(out.shape[0]) or original(out, *args)
    got = backend.forward(q, k, v, cache.clone(), meta, layer).float()
    assert calls == [r.stop - r.start for r in fresh]
    expected = TorchReferenceBackend().forward(q.float(), k.float(), v.float(), cache.float(), meta, layer)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
    meta.plans.clear()
    without = TorchSDPABackend()
    without.prompt_kernel = None  # as where it cannot be built: SDPA
    sdpa = without.forward(q, k, v, cache.clone(), meta, layer).float()
    for rows in fresh:
        assert (got[rows] - sdpa[rows]).abs().max() <= 2**-6 * sdpa[rows].abs().max()


@pytest.mark.parametrize("seed", range(3))
def test_the_backend_sends_long_chunks_after_a_prefix_through_the_kernel(seed, monkeypatch):
    """Chunks of PREFIXED_MIN_QUERIES queries or more after a cached prefix: the kernel, over the
    keys gathered from the blocks (the prefix's, then the chunk's own, written this step); fewer
    stay with the paged kernel. All within bf16 of the float32 reference, and near the paged path."""
    from kvflow.attention import torch_sdpa

    cases = [(40, 1), (17, torch_sdpa.PREFIXED_MIN_QUERIES), (0, 30), (70, 45), (5, torch_sdpa.PREFIXED_MIN_QUERIES - 1)]
    q, k, v, cache, meta, layer = nan_pool_batch(seed, 16, 9, 3, torch.bfloat16, None, dim=64, cases=cases)
    calls = []
    backend = TorchSDPABackend()
    original = backend.prompt_kernel
    backend.prompt_kernel = lambda out, q_, k_, v_, scale: calls.append((q_.shape[0], k_.shape[0])) or original(
        out, q_, k_, v_, scale)
    got = backend.forward(q, k, v, cache.clone(), meta, layer).float()
    fresh = [(new, new) for cached, new in cases if cached == 0]
    long_chunks = [(new, cached + new) for cached, new in cases if cached > 0 and new >= torch_sdpa.PREFIXED_MIN_QUERIES]
    assert len(long_chunks) == 2 and calls == fresh + long_chunks  # every key of a chunk's request, the prefix's too
    expected = TorchReferenceBackend().forward(q.float(), k.float(), v.float(), cache.float(), meta, layer)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
    monkeypatch.setattr(torch_sdpa, "PREFIXED_MIN_QUERIES", 10**6)  # the paged kernel takes them all
    meta.plans.clear()
    paged = TorchSDPABackend().forward(q, k, v, cache.clone(), meta, layer).float()
    starts = meta.query_start_loc.tolist()
    for i in (1, 3):
        rows = slice(starts[i], starts[i + 1])
        assert (got[rows] - paged[rows]).abs().max() <= 2**-6 * paged[rows].abs().max()
