"""A kernel registry for the gpu-compile check's own honesty: the reduction of `broken_kernels`
assembled twice, as triton assembles it by default and with a ptxas option added through triton's
`ptx_options` (the option triton's PTXAS_OPTIONS knob also fills): `--opt-level=0`, which moves
its registers on every ptxas triton 3.6-3.9 ships.

Triton assembles with a command line of its own, which changes between releases (3.7 added
`--regAllocOptLevel=2`) and with options a launch or a knob adds; `ptxas -v` describes the kernel
that runs only when it is run with that exact command. A check that assembled the PTX its own
way would report the default variant's registers for both.

Loaded by name in the compiling process (`CompileRequest(registry="ptxas_option_kernels")`).
"""

from __future__ import annotations

import torch
from broken_kernels import BLOCK, _register_hog_kernel

from kvflow.bench.engine_shapes import EngineShapes, Step
from kvflow.bench.gpu_kernels import KernelCase, KernelEntry
from kvflow.kernel_launch import KernelLaunch

PTXAS_OPTION = "--opt-level=0"


def hog_cases(s: EngineShapes, step: Step) -> list[KernelCase]:
    if step.name != "prefill":
        return []
    args = (s.empty(BLOCK, dtype=torch.float32), s.empty(BLOCK, dtype=torch.float32))
    return [KernelCase(step.name, role, KernelLaunch(_register_hog_kernel, (1,), args, dict(BLOCK=BLOCK), num_warps=1,
                                                     num_stages=1, options=options), 0, 0)
            for role, options in (("default", {}), (PTXAS_OPTION, dict(ptx_options=PTXAS_OPTION)))]


REGISTRY = (KernelEntry("register hog, with and without a ptxas option", hog_cases),)
