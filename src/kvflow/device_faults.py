"""Which exceptions mean the device itself is unusable.

A CUDA error other than running out of memory (a device-side assert, an illegal address) leaves
the context poisoned: every later kernel launch fails too, so retrying steps only fails every
request one by one. So does losing a tensor-parallel rank (`WorkerDiedError`). Out-of-memory is
different: the allocation failed, nothing was corrupted.
"""

from __future__ import annotations

import torch


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank is gone: no step can run again, as after a device fault."""


def is_device_fault(error: BaseException) -> bool:
    if isinstance(error, WorkerDiedError):
        return True
    if isinstance(error, torch.OutOfMemoryError):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)  # torch >= 2.8 raises it for CUDA errors
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    return isinstance(error, RuntimeError) and "CUDA error" in str(error)
