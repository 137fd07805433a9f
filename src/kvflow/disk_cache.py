"""Keys for what kvflow caches on disk: a file's content hash, and a fingerprint of the code that
derived the cached value from it (so a code change never reads a stale entry); and which of a
family of cached versions to delete."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import mmap
from collections.abc import Callable, Iterable
from pathlib import Path

_HASH_CHUNK = 8 << 20


def file_digest(path: Path) -> str:
    """SHA-256 of the file's bytes (hex)."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def code_fingerprint(*modules) -> str:
    """A short hash of the source files of `modules`: what a cached result was computed by."""
    digest = hashlib.sha256()
    for module in modules:
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()[:12]


def beyond_newest(paths: Iterable[Path], keep: int, stamp: Callable[[Path], Path] = lambda p: p) -> list[Path]:
    """`paths` but the `keep` most recently modified, by the modification time of `stamp(path)`
    (one gone meanwhile, or not written yet, counts as the oldest): what a cache deletes of its
    older versions."""
    def modified(path: Path) -> float:
        try:
            return stamp(path).stat().st_mtime
        except OSError:
            return 0.0

    return sorted(paths, key=modified, reverse=True)[keep:]


def drop_mapped_pages(address: int, nbytes: int) -> None:
    """Give back the pages of a memory-mapped cache file that lie wholly in [address, address +
    nbytes): what was read only to derive another form from. They leave the process's resident
    set and are read from the file again if touched (madvise MADV_DONTNEED on a read-only private
    file mapping loses nothing). Best effort: nothing happens where madvise is missing."""
    start = -(-address // mmap.PAGESIZE) * mmap.PAGESIZE
    stop = (address + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if stop <= start or not hasattr(mmap, "MADV_DONTNEED"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(stop - start), mmap.MADV_DONTNEED)
