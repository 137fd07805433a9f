"""The KV write on CPU as one C++ op (`csrc/kv_write_cpu.cpp`): each new token's K and V rows
copied straight into their block, instead of torch's index_put through a transposed view (about
a millisecond per layer on a W1 step: 7% of its CPU time).

A copy changes no bit, so the op serves every backend, the torch reference included. For a
quantized cache (kv_quant.py) `write_kv_quantized` makes, in the same pass, the codes and scales
kv_quant.write makes, bit for bit, and code x scale for the new rows (in torch: ~25 small ops a
layer, and a 4,096-token prompt's round trip ~105 ms a step). Built once per machine
(kvflow/cpu_extension.py); `load_writer()` is None where it cannot be built, and write_kv keeps
torch's index_put.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvflow import cpu_extension
from kvflow.attention import kv_quant

SOURCE = Path(__file__).parent / "csrc" / "kv_write_cpu.cpp"


def load_writer():
    """torch.ops.kvflow_cpu_kv.write_kv(key_cache, value_cache, key, value, slot_mapping), built
    if need be; None where it cannot be."""
    if not cpu_extension.load_library("kvflow_cpu_kv_write", SOURCE, "the CPU KV-write kernel"):
        return None
    return torch.ops.kvflow_cpu_kv.write_kv


def try_write(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
              read_back: bool = False):
    """Write with the op where it takes these tensors (CPU, head_dim contiguous, a contiguous
    pool: of k's dtype, or quantized); None: the caller writes with torch. Else k and v, as the
    cache gives them back where `read_back` (a quantized cache: code x scale, from the same pass)."""
    quantized = kv_quant.is_quantized(kv_cache)
    if (kv_cache.device.type != "cpu" or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous()
            or k.dtype != v.dtype or (not quantized and k.dtype != kv_cache.dtype)
            or kv_cache.dim() != (4 if quantized else 5) or not kv_cache.is_contiguous()
            or k.stride(-1) != 1 or v.stride(-1) != 1):
        return None
    writer = load_writer()
    if writer is None:
        return None
    if not quantized:
        writer(kv_cache[0], kv_cache[1], k, v, slot_mapping)
        return k, v
    back = (torch.empty(k.shape, dtype=k.dtype), torch.empty(v.shape, dtype=v.dtype)) if read_back else (None, None)
    torch.ops.kvflow_cpu_kv.write_kv_quantized(kv_cache[0], kv_cache[1], k, v, slot_mapping, *back)
    return back if read_back else (k, v)
