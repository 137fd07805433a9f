"""The processed form of a GGUF checkpoint's weights, kept on disk so a restart does not repack.

Turning SmolLM2's Q4_1 blocks into int4 planes for aten's kernel (`gguf.GGUFMethod`) decodes and
repacks every weight: several seconds at every start for a result that depends only on the file,
the model dtype, the code that packs and the CPU kernel's layout. So the first load stores each
layer's parts (packed planes with their scales, or a dense tensor) in one file beside the
checkpoint's parse cache (`kvflow.model.loader.gguf_cache`), named by all of those, and later
loads memory-map it. A layer is looked up by its prefix (`model.layers.3.mlp.gate_up_proj`).

Each change of the packing code names a new file (~470 MB for SmolLM2's bf16 form), so a save
deletes the older codes' files for the same dtype, torch and layout beyond the newest `KEEP`: they
had grown to 37 GB over two days of development here. The weight layouts a load keeps
(`--cpu-weight-layouts`) name their own file: a compact load stores no dense copy.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from kvflow.disk_cache import beyond_newest, code_fingerprint
from kvflow.quant import gguf_blocks, int4_gemv, int4pack

KEEP = 2  # files per dtype, torch and layout: this code's and the newest other (two versions in turn)


def _read_ahead(path: Path) -> None:
    """Ask the kernel to read the whole file into the page cache now, in the background: a cold
    start otherwise faults the mapped file in page by page as the layers are built and first run
    (a hint; nothing happens where the OS has no posix_fadvise)."""
    with contextlib.suppress(OSError, AttributeError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)


class PackedWeightsCache:
    """Per layer prefix, a list of parts' states (dicts of tensors and ints) for the file that
    `checkpoint_dir` caches, packed to `dtype` by `packing_modules`, with the layouts
    `weight_layouts` keeps (`KernelConfig.weight_layouts`: a compact load stores no dense copy)."""

    def __init__(self, checkpoint_dir: Path, dtype: torch.dtype, packing_modules: tuple,
                 weight_layouts: str = "fast") -> None:
        layout = "avx512" if int4pack._layout_known() else "other"
        code = code_fingerprint(*packing_modules, gguf_blocks, int4pack, int4_gemv)
        dtype_name = str(dtype).removeprefix("torch.")
        # The files of one dtype, torch and layout, whatever their code and weight layouts: `_prune`'s.
        self.family = f"packed-{dtype_name}-torch{torch.__version__}-{layout}-"
        self.path = checkpoint_dir / f"{self.family}{weight_layouts}-{code}.pt"
        self.stored: dict | None = None
        if self.path.is_file():
            _read_ahead(self.path)
            try:
                self.stored = torch.load(self.path, mmap=True, weights_only=True)
            except (OSError, RuntimeError):  # truncated or foreign: repack and overwrite
                self.stored = None
        self.new: dict[str, list[dict]] = {}

    def get(self, prefix: str) -> list[dict] | None:
        """The states `put` stored for this layer (tensors map the file), or None."""
        return None if self.stored is None else self.stored.get(prefix)

    def put(self, prefix: str, states: list[dict]) -> None:
        if self.stored is None:
            self.new[prefix] = states

    def save(self) -> None:
        """Write what `put` collected, once (best effort: a read-only cache only costs the next start)."""
        if not self.new:
            return
        partial = self.path.with_name(f"{self.path.name}.{os.getpid()}.partial")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(self.new, partial)
            partial.replace(self.path)
        except OSError:
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
        self.new = {}
        self._prune()

    def _prune(self) -> None:
        """Delete the older codes' files beside this one beyond the newest KEEP (a process still
        mapping one keeps its pages: unlinking does not unmap)."""
        others = (p for p in self.path.parent.glob(f"{self.family}*.pt") if p != self.path)
        for old in beyond_newest(others, KEEP - 1):
            with contextlib.suppress(OSError):
                old.unlink()
