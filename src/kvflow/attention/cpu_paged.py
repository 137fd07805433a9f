"""Few-query attention (decodes, short chunks) read in place from the paged pool, on CPU.

The torch path gathers every request's K and V out of the pool into a padded copy, then reads
the copy again with two batched matmuls: twice the memory traffic, and the gather alone was a
third of a decode-heavy run's attention time. `csrc/paged_attention_cpu.cpp` walks each
request's blocks where they lie instead (one work item per request and KV head, on torch's
thread pool; online softmax in float; keys no query may see are never read).

The extension is compiled once per machine (kvflow/cpu_extension.py) — by `scripts/setup.sh`
(`python -m kvflow.attention.cpu_paged`), or on first use. Where it cannot be built (no
compiler) `load_kernel()` says why once and returns None, and the torch path runs;
`KVFLOW_CPU_ATTENTION_KERNEL=0` asks for the torch path (for A/B measurements).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from kvflow import cpu_extension
from kvflow.attention import cpu_kv_write
from kvflow.attention.metadata import AttentionLayerSpec, AttentionMetadata

SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"
# Requests with at most this many queries are attended in place; longer chunks are compute-bound
# and run faster through the matmul path (the kernel works one query row at a time).
MAX_QUERIES = 16
DISABLE_ENV = "KVFLOW_CPU_ATTENTION_KERNEL"
_OP_NAMESPACE = "kvflow_cpu"


def load_kernel():
    """torch.ops.kvflow_cpu.paged_attention, built if need be; None where it cannot be (or is
    switched off by KVFLOW_CPU_ATTENTION_KERNEL=0)."""
    if (os.environ.get(DISABLE_ENV, "1") == "0"
            or not cpu_extension.load_library("kvflow_cpu_paged", SOURCE, "the CPU paged-attention kernel",
                                              extra_cflags=cpu_extension.WIDE_VECTORS)):
        return None
    return torch.ops.kvflow_cpu.paged_attention


def attend_in_place(kernel, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    layer: AttentionLayerSpec, requests: torch.Tensor, out: torch.Tensor) -> None:
    """Rows of `requests` (request indices, int64) of `out` [T, H, D] from the pool in place."""
    kernel(out, q, kv_cache[0], kv_cache[1], meta.block_tables, meta.seq_lens, meta.query_start_loc, requests,
           layer.sliding_window or 0, layer.scale)


if __name__ == "__main__":  # scripts/setup.sh: build now, so that no start pays for it
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print("CPU paged-attention kernel:", "ready" if load_kernel() is not None else "unavailable (torch path)")
    print("CPU KV-write kernel:", "ready" if cpu_kv_write.load_writer() is not None else "unavailable (torch path)")
