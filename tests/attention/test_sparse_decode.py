"""Query-aware sparse decode (attention/sparse_decode.py): the CPU kernel's walk over picked blocks
against the dense walk (K >= the blocks: bit for bit) and against the torch oracle (K smaller: the
same blocks, float tolerance), on pools whose unwritten slots hold NaN; the key summaries through
every way a block fills; bad settings refused by name."""

from __future__ import annotations

import random

import pytest
import torch

from kvflow.attention import cpu_paged, kv_quant, sparse_decode
from kvflow.attention.backend import get_attention_backend
from kvflow.attention.metadata import AttentionLayerSpec, AttentionMetadata, write_kv
from kvflow.attention.torch_reference import TorchReferenceBackend
from kvflow.attention.torch_sdpa import TorchSDPABackend


@pytest.fixture(scope="module", autouse=True)
def kernel():
    op = cpu_paged.load_kernel()
    assert op is not None, "the kernel did not build here (a C++ compiler is needed: scripts/setup.sh builds it)"
    return op


def decode_batch(seed: int, seq_lens: list[int], block_size: int, heads: int, kv_heads: int, dim: int, dtype,
                 window: int | None = None):
    """Decodes (context seq_len - 1 cached, one new token each) over shuffled blocks of a NaN pool;
    block 0 is padding only. Keys get a per-block offset, so blocks differ in how well they match
    a query (as real keys do) and a choice of blocks matters."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    n_blocks = [-(-n // block_size) for n in seq_lens]
    physical = list(range(1, 1 + sum(n_blocks)))
    rng.shuffle(physical)
    cache = torch.full((2, 1 + sum(n_blocks), kv_heads, block_size, dim), float("nan"), dtype=dtype)
    tables, slots = [], []
    for seq_len, n in zip(seq_lens, n_blocks):
        table = [physical.pop() for _ in range(n)]
        for b, block in enumerate(table):
            written = min(block_size, seq_len - 1 - b * block_size)
            if written > 0:
                offset = 2 * torch.randn(1, kv_heads, 1, dim, generator=gen)
                cache[:, block, :, :written] = (torch.randn(2, kv_heads, written, dim, generator=gen) + offset).to(dtype)
        tables.append(table)
        slots.append(table[(seq_len - 1) // block_size] * block_size + (seq_len - 1) % block_size)
    width = max(n_blocks) + 2
    meta = AttentionMetadata(
        query_start_loc=torch.arange(len(seq_lens) + 1), seq_lens=torch.tensor(seq_lens),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        slot_mapping=torch.tensor(slots), block_size=block_size,
        query_lens_cpu=[1] * len(seq_lens), seq_lens_cpu=list(seq_lens))
    q, k, v = (torch.randn(len(seq_lens), h, dim, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))
    return q, k, v, cache, meta, AttentionLayerSpec(heads, kv_heads, dim, dim**-0.5, window)


def written_summaries(cache: torch.Tensor, meta: AttentionMetadata, layer: AttentionLayerSpec) -> torch.Tensor:
    """The summaries of every full block of the batch, as the writes leave them."""
    summaries = sparse_decode.KeySummaries()
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        full = meta.block_tables[i, :seq_len // meta.block_size]
        if full.numel():
            summaries.refresh(cache, full, meta.block_size, layer)
    return summaries.of(cache, layer)


def sparse_kernel(q, cache, meta, layer, summaries, top_k, sinks=True, tiles=False):
    """Every request through the sparse kernel: its output and the blocks it chose."""
    out = torch.full_like(q, float("nan"))
    picked = cpu_paged.attend_sparse(q, cache, meta, layer, torch.arange(meta.num_requests), summaries, top_k, sinks,
                                     out, tiles)
    return out, picked


def dense_kernel(kernel, q, cache, meta, layer, tiles=False):
    out = torch.full_like(q, float("nan"))
    cpu_paged.attend_in_place(kernel, q, cache, meta, layer, torch.arange(meta.num_requests), out, tiles)
    return out


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dtype, block_size, dim", [(torch.float32, 16, 32), (torch.bfloat16, 16, 64),
                                                    (torch.bfloat16, 32, 128), (torch.float32, 1, 32)])
@pytest.mark.parametrize("tiles", [False, True])
def test_picking_every_block_is_the_dense_kernel_bit_for_bit(kernel, seed, dtype, block_size, dim, tiles):
    """K >= a request's blocks: the sparse walk is the dense walk over the same blocks in the same
    order, so the same sums in the same order: equal bits, not just close."""
    q, k, v, cache, meta, layer = decode_batch(seed, [5, 40, 97, 130], block_size, 6, 2, dim, dtype)
    write_kv(k, v, cache, meta)
    summaries = written_summaries(cache, meta, layer)
    widest = max(-(-n // block_size) for n in meta.seq_lens_cpu)
    got, picked = sparse_kernel(q, cache, meta, layer, summaries, widest, tiles=tiles)
    assert torch.equal(got, dense_kernel(kernel, q, cache, meta, layer, tiles))
    assert torch.equal(picked, sparse_decode.pick_blocks(q, summaries, meta, list(range(4)), layer, top_k=widest))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dtype, block_size, dim", [(torch.float32, 16, 32), (torch.bfloat16, 16, 64),
                                                    (torch.bfloat16, 32, 128), (torch.float32, 4, 32)])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (9, 3)])
@pytest.mark.parametrize("top_k, sinks", [(2, True), (3, False), (5, True)])
def test_sparse_kernel_matches_the_oracle(seed, dtype, block_size, dim, heads, kv_heads, top_k, sinks):
    """K smaller than the blocks: the kernel, the batched torch pick (triton's) and the oracle choose
    the same blocks per KV head, and the kernel's output over them is the oracle's (softmax over
    the chosen keys only)."""
    q, k, v, cache, meta, layer = decode_batch(seed, [3 * block_size + 1, 7 * block_size, 150, 9 * block_size - 3],
                                               block_size, heads, kv_heads, dim, dtype)
    write_kv(k, v, cache, meta)
    summaries = written_summaries(cache, meta, layer)
    got, picked = sparse_kernel(q, cache, meta, layer, summaries, top_k, sinks)
    assert torch.equal(picked, sparse_decode.pick_blocks(q, summaries, meta, list(range(4)), layer, top_k, sinks))
    tolerance = {"atol": 2e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    for i in range(meta.num_requests):
        expected, chosen = sparse_decode.reference_decode(q, cache, summaries, meta, layer, i, top_k, sinks)
        n_blocks = -(-meta.seq_lens_cpu[i] // block_size)
        for kv_head in range(kv_heads):
            assert picked[i, kv_head][picked[i, kv_head] >= 0].tolist() == chosen[kv_head]
            assert len(chosen[kv_head]) == min(top_k, n_blocks)
            assert chosen[kv_head][-1] == n_blocks - 1 and (not sinks or chosen[kv_head][0] == 0)
        torch.testing.assert_close(got[i].float(), expected.to(dtype).float(), **tolerance)


def test_fewer_blocks_differ_from_dense_and_read_no_other_block(kernel):
    """A sparse result is not the dense one (the picked blocks are all it read): NaN written into
    every block it did not pick leaves it unchanged."""
    q, k, v, cache, meta, layer = decode_batch(1, [200], 16, 4, 2, 64, torch.bfloat16)
    write_kv(k, v, cache, meta)
    summaries = written_summaries(cache, meta, layer)
    got, picked = sparse_kernel(q, cache, meta, layer, summaries, 3)
    assert not torch.equal(got, dense_kernel(kernel, q, cache, meta, layer))
    for kv_head in range(2):
        unread = set(range(13)) - set(picked[0, kv_head].tolist())
        cache[:, meta.block_tables[0, sorted(unread)], kv_head] = float("nan")
    assert torch.equal(sparse_kernel(q, cache, meta, layer, summaries, 3)[0], got)
    assert not got.isnan().any()


def test_quantized_pool_sparse_matches_the_oracle():
    """An int8 pool: summaries of code x scale; the kernel reads the picked blocks' codes in place."""
    q, k, v, cache, meta, layer = decode_batch(0, [100, 70], 16, 8, 2, 64, torch.float32)
    write_kv(k, v, cache, meta)
    packed = torch.zeros((2, cache.shape[1], 2, 16 * 66), dtype=torch.int8)
    blocks, offsets = torch.meshgrid(torch.arange(cache.shape[1]), torch.arange(16), indexing="ij")
    finite = torch.nan_to_num(cache)
    kv_quant.write(finite[0][blocks.flatten(), :, offsets.flatten()], finite[1][blocks.flatten(), :, offsets.flatten()],
                   packed, blocks.flatten(), offsets.flatten(), 16)
    summaries = written_summaries(packed, meta, layer)
    got, picked = sparse_kernel(q, packed, meta, layer, summaries, 3)
    for i in range(2):
        expected, chosen = sparse_decode.reference_decode(q, packed, summaries, meta, layer, i, 3)
        assert [picked[i, h][picked[i, h] >= 0].tolist() for h in range(2)] == chosen
        torch.testing.assert_close(got[i], expected, atol=1e-4, rtol=1e-4)


def test_summaries_are_made_when_a_block_fills_whatever_filled_its_start():
    """Through the backend: a block whose start came from a copy (copy-on-write) and whose last
    slot a decode writes is summarized from all it holds, not from its previous tenant's keys nor
    from the new rows alone; a block refreshed after a swap-in gets its new keys' summary."""
    block_size, layer = 4, AttentionLayerSpec(2, 1, 8, 8**-0.5, None)
    backend = TorchSDPABackend(sparse_decode_blocks=2)
    cache = torch.randn(2, 6, 1, block_size, 8)  # every block holds an earlier tenant's keys
    cache[:, 3, :, :3] = cache[:, 1, :, :3] * 5  # a copy-on-write copy of 3 positions into block 3
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, 1]), seq_lens=torch.tensor([8]), block_tables=torch.tensor([[2, 3]]),
        slot_mapping=torch.tensor([3 * block_size + 3]), block_size=block_size, query_lens_cpu=[1], seq_lens_cpu=[8])
    q, k, v = torch.randn(1, 2, 8), torch.randn(1, 1, 8), torch.randn(1, 1, 8)
    backend.forward(q, k, v, cache, meta, layer)
    summaries = backend.key_summaries.of(cache, layer)
    torch.testing.assert_close(summaries[3], sparse_decode.summarize(cache, torch.tensor([3]), block_size)[0])
    assert summaries[3, 0, 1].ge(cache[0, 3, 0, :3].amax(0)).all()  # the copied keys count
    assert summaries[[0, 1, 2, 4, 5]].eq(0).all()  # no other block filled
    cache[:, 4] = torch.randn(2, 1, block_size, 8)  # a swap-in into block 4
    backend.key_summaries.refresh_everywhere(torch.tensor([4]), block_size)  # the worker's hook
    torch.testing.assert_close(summaries[4], sparse_decode.summarize(cache, torch.tensor([4]), block_size)[0])


