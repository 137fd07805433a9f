"""The KV write on CPU as one C++ op (`csrc/kv_write_cpu.cpp`): each new token's K and V rows
copied straight into their block, instead of torch's index_put through a transposed view (about
a millisecond per layer on a W1 step: 7% of its CPU time).

A copy changes no bit, so the op serves every backend, the torch reference included. Built once
per machine (kvflow/cpu_extension.py); `load_writer()` is None where it cannot be built or with
KVFLOW_CPU_KV_WRITE=0 (for A/B), and write_kv keeps torch's index_put.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kvflow import cpu_extension

SOURCE = Path(__file__).parent / "csrc" / "kv_write_cpu.cpp"
DISABLE_ENV = "KVFLOW_CPU_KV_WRITE"


def load_writer():
    """torch.ops.kvflow_cpu_kv.write_kv(key_cache, value_cache, key, value, slot_mapping), built
    if need be; None where it cannot be, or with KVFLOW_CPU_KV_WRITE=0 (read at every call)."""
    if (os.environ.get(DISABLE_ENV, "1") == "0"
            or not cpu_extension.load_library("kvflow_cpu_kv_write", SOURCE, "the CPU KV-write kernel")):
        return None
    return torch.ops.kvflow_cpu_kv.write_kv


def try_write(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """Write with the op where it takes these tensors (CPU, one dtype, head_dim contiguous, an
    unquantized contiguous pool); False: the caller writes with torch."""
    if (kv_cache.device.type != "cpu" or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous()
            or k.dtype != kv_cache.dtype or v.dtype != kv_cache.dtype
            or kv_cache.dim() != 5 or not kv_cache.is_contiguous() or k.stride(-1) != 1 or v.stride(-1) != 1):
        return False
    writer = load_writer()
    if writer is None:
        return False
    writer(kv_cache[0], kv_cache[1], k, v, slot_mapping)
    return True

