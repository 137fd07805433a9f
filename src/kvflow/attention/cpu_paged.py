"""Few-query attention (decodes, short chunks) read in place from the paged pool, on CPU.

The torch path gathers every request's K and V out of the pool into a padded copy, then reads
the copy again with two batched matmuls: twice the memory traffic, and the gather alone was a
third of a decode-heavy run's attention time. `csrc/paged_attention_cpu.cpp` walks each
request's blocks where they lie instead (one work item per request and KV head, on torch's
thread pool; online softmax in float; keys no query may see are never read).

The extension is compiled once per machine — by `scripts/setup.sh` (`python -m
kvflow.attention.cpu_paged`), or on first use — into kvflow's cache directory, under a name
that carries the source's hash, the CPU's instruction set and the torch version; later starts
only load the shared library. Where it cannot be built (no compiler) `load_kernel()` says why
once and returns None, and the torch path runs; `KVFLOW_CPU_ATTENTION_KERNEL=0` asks for the
torch path (for A/B measurements).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path

import torch

from kvflow.attention.metadata import AttentionLayerSpec, AttentionMetadata
from kvflow.model.packaged_models import kvflow_cache_dir

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"
# Requests with at most this many queries are attended in place; longer chunks are compute-bound
# and run faster through the matmul path (the kernel works one query row at a time).
MAX_QUERIES = 16
DISABLE_ENV = "KVFLOW_CPU_ATTENTION_KERNEL"
_OP_NAMESPACE = "kvflow_cpu"


def load_kernel():
    """torch.ops.kvflow_cpu.paged_attention, built if need be; None where it cannot be (or is
    switched off by KVFLOW_CPU_ATTENTION_KERNEL=0)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    return _load_or_build()


@functools.cache  # once per process: a failed build is not retried by every engine
def _load_or_build():
    library = build_dir() / f"{_build_name()}.so"
    try:
        if not library.is_file():
            _build()
        torch.ops.load_library(str(library))
    except Exception as e:  # noqa: BLE001 - no compiler, no headers, a failed link: all mean "use torch"
        logger.warning("the CPU paged-attention kernel is unavailable (%s: %s); attention runs the torch path",
                       type(e).__name__, str(e).strip().splitlines()[-1] if str(e).strip() else "")
        return None
    return torch.ops.kvflow_cpu.paged_attention


def build_dir() -> Path:
    return kvflow_cache_dir() / "kernels" / _build_name()


def _build_name() -> str:
    """Changes with the source, the CPU's instruction set (it is built with -march=native) and torch."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(_cpu_flags().encode())
    digest.update(torch.__version__.encode())
    return f"kvflow_cpu_paged_{digest.hexdigest()[:16]}"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build() -> None:
    from torch.utils import cpp_extension  # imports setuptools: only when building

    try:  # the ninja package's binary, where the environment is not activated (not on PATH)
        import ninja

        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
    except ImportError:
        pass
    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    logger.info("building the CPU paged-attention kernel in %s (once per machine)", directory)
    cpp_extension.load(_build_name(), [str(SOURCE)], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                       extra_ldflags=["-fopenmp"], build_directory=str(directory), is_python_module=False,
                       verbose=False)


def attend_in_place(kernel, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    layer: AttentionLayerSpec, requests: torch.Tensor, out: torch.Tensor) -> None:
    """Rows of `requests` (request indices, int64) of `out` [T, H, D] from the pool in place."""
    kernel(out, q, kv_cache[0], kv_cache[1], meta.block_tables, meta.seq_lens, meta.query_start_loc, requests,
           layer.sliding_window or 0, layer.scale)


if __name__ == "__main__":  # scripts/setup.sh: build now, so that no start pays for it
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print("CPU paged-attention kernel:", "ready" if load_kernel() is not None else "unavailable (torch path)")