@pytest.mark.parametrize("window", [None, 20])
def test_backend_reads_long_decodes_sparsely_and_the_rest_densely(window):
    """A step of decodes, short (at most K blocks) and long, and a fresh prompt whose write fills
    blocks: short decodes and the prompt are the dense backend's; long decodes are the oracle's over
    summaries the prompt's and earlier writes made; a windowed layer is dense throughout."""
    q, k, v, cache, meta, layer = decode_batch(4, [20, 90, 133], 16, 6, 2, 64, torch.bfloat16, window)
    sparse = TorchSDPABackend(sparse_decode_blocks=3)
    for i, seq_len in enumerate(meta.seq_lens_cpu):  # earlier steps' writes filled these blocks
        full = meta.block_tables[i, :seq_len // 16]
        if full.numel():
            sparse.key_summaries.refresh(cache, full, 16, layer)
    dense_out = TorchSDPABackend().forward(q, k, v, cache.clone(), meta, layer)
    got = sparse.forward(q, k, v, cache, meta, layer)
    assert torch.equal(got[0], dense_out[0])  # 2 blocks: all of them
    if window is not None:
        assert torch.equal(got, dense_out)
        return
    summaries = sparse.key_summaries.of(cache, layer)
    for i in (1, 2):
        expected, _ = sparse_decode.reference_decode(q, cache, summaries, meta, layer, i, 3)
        torch.testing.assert_close(got[i].float(), expected.to(torch.bfloat16).float(), atol=1e-2, rtol=1e-2)
        assert not torch.equal(got[i], dense_out[i])


@pytest.mark.parametrize("bad", [0, 1, -3, 2.5, "4", True])
def test_bad_sparse_decode_blocks_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="sparse_decode_blocks"):
        TorchSDPABackend(sparse_decode_blocks=bad)


