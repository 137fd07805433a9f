"""Triton kernels for paged attention: KV store, paged prefill, split-K decode.

Set TRITON_INTERPRET=1 before importing this package to run them on CPU tensors.
"""

from kvflow.attention.triton_kernels.decode_split_k import decode_split_k, decode_split_k_launches, num_splits_for
from kvflow.attention.triton_kernels.kv_store import kv_store_launch, store_kv
from kvflow.attention.triton_kernels.paged_prefill import (
    make_tiles, paged_prefill, paged_prefill_launch, query_tile_size,
)

__all__ = [
    "decode_split_k", "decode_split_k_launches", "kv_store_launch", "make_tiles", "num_splits_for",
    "paged_prefill", "paged_prefill_launch", "query_tile_size", "store_kv",
]
