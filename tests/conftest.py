"""Lets tests import the shared helper modules in this directory (e.g. `hf_oracle`), and runs
the Triton kernels (attention's and the model layers') on CPU when there is no GPU.

TRITON_INTERPRET must be set before triton decorates the kernels (at import), so it is set here,
before any test module imports them. On a CUDA machine the kernels compile for real and nothing
below is patched. The model layers take their kernels only for CUDA tensors, so tests that run a
model on CPU never enter the interpreter.

Two defects of triton's interpreter (not of the kernels) are worked around, each only when a
probe shows it is present:
- a data-dependent loop bound is turned into an int with int() of a shape-(1,) array, which
  numpy >= 2.4 refuses (triton-lang/triton#9171, fixed after 3.6);
- tl.dot multiplies bfloat16 operands as their raw uint16 bits (numpy has no bfloat16). Tensor
  cores multiply bf16 exactly into an fp32 accumulator, so widening the operands to fp32 first
  (exact: a bf16 is the top half of an fp32) gives the GPU's result;
- a float32 → bfloat16 cast (and a store of float32 into bfloat16) truncates the mantissa, where
  the GPU and torch round to nearest even: the cast is redone with the usual bit trick.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def use_cache_dir(monkeypatch):
    """`use_cache_dir(path)` points kvflow's cache directory (KVFLOW_CACHE_DIR: kvflow/settings.py,
    read once per process) at `path` for one test. Its `kernels/` is the machine's (a link, where
    `path` is a directory to be): the C++ kernels are built once per machine, not once per test
    (40 s of the suite)."""
    from kvflow import settings  # here: importing kvflow imports triton's kernels, after TRITON_INTERPRET

    def use(path) -> None:
        user, path = settings.get(), Path(path)
        if not path.exists() and (user.cache_dir / "kernels").is_dir():
            path.mkdir(parents=True)
            (path / "kernels").symlink_to(user.cache_dir / "kernels", target_is_directory=True)
        monkeypatch.setattr(settings, "get", lambda: dataclasses.replace(user, cache_dir=path))

    return use


def _loop_bounds_work(triton, tl) -> bool:
    @triton.jit
    def count(n_ptr, out_ptr):
        total = 0
        for _ in range(0, tl.load(n_ptr)):
            total += 1
        tl.store(out_ptr, total)

    out = torch.zeros(1, dtype=torch.int32)
    try:
        count[(1,)](torch.tensor([3], dtype=torch.int32), out)
    except Exception:  # noqa: BLE001 - the interpreter wraps numpy's TypeError in its own error
        return False
    return int(out) == 3


def _bf16_dot_works(triton, tl) -> bool:
    @triton.jit
    def square(x_ptr, out_ptr):
        r = tl.arange(0, 16)
        x = tl.load(x_ptr + r[:, None] * 16 + r[None, :])
        tl.store(out_ptr + r[:, None] * 16 + r[None, :], tl.dot(x, x))

    x = torch.full((16, 16), 0.5, dtype=torch.bfloat16)
    out = torch.zeros(16, 16)
    square[(1,)](x, out)
    return bool(torch.all(out == 4.0))


def _bf16_cast_rounds(triton, tl) -> bool:
    @triton.jit
    def cast(x_ptr, out_ptr):
        tl.store(out_ptr, tl.load(x_ptr).to(tl.bfloat16))

    out = torch.zeros(1, dtype=torch.bfloat16)
    cast[(1,)](torch.tensor([1 + 3 * 2**-9]), out)  # 3/4 of a bf16 ulp above 1: rounds up
    return out.item() == 1 + 2**-7


def _fix_loop_bounds(interpreter) -> None:
    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def _fix_bf16_dot(interpreter, tl) -> None:
    builder = interpreter.InterpreterBuilder
    create_dot = builder.create_dot

    def widen(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        return interpreter.TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def patched(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = patched


def _fix_bf16_cast(interpreter, tl) -> None:
    builder = interpreter.InterpreterBuilder
    cast_impl = builder.cast_impl

    def patched(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return cast_impl(self, src, dst_type)
        bits = src.data.view(np.uint32)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # ties to even
        return interpreter.TensorHandle(np.where(np.isnan(src.data), np.uint16(0x7FC0), rounded), tl.bfloat16)

    builder.cast_impl = patched


def _fix_interpreter() -> None:
    try:
        import triton
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    if not _loop_bounds_work(triton, tl):
        _fix_loop_bounds(interpreter)
    if not _bf16_dot_works(triton, tl):
        _fix_bf16_dot(interpreter, tl)
    if not _bf16_cast_rounds(triton, tl):
        _fix_bf16_cast(interpreter, tl)


if os.environ.get("TRITON_INTERPRET") == "1":
    _fix_interpreter()