@pytest.mark.parametrize("name", ["torch_reference"])
def test_sparse_decode_needs_the_sdpa_backend(name):
    with pytest.raises(ValueError, match="sparse_decode_blocks needs attention backend torch_sdpa or triton"):
        get_attention_backend(name, sparse_decode_blocks=4)


def test_bad_kernel_arguments_are_errors_not_wild_reads():
    q, k, v, cache, meta, layer = decode_batch(0, [70, 50], 16, 4, 2, 32, torch.float32)
    write_kv(k, v, cache, meta)
    summaries = written_summaries(cache, meta, layer)
    with pytest.raises(RuntimeError, match="summaries are contiguous float"):
        sparse_kernel(q, cache, meta, layer, summaries[:, :1], 2)
    with pytest.raises(RuntimeError, match="top_k"):
        sparse_kernel(q, cache, meta, layer, summaries, 1)
    with pytest.raises(RuntimeError, match="picked is contiguous int64"):
        torch.ops.kvflow_cpu.paged_attention_sparse(
            torch.empty_like(q), q, cache[0], cache[1], meta.block_tables, meta.seq_lens, meta.query_start_loc,
            torch.arange(2), layer.scale, False, summaries, 3, True, torch.empty(2, 2, 2, dtype=torch.int64))
    wild = meta.block_tables.clone()
    wild[0, 1] = 10_000  # a block the bounds would read
    bad = AttentionMetadata(query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens, block_tables=wild,
                            slot_mapping=meta.slot_mapping, block_size=16, query_lens_cpu=[1, 1], seq_lens_cpu=[70, 50])
    with pytest.raises(RuntimeError, match="is not a block of the cache"):
        sparse_kernel(q, cache, bad, layer, summaries, 2)
    chunk = AttentionMetadata(query_start_loc=torch.tensor([0, 2]), seq_lens=torch.tensor([70]),
                              block_tables=meta.block_tables[:1], slot_mapping=torch.tensor([0, 1]), block_size=16,
                              query_lens_cpu=[2], seq_lens_cpu=[70])
    with pytest.raises(RuntimeError, match="is not a decode"):
        sparse_kernel(q[:2], cache, chunk, layer, summaries, 2)


