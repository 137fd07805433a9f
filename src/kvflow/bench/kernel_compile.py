"""Compile one kernel launch ahead of time for a GPU this machine does not have, and read back what
the compiled kernel needs per thread and per block.

Triton compiles for a named target without a device or driver: `triton.compile(ASTSource(...),
target=GPUTarget("cuda", 90, 32))` runs its own LLVM and the `ptxas` shipped in its wheel
(`triton/backends/nvidia/bin/`). The launch's arguments are specialised exactly as a launch on a
GPU specialises them (pointer dtypes, 16-byte alignment and divisibility, strides equal to 1
folded into constants): the kernel's own argument binder does it, from meta tensors.

Two tools report the result and are cross-checked: `cuobjdump --dump-resource-usage` on the cubin
(registers, stack, static shared and local memory) and `ptxas -v`'s log (registers, stack frame,
spill stores and loads). The cubin triton produced is what runs, so cuobjdump's numbers are the
ones reported. ptxas -v is the only source of spills, and it describes that cubin only if it is
the same assembly, so it is not run from a copy of triton's command line: releases change it
(3.7 added `--regAllocOptLevel=2`, which moves registers once 3.9 assembles sm_90 with CUDA 13's
ptxas), and launches and knobs add to it (`ptx_options`, PTXAS_OPTIONS). Triton's own cubin stage
of the installed release runs it again, with its flags, knobs, options and ptxas, and the log
triton would throw away is kept; that run must give back the very bytes of the compiled cubin,
or the check fails. Triton's shared memory is dynamic, so its amount is in the compiled kernel's
metadata, not in the cubin.

This cannot run in a process where triton was imported under TRITON_INTERPRET=1: triton.jit then
makes interpreter objects of every kernel and of triton's own library functions (tl.max, tl.cdiv).
`kvflow.bench.gpu_compile` runs it in a child process in that case.
"""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvflow.bench.gpu_targets import GpuTarget, occupancy
from kvflow.kernel_launch import KernelLaunch


@dataclass(frozen=True)
class CompiledKernel:
    kernel: str
    arch: str
    num_warps: int
    num_stages: int
    constexprs: dict[str, Any]  # the launch's constexprs and the arguments triton folded into constants
    signature: str  # the specialised argument types, e.g. "*bf16:16, i32, 1"
    registers: int  # per thread
    stack_bytes: int  # per thread: spills, and local arrays (libdevice's sin keeps one on its slow path)
    spill_store_bytes: int
    spill_load_bytes: int
    local_bytes: int
    shared_bytes: int  # per block: triton's dynamic shared memory + any static
    cubin_bytes: int
    blocks_per_sm: int
    occupancy_limit: str
    cross_check: list[str]  # disagreements between the tools; empty when they agree

    def problems(self, target: GpuTarget) -> list[str]:
        """Why this kernel would not run well (or at all) on the target; empty: fine."""
        found = [f"tools disagree: {c}" for c in self.cross_check]
        if self.spill_store_bytes or self.spill_load_bytes:
            found.append(f"spills registers ({self.spill_store_bytes} B stored, "
                         f"{self.spill_load_bytes} B loaded per thread)")
        if self.shared_bytes > target.smem_per_block:
            found.append(f"needs {self.shared_bytes} B of shared memory per block; "
                         f"{target.gpu} allows {target.smem_per_block}")
        if self.blocks_per_sm < 1 and self.shared_bytes <= target.smem_per_block:
            found.append(f"no block fits on an SM ({self.occupancy_limit})")
        return found

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def compile_launch(launch: KernelLaunch, target: GpuTarget, cache: dict | None = None) -> CompiledKernel:
    """`cache`: results by specialisation, shared across calls, so launches that differ only in
    their grid or in argument values triton does not specialise on compile once."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    jit = launch.kernel
    if not isinstance(jit, JITFunction):
        raise RuntimeError(f"{launch.name} is not a compilable triton kernel "
                           "(was triton imported under TRITON_INTERPRET=1?)")
    gpu = GPUTarget("cuda", target.capability, 32)
    backend = make_backend(gpu)
    # What JITFunction.run does before it compiles, minus the device: bind, specialise, pack.
    kwargs = {**launch.constexprs, **launch.compile_options(), "debug": bool(jit.debug) or knobs.runtime.debug,
              "instrumentation_mode": knobs.compilation.instrumentation_mode}
    binder = create_function_from_signature(jit.signature, jit.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = jit._pack_args(backend, kwargs, bound, specialization, options)
    key = (id(jit), target.arch, repr(signature), repr(constexprs), repr(attrs), repr(options))
    if cache is not None and key in cache:
        return cache[key]
    source = ASTSource(jit, signature, constexprs, attrs)
    compiled = triton.compile(source, target=gpu, options=options.__dict__)

    meta = compiled.metadata
    cubin, ptx = compiled.asm["cubin"], compiled.asm["ptx"]
    dump = cuobjdump_resources(cubin, meta.name)
    verbose, reassembled = ptxas_resources(ptx, backend, source, options.__dict__, meta._asdict())
    checks = _cross_check(dump, verbose, ptx, meta) + _same_cubin(cubin, reassembled)
    shared = meta.shared + dump["SHARED"]
    occ = occupancy(target, meta.num_warps, dump["REG"], shared)
    names = list(signature)
    result = CompiledKernel(
        kernel=launch.name, arch=target.arch, num_warps=meta.num_warps, num_stages=meta.num_stages,
        constexprs={names[path[0]]: _plain(value) for path, value in constexprs.items()},
        signature=", ".join(_arg_type(signature[n], attrs.get((i,))) for i, n in enumerate(names)
                            if signature[n] != "constexpr"),
        registers=dump["REG"], stack_bytes=dump["STACK"], local_bytes=dump["LOCAL"],
        spill_store_bytes=verbose["spill_stores"], spill_load_bytes=verbose["spill_loads"],
        shared_bytes=shared, cubin_bytes=len(cubin),
        blocks_per_sm=occ.blocks_per_sm, occupancy_limit=occ.limited_by, cross_check=checks,
    )
    if cache is not None:
        cache[key] = result
    return result


def cuobjdump_resources(cubin: bytes, kernel: str) -> dict[str, int]:
    """`cuobjdump --dump-resource-usage` of one kernel: REG, STACK, SHARED, LOCAL (bytes)."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        text = _run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", str(path)])
    match = re.search(rf"Function {re.escape(kernel)}:\s*\n\s*(.*)", text)
    if match is None:
        raise RuntimeError(f"cuobjdump lists no function {kernel!r}:\n{text}")
    fields = dict(re.findall(r"(\w+(?:\[\d+\])?):(\d+)", match.group(1)))
    return {key: int(fields[key]) for key in ("REG", "STACK", "SHARED", "LOCAL")}


