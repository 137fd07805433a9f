"""A kernel registry of deliberate failures, each beside a healthy twin, for the gpu-compile check:

- a matmul whose K loop is pipelined 4 stages deep over 128 x 128 x 128 bf16 tiles needs 256 KiB
  of shared memory, more than one block may have on an H100 (227 KiB) or an A100 (163 KiB);
  2 stages fit;
- a reduction over 1024 values per thread capped at 32 registers (`maxnreg`) spills; uncapped
  it does not.

Loaded by name in the compiling process (`CompileRequest(registry="broken_kernels")`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.bench.engine_shapes import EngineShapes, Step
from kvflow.bench.gpu_kernels import KernelCase, KernelEntry
from kvflow.kernel_launch import KernelLaunch

TILE, DEPTH = 128, 1024
BLOCK = 1024


@triton.jit
def _staged_matmul_kernel(a_ptr, b_ptr, c_ptr, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    m, n, kk = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + m[:, None] * K + (k + kk)[None, :])
        b = tl.load(b_ptr + (k + kk)[:, None] * BLOCK_N + n[None, :])
        acc += tl.dot(a, b)
    tl.store(c_ptr + m[:, None] * BLOCK_N + n[None, :], acc)


@triton.jit
def _register_hog_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + r)
    y, z = tl.exp(x), tl.sin(x)
    tl.store(out_ptr + r, x * tl.sum(y) + z * tl.sum(y * z) + y * tl.sum(x))


def matmul_cases(s: EngineShapes, step: Step) -> list[KernelCase]:
    if step.name != "prefill":
        return []
    args = (s.empty(TILE, DEPTH), s.empty(DEPTH, TILE), s.empty(TILE, TILE, dtype=torch.float32), DEPTH)
    tiles = dict(BLOCK_M=TILE, BLOCK_N=TILE, BLOCK_K=TILE)
    return [KernelCase(step.name, f"{stages} stages", KernelLaunch(_staged_matmul_kernel, (1,), args, tiles,
                                                                   num_warps=8, num_stages=stages), 0, 0)
            for stages in (4, 2)]


def hog_cases(s: EngineShapes, step: Step) -> list[KernelCase]:
    if step.name != "prefill":
        return []
    args = (s.empty(BLOCK, dtype=torch.float32), s.empty(BLOCK, dtype=torch.float32))
    return [KernelCase(step.name, f"maxnreg {cap}", KernelLaunch(_register_hog_kernel, (1,), args, dict(BLOCK=BLOCK),
                                                                 num_warps=1, num_stages=1, options=options), 0, 0)
            for cap, options in ((32, dict(maxnreg=32)), (None, {}))]


REGISTRY = (KernelEntry("staged matmul", matmul_cases), KernelEntry("register hog", hog_cases))
