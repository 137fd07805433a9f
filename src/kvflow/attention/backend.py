"""The interface every attention backend implements, and how one is chosen by name."""

from __future__ import annotations

from typing import Protocol

import torch

from kvflow.attention.metadata import AttentionLayerSpec, AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, num_kv_heads, block_size, head_dim]
        meta: AttentionMetadata,
        layer: AttentionLayerSpec,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write the new K/V into their slots, then attend each query over its request's context."""
        ...


def get_attention_backend(name: str, static_max_context_len: int | None = None,
                          batch_invariant: bool = False, sparse_decode_blocks: int | None = None) -> AttentionBackend:
    """`static_max_context_len`: fix the triton decode grid for this bound (CUDA graph replay).
    `batch_invariant`: every request through one per-row path (torch_sdpa only).
    `sparse_decode_blocks`: a decode reads only that many of its KV blocks (torch_sdpa and triton,
    attention/sparse_decode.py)."""
    from kvflow.attention.torch_reference import TorchReferenceBackend
    from kvflow.attention.torch_sdpa import TorchSDPABackend

    if sparse_decode_blocks is not None and name not in (TorchSDPABackend.name, "triton"):
        raise ValueError(f"sparse_decode_blocks needs attention backend {TorchSDPABackend.name} or triton, not {name}")
    if name == "triton":
        return _triton_backend(static_max_context_len, sparse_decode_blocks)
    backends = {b.name: b for b in (TorchReferenceBackend, TorchSDPABackend)}
    if name not in backends:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join([*backends, 'triton'])}")
    if batch_invariant and name != TorchSDPABackend.name:
        raise ValueError(f"batch_invariant needs attention backend {TorchSDPABackend.name}, not {name}")
    if name == TorchSDPABackend.name:
        return TorchSDPABackend(batch_invariant=batch_invariant, sparse_decode_blocks=sparse_decode_blocks)
    return backends[name]()


def _triton_backend(static_max_context_len: int | None, sparse_decode_blocks: int | None) -> AttentionBackend:
    # Imported only when asked for: triton is an optional (GPU) dependency.
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "attention backend 'triton' needs the triton package: pip install 'kvflow[gpu]'"
        ) from e
    from kvflow.attention.triton_backend import TritonBackend

    return TritonBackend(static_max_context_len, sparse_decode_blocks)