def ptxas_resources(ptx: str, backend, source, options: dict[str, Any],
                   metadata: dict[str, Any]) -> tuple[dict[str, int], bytes]:
    """`ptxas -v` on the kernel's PTX, run by the installed triton's own cubin stage (the command
    `triton.compile` runs, whatever flags this release adds), with the log that
    `knobs.nvidia.dump_ptxas_log` makes it print captured; returns the numbers and the cubin
    that run produced, to be compared with the compiled one."""
    from triton import knobs

    stages: dict[str, Any] = {}
    # As triton.compile builds them: the source's own options over the launch's, then the stages.
    backend.add_stages(stages, backend.parse_options(dict(options, **source.parse_options())), source.language)
    log = io.StringIO()
    with knobs.nvidia.scope(), contextlib.redirect_stdout(log):
        knobs.nvidia.dump_ptxas_log = True
        cubin = stages["cubin"](ptx, dict(metadata))
    return _parse_ptxas_log(log.getvalue()), cubin


def _parse_ptxas_log(log: str) -> dict[str, int]:
    registers = re.search(r"Used (\d+) registers", log)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if registers is None or frame is None:
        raise RuntimeError(f"unexpected ptxas -v log from triton's cubin stage (knobs.nvidia.dump_ptxas_log):\n{log}")
    return {"registers": int(registers.group(1)), "stack": int(frame.group(1)),
            "spill_stores": int(frame.group(2)), "spill_loads": int(frame.group(3))}


def _cross_check(dump: dict[str, int], verbose: dict[str, int], ptx: str, meta) -> list[str]:
    found = []
    if dump["REG"] != verbose["registers"]:
        found.append(f"registers: cuobjdump {dump['REG']}, ptxas -v {verbose['registers']}")
    if dump["STACK"] != verbose["stack"]:
        found.append(f"stack: cuobjdump {dump['STACK']} B, ptxas -v {verbose['stack']} B")
    threads = re.search(r"\.reqntid (\d+)", ptx)
    if threads is None or int(threads.group(1)) != meta.num_warps * 32:
        found.append(f"threads per block: PTX {threads and threads.group(1)}, metadata {meta.num_warps} warps")
    return found


def _same_cubin(compiled: bytes, reassembled: bytes) -> list[str]:
    """ptxas -v's numbers describe the kernel that runs only if its run made the same binary."""
    if compiled == reassembled:
        return []
    return [f"ptxas -v's run made a different cubin ({len(reassembled)} B) than the compile ({len(compiled)} B)"]


def _run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr}")
    return done.stdout + done.stderr


def _arg_type(kind: str, attrs) -> str:
    return kind + (":16" if attrs and ["tt.divisibility", 16] in attrs else "")


def _plain(value: Any) -> Any:
    return value if isinstance(value, (bool, int, float, str)) or value is None else str(value)
