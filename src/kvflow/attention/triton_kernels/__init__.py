"""Triton kernels for paged attention: KV store, paged prefill, split-K decode.

They run on CUDA. The test suite runs them on CPU tensors in Triton's interpreter
(TRITON_INTERPRET=1, set before import, with the interpreter fixes in tests/conftest.py); that is
for checking kernels, never for serving.
"""

from kvflow.attention.triton_kernels.decode_split_k import decode_split_k, decode_split_k_launches, num_splits_for
from kvflow.attention.triton_kernels.kv_store import kv_store_launch, store_kv
from kvflow.attention.triton_kernels.paged_prefill import (
    make_tiles,
    paged_prefill,
    paged_prefill_launch,
    query_tile_size,
)

__all__ = [
    "decode_split_k", "decode_split_k_launches", "kv_store_launch", "make_tiles", "num_splits_for",
    "paged_prefill", "paged_prefill_launch", "query_tile_size", "store_kv",
]
