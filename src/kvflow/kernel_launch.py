"""One Triton kernel launch, fully decided before it runs.

A kernel's wrapper turns its tensors into a `KernelLaunch` (grid, arguments, constexprs, warps,
stages) and calls it. `kvflow bench gpu-compile` asks the same wrapper code for the same object,
with meta tensors of a model's shapes, and compiles it ahead of time for a GPU it does not have:
so the configuration that is compiled and checked is, by construction, the one that would run.

This module imports nothing heavy (not even triton): the kernel rooms (attention, model layers,
quantization) all use it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class KernelLaunch:
    kernel: Any  # a @triton.jit function (triton's interpreter wraps it under TRITON_INTERPRET=1)
    grid: tuple[int, ...]
    args: tuple  # the runtime arguments, in the kernel's order: tensors, ints, floats
    constexprs: Mapping[str, Any]
    num_warps: int = 4
    num_stages: int = 3
    # Compiler options beyond warps and stages (e.g. enable_fp_fusion=False).
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.kernel.__name__

    def compile_options(self) -> dict[str, Any]:
        """The keyword options that select a compiled variant, as triton's launch takes them."""
        return {"num_warps": self.num_warps, "num_stages": self.num_stages, **self.options}

    def __call__(self) -> None:
        self.kernel[self.grid](*self.args, **self.constexprs, **self.compile_options())
