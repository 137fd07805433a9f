"""Few-query attention (decodes, short chunks) read in place from the paged pool, on CPU.

The torch path gathers every request's K and V out of the pool into a padded copy, then reads
the copy again with two batched matmuls: twice the memory traffic, and the gather alone was a
third of a decode-heavy run's attention time. `csrc/paged_attention_cpu.cpp` walks each
request's blocks where they lie instead (one work item per request and KV head, on torch's
thread pool; softmax in float; keys no query may see are never read). It reads int8 and fp8
caches (kv_quant.py) in place too, at half a bf16 cache's bytes: the torch path would gather and
dequantize them into a padded copy (W1 with int8 KV ran at 97 tok/s that way, ~900 in place).

The extension is compiled once per machine (kvflow/cpu_extension.py) — by `scripts/setup.sh`
(`python -m kvflow.worker.build_kernels`), or on first use. Where it cannot be built (no
compiler) `load_kernel()` says why once and returns None, and the torch path runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from kvflow import cpu_extension
from kvflow.attention import kv_quant
from kvflow.attention.metadata import AttentionLayerSpec, AttentionMetadata

SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"
# Requests with at most this many queries are attended in place (decodes, speculative
# verifications). Longer chunks are compute-bound: the kernel's float multiply-adds grow with the
# head's width, the matmul path's gather, masks and softmax much less. Measured on W1
# (`kvflow bench throughput`, 2026-11-27, alternated): chunks after a cached prefix in place,
# SmolLM2 (head_dim 64) 604.9, 632.0 -> 638.4, 641.8 tok/s; Gemma-3-270M (256) 385.3, 371.9 ->
# 372.8, 336.7. So those go in place up to LONG_CHUNK_MAX_HEAD_DIM. Fresh prompts never do:
# SDPA's flash kernel beat the kernel there (680.2 against 660.5 tok/s, SmolLM2).
MAX_QUERIES = 16
LONG_CHUNK_MAX_HEAD_DIM = 64
# The kernel's AMX scores cost ~6 us more per call than its multiply-adds whatever the keys (one to
# four decodes of ~150 keys, SmolLM2's heads: 6-10% slower), and repay that from about this many
# (request, KV head) keys in the call on (8 decodes of ~150 keys: 4% faster; 16 of ~380: 10%).
TILES_MIN_KEYS = 4096


def takes(query_len: int, seq_len: int, head_dim: int) -> bool:
    """Whether a request that is not a fresh prompt is attended in place."""
    return query_len <= MAX_QUERIES or (query_len < seq_len and head_dim <= LONG_CHUNK_MAX_HEAD_DIM)


def load_kernel():
    """torch.ops.kvflow_cpu.paged_attention, built if need be; None where it cannot be."""
    if not cpu_extension.load_library("kvflow_cpu_paged", SOURCE, "the CPU paged-attention kernel",
                                      extra_cflags=cpu_extension.WIDE_VECTORS):
        return None
    return torch.ops.kvflow_cpu.paged_attention


def reads(kv_cache: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the kernel reads this pool for queries of `dtype`: a CPU pool of that dtype, or of
    int8/fp8 codes (kv_quant.py)."""
    return kv_cache.device.type == "cpu" and (kv_cache.dtype == dtype or kv_quant.is_quantized(kv_cache))


def attend_in_place(kernel, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    layer: AttentionLayerSpec, requests: torch.Tensor, out: torch.Tensor, tiles: bool) -> None:
    """Rows of `requests` (request indices, int64) of `out` [T, H, D] from the pool in place;
    `tiles`: as `use_tiles` decided for the step."""
    kernel(out, q, kv_cache[0], kv_cache[1], meta.block_tables, meta.seq_lens, meta.query_start_loc, requests,
           layer.sliding_window or 0, layer.scale, tiles)


def attend_sparse(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, layer: AttentionLayerSpec,
                  requests: torch.Tensor, summaries: torch.Tensor, top_k: int, sinks: bool, out: torch.Tensor,
                  tiles: bool) -> torch.Tensor:
    """Decodes of `requests`, each KV head over only the `top_k` blocks it chooses from the key
    `summaries` (sparse_decode.py), from the pool in place. Returns the choice, [len(requests),
    kv_heads, top_k] logical blocks, ascending, -1 after a request's last."""
    picked = torch.empty(len(requests), layer.num_kv_heads, top_k, dtype=torch.int64)
    torch.ops.kvflow_cpu.paged_attention_sparse(out, q, kv_cache[0], kv_cache[1], meta.block_tables, meta.seq_lens,
                                                meta.query_start_loc, requests, layer.scale, tiles, summaries, top_k,
                                                sinks, picked)
    return picked


def use_tiles(seq_lens: Iterable[int], kv_heads: int, batch_invariant: bool) -> bool:
    """Whether the kernel may take bfloat16 scores on AMX tiles (where the CPU has them) for a call
    over requests of these lengths: enough keys to repay the tiles' cost per call. Never in
    batch-invariant mode: whether a call has enough keys depends on the batch, and the tiles sum a
    score's products in another order than the multiply-adds."""
    return not batch_invariant and sum(seq_lens) * kv_heads >= TILES_MIN_KEYS
