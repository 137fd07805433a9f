"""Build and load kvflow's C++ CPU kernels (torch operator libraries), once per machine.

A library is compiled by torch.utils.cpp_extension into kvflow's cache directory, under a name
that carries its source's hash, the CPU's instruction set (it is built with -march=native) and
the torch version; later starts only load the shared object. Where it cannot be built (no
compiler, no headers, a failed link) `load_library` says why once and returns False, and the
caller runs its torch code.

Kernels that must compute torch's numbers exactly pass -ffp-contract=off: without it GCC fuses
a*b - c*d into fused multiply-adds, which round once where torch's elementwise ops round twice.

Which kernels an engine's model runs where it has a choice (`config.KernelConfig`: the fused ops
or their torch code, which layouts quantized weights keep) is fixed when the model is built. The
model's constructors do not take it, so the worker builds the model inside `kernel_scope(config)`,
as torch puts a device in scope with `torch.device(...)` and `build_model` a tensor-parallel group;
layers and backends read `current_kernels()` when they are made and keep what they read.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
from pathlib import Path

import torch

from kvflow import settings
from kvflow.config import KernelConfig
from kvflow.scoped import Scoped

logger = logging.getLogger(__name__)

CFLAGS = ["-O3", "-march=native", "-fopenmp"]
# Headers the kernels share (`#include "kvflow_avx512.h"`, `"kvflow_amx.h"`): on every kernel's
# include path, and in every kernel's build name, so that a change to one rebuilds the kernels
# that may include it.
SHARED_HEADERS = Path(__file__).parent / "csrc"
# GCC vectorises loops 256 bits wide even where the CPU has AVX-512 (-march=native on Intel server
# parts prefers 256); a kernel whose loops are its arithmetic asks for the full width (ignored
# elsewhere).
WIDE_VECTORS = ("-mprefer-vector-width=512",)
DEFAULT_KERNELS = KernelConfig()  # frozen: every fast kernel, fast layouts
# Models built (and their weights processed) inside `kernel_scope(config)` run the kernels it
# chooses; `current_kernels()` outside any scope: the defaults, every fast kernel, fast layouts.
_IN_SCOPE = Scoped("kvflow_kernels", DEFAULT_KERNELS)
kernel_scope = _IN_SCOPE.scope
current_kernels = _IN_SCOPE.current


@functools.cache  # once per process: a failed build is not retried by every engine or layer
def load_library(prefix: str, source: Path, what: str, extra_cflags: tuple[str, ...] = ()) -> bool:
    """Load the library built from `source` (building it first if need be); False where it cannot
    be, with a warning naming `what` runs the torch path instead."""
    name = build_name(prefix, source, extra_cflags)
    library = build_dir(name) / f"{name}.so"
    try:
        if not library.is_file():
            _build(name, source, what, [*CFLAGS, *extra_cflags])
        torch.ops.load_library(str(library))
    except Exception as e:  # noqa: BLE001 - no compiler, no headers, a failed link: all mean "use torch"
        message = str(e).strip()
        logger.warning("%s is unavailable (%s: %s); the torch path runs", what, type(e).__name__,
                       message.splitlines()[-1] if message else "")
        return False
    return True


def build_dir(name: str) -> Path:
    return settings.get().cache_dir / "kernels" / name


def build_name(prefix: str, source: Path, extra_cflags: tuple[str, ...] = ()) -> str:
    """Changes with the source, the shared headers, the extra build flags, the CPU's instruction
    set and torch."""
    digest = hashlib.sha256(source.read_bytes())
    for header in sorted(SHARED_HEADERS.glob("*.h")):
        digest.update(header.read_bytes())
    for part in (" ".join(extra_cflags), _cpu_flags(), torch.__version__):
        digest.update(part.encode())
    return f"{prefix}_{digest.hexdigest()[:16]}"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build(name: str, source: Path, what: str, cflags: list[str]) -> None:
    from torch.utils import cpp_extension  # imports setuptools: only when building

    try:  # the ninja package's binary, where the environment is not activated (not on PATH)
        import ninja

        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
    except ImportError:
        pass
    directory = build_dir(name)
    directory.mkdir(parents=True, exist_ok=True)
    # torch marks a build in progress with a `lock` file that it deletes when done, and waits,
    # forever, while one exists: a build killed midway (Ctrl-C on a first start) left one behind
    # and every later start hung. Builds of this directory take an flock first (the kernel drops
    # it when its holder dies), so a `lock` found while holding it is such a leftover.
    with open(directory / "kvflow.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        if (directory / f"{name}.so").is_file():  # another process built it while this one waited
            return
        if (directory / "lock").exists():
            logger.warning("removing %s, left by a build of %s that did not finish", directory / "lock", what)
            (directory / "lock").unlink()
        logger.info("building %s in %s (once per machine)", what, directory)
        cpp_extension.load(name, [str(source)], extra_cflags=cflags, extra_ldflags=["-fopenmp"],
                           extra_include_paths=[str(SHARED_HEADERS)],
                           build_directory=str(directory), is_python_module=False, verbose=False)
