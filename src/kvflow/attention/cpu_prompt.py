"""A prompt's causal attention (`csrc/prompt_attention_cpu.cpp`) on AMX tiles where the CPU has them,
else on AVX-512 BF16 dot products: bfloat16, head_dim 64. A fresh prompt attends to its own keys; a
chunk after a cached prefix, its queries the last of the keys, to the prefix's and its own
(torch_sdpa.py gathers them).

SDPA's flash kernel ran W1's fresh prompts at ~0.13 TFLOP/s on AMX, 31% of its prefill steps. The
tile kernel takes a prompt of 290 tokens (SmolLM2's 9 heads over 3 KV heads) in 0.19 ms against
SDPA's 0.39, 512 in 0.46 against 0.80, 2,048 in 6.7 against 8.1 (2 threads, medians of 20). On a
CPU without AMX (AMD EPYC, AVX-512 BF16) SDPA ran at 20-30 GFLOP/s, 26% of W1's prefill steps; the
dot-product form there: see docs/performance-journal.md, stop 35. Either way its error against float32 is
SDPA's own in bfloat16 (tests/attention/test_cpu_prompt.py).

Built once per machine like the other kernels (kvflow/cpu_extension.py); where it cannot be built
or the CPU has no AVX-512 BF16, `load()` is None and SDPA runs. A call may ask for dot products
where there are tiles (`tiles=False`), as the tests do.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from kvflow import cpu_extension

SOURCE = Path(__file__).parent / "csrc" / "prompt_attention_cpu.cpp"
HEAD_DIM = 64


def load():
    """The kernel as `kernel(out, q, k, v, scale)` where it runs here (on tiles where it can), else None."""
    if not cpu_extension.load_library("kvflow_cpu_prompt", SOURCE, "the CPU prompt-attention kernel",
                                      extra_cflags=cpu_extension.WIDE_VECTORS):
        return None
    ops = torch.ops.kvflow_cpu_prompt
    if not ops.available():
        return None
    return functools.partial(ops.prompt_attention, tiles=ops.has_tiles())


def reads(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """The kernel can take chunks of q over keys gathered from this cache (`takes`, of the gather)."""
    return (q.device.type == "cpu" and q.dtype == kv_cache.dtype == torch.bfloat16 and q.shape[-1] == HEAD_DIM
            and q.stride(-1) == 1)


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """q [n, H, D], k and v [L, Hkv, D] (n <= L: the queries are the last n positions) as the
    kernel reads them."""
    return (q.device.type == "cpu" and q.dtype == k.dtype == v.dtype == torch.bfloat16 and q.shape[-1] == HEAD_DIM
            and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and k.stride() == v.stride() and q.shape[0] <= k.shape[0])