def test_sparse_backend_agrees_with_the_reference_backend_on_prompts():
    """Prompt chunks stay dense: a fresh prompt's output is the dense backend's."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(40, 4, 32, generator=gen), torch.randn(40, 2, 32, generator=gen), torch.randn(40, 2, 32, generator=gen)
    meta = AttentionMetadata(query_start_loc=torch.tensor([0, 40]), seq_lens=torch.tensor([40]),
                             block_tables=torch.tensor([[1, 2, 3]]), slot_mapping=torch.arange(16, 56), block_size=16,
                             query_lens_cpu=[40], seq_lens_cpu=[40])
    layer = AttentionLayerSpec(4, 2, 32, 32**-0.5, None)
    expected = TorchReferenceBackend().forward(q, k, v, torch.zeros(2, 4, 2, 16, 32), meta, layer)
    cache = torch.zeros(2, 4, 2, 16, 32)
    backend = TorchSDPABackend(sparse_decode_blocks=2)
    torch.testing.assert_close(backend.forward(q, k, v, cache, meta, layer), expected, atol=1e-5, rtol=1e-5)
    summaries = backend.key_summaries.of(cache, layer)  # the prompt filled blocks 1 and 2
    torch.testing.assert_close(summaries[1:3], sparse_decode.summarize(cache, torch.tensor([1, 2]), 16))
    assert summaries[[0, 3]].eq(0).all()


# -- triton's split-K decode over a table of the picked blocks (the interpreter without a GPU) ---------
def triton_decode(q, cache, meta, layer, requests, tables, seq_lens, num_splits):
    from kvflow.attention.triton_kernels import decode_split_k

    out = torch.full_like(q, float("nan"))
    decode_split_k(q, cache, out, requests.int(), meta.query_start_loc, seq_lens, tables, layer.scale, None,
                   num_splits=num_splits)
    return out


@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_picking_every_block_is_its_dense_decode_bit_for_bit(num_splits):
    pytest.importorskip("triton")
    q, k, v, cache, meta, layer = decode_batch(2, [20, 75, 130], 16, 4, 2, 32, torch.float32)
    write_kv(k, v, cache, meta)
    requests = torch.arange(3)
    picked = sparse_decode.pick_blocks(q, written_summaries(cache, meta, layer), meta, requests, layer, top_k=9)
    tables, seq_lens = sparse_decode.compact_tables(meta, requests, picked)
    assert torch.equal(seq_lens, meta.seq_lens)
    got = triton_decode(q, cache, meta, layer, requests, tables, seq_lens, num_splits)
    dense = triton_decode(q, cache, meta, layer, requests, meta.block_tables, meta.seq_lens, num_splits)
    assert torch.equal(got, dense)


@pytest.mark.parametrize("top_k, sinks", [(2, True), (4, False)])
def test_triton_sparse_decode_matches_the_oracle(top_k, sinks):
    pytest.importorskip("triton")
    q, k, v, cache, meta, layer = decode_batch(3, [100, 61, 130], 16, 6, 2, 32, torch.float32)
    write_kv(k, v, cache, meta)
    summaries = written_summaries(cache, meta, layer)
    requests = torch.tensor([0, 2])  # request 1 is not read
    picked = sparse_decode.pick_blocks(q, summaries, meta, requests, layer, top_k, sinks)
    tables, seq_lens = sparse_decode.compact_tables(meta, requests, picked)
    got = triton_decode(q, cache, meta, layer, requests, tables, seq_lens, num_splits=2)
    for row, i in enumerate(requests.tolist()):
        expected, chosen = sparse_decode.reference_decode(q, cache, summaries, meta, layer, i, top_k, sinks)
        assert [picked[row, h][picked[row, h] >= 0].tolist() for h in range(2)] == chosen
        torch.testing.assert_close(got[i], expected, atol=5e-5, rtol=1e-5)
    assert got[1].isnan().all()


def test_triton_backend_reads_long_decodes_sparsely():
    pytest.importorskip("triton")
    from kvflow.attention.triton_backend import TritonBackend

    q, k, v, cache, meta, layer = decode_batch(4, [20, 90, 133], 16, 4, 2, 32, torch.float32)
    backend = TritonBackend(sparse_decode_blocks=3)
    for i, seq_len in enumerate(meta.seq_lens_cpu):  # earlier steps' writes filled these blocks
        backend.key_summaries.refresh(cache, meta.block_tables[i, :seq_len // 16], 16, layer)
    dense = TorchReferenceBackend().forward(q, k, v, cache.clone(), meta, layer)
    got = backend.forward(q, k, v, cache, meta, layer)
    torch.testing.assert_close(got[0], dense[0], atol=5e-5, rtol=1e-5)  # 2 blocks: all of them
    summaries = backend.key_summaries.of(cache, layer)
    for i in (1, 2):
        expected, _ = sparse_decode.reference_decode(q, cache, summaries, meta, layer, i, 3)
        torch.testing.assert_close(got[i], expected, atol=5e-5, rtol=1e-5)


def test_triton_sparse_decode_is_refused_under_cuda_graphs():
    pytest.importorskip("triton")
    from kvflow.attention.triton_backend import TritonBackend

    with pytest.raises(ValueError, match="sparse_decode_blocks is not captured in CUDA graphs"):
        TritonBackend(max_context_len=4096, sparse_decode_blocks=4)
