"""`DirectoryKVStore`: one file per block in a directory that the engines of one host share.

/dev/shm by default: memory, not disk. A file is named by its key's hex digest; a save writes a
temporary file and renames it into place, so another process that sees the name sees the whole
block. Several processes use one directory with no coordination but the file system's.

The size bound (`max_bytes`) is kept with file times: a write, a lookup or a read sets a block's
modification time to now (in nanoseconds), and eviction deletes the least recently used files
first, then the batch being written from its end, as `MemoryKVStore` does. Counting the directory
costs a scan of it, so a store scans only once its own writes since the last scan could have
filled it, or every eighth of the bound it writes: with several writers the directory may briefly
exceed the bound by about an eighth of it per writer.

Opening a store creates nothing: the directory is made by the first write. An engine refused
after it opened its store (a model the connector cannot serve), or one that only ever reads,
leaves nothing on disk. A path that could never be written (a file, or under a directory this
process may not write) is refused at opening, naming shared_storage_path, without creating it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kvflow.kv_store.base import Blob, KVBlockStore, check_keys
from kvflow.kv_transfer_config import DEFAULT_MAX_STORE_BYTES

logger = logging.getLogger(__name__)
SUFFIX = ".kv"


class DirectoryKVStore(KVBlockStore):
    def __init__(self, path: str | os.PathLike, max_bytes: int = DEFAULT_MAX_STORE_BYTES,
                 on_evict: Callable[[list[tuple[bytes, bytes]]], None] | None = None,
                 setting: str = "kv_transfer_config.kv_connector_extra_config.shared_storage_path") -> None:
        """`on_evict`: given the (key, bytes) of the blocks the bound evicts (a tier of KV offloading
        demotes them to the next); None: evicted blocks are deleted unread. `setting`: the engine
        argument that named `path`, for a refusal."""
        if max_bytes <= 0:
            raise ValueError(f"max_store_bytes must be positive; got {max_bytes}")
        self.path = Path(path)
        _check_creatable(self.path, setting)
        self.location = str(self.path.resolve())
        self.max_bytes = max_bytes
        self.on_evict = on_evict
        self._bytes_at_scan = 0  # the directory's size when this store last counted it
        self._written_since_scan = 0

    def block_path(self, key: bytes) -> Path:
        return self.path / f"{key.hex()}{SUFFIX}"

    def lookup(self, keys: Sequence[bytes]) -> int:
        check_keys(keys)
        for found, key in enumerate(keys):
            if not _touch(self.block_path(key)):  # a found block becomes the most recently used
                return found
        return len(keys)

    def put(self, blocks: Sequence[tuple[bytes, Blob]]) -> int:
        """Write every block, then evict if the bound may be passed: other blocks first, least
        recently used first, then this batch's own from its end (its first blocks are a prefix,
        useful without the rest; its last are useless without the first)."""
        check_keys([key for key, _ in blocks])
        self.path.mkdir(parents=True, exist_ok=True)  # the first write makes it (or remakes one removed)
        written: list[str] = []
        for key, data in blocks:
            size = memoryview(data).nbytes
            if size > self.max_bytes:
                logger.warning("a KV block of %d bytes exceeds max_store_bytes=%d: not stored", size, self.max_bytes)
                continue
            path = self.block_path(key)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
            _touch(path)  # a nanosecond time: the batch's blocks keep their order
            self._written_since_scan += size
            written.append(str(path))
        if (self._bytes_at_scan + self._written_since_scan > self.max_bytes
                or self._written_since_scan > self.max_bytes // 8):
            return len(written) - self.evict_to(self.max_bytes, written)
        return len(written)

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        check_keys(keys)
        blocks: list[bytes | None] = []
        for key in keys:
            path = self.block_path(key)
            try:
                blocks.append(path.read_bytes())
            except FileNotFoundError:  # evicted or deleted since the lookup
                blocks.append(None)
                continue
            _touch(path)
        return blocks

    def delete(self, keys: Sequence[bytes]) -> None:
        check_keys(keys)
        for key in keys:
            self.block_path(key).unlink(missing_ok=True)

    def evict_to(self, max_bytes: int, batch: Sequence[str] = ()) -> int:
        """Delete blocks until the directory holds at most `max_bytes`: the least recently used
        first, then those of `batch` (paths just written) from its end. Returns how many of
        `batch` were deleted."""
        files = []
        for entry in _entries(self.path):
            if entry.name.endswith(SUFFIX):
                try:
                    stat = entry.stat()
                except FileNotFoundError:  # another engine deleted it mid-scan
                    continue
                files.append((stat.st_mtime_ns, stat.st_size, entry.path))
        total = sum(size for _, size, _ in files)
        mine = set(batch)
        order = sorted(f for f in files if f[2] not in mine) + sorted((f for f in files if f[2] in mine), reverse=True)
        evicted_mine, evicted = 0, []
        for _, size, path in order:
            if total <= max_bytes:
                break
            if self.on_evict is not None:
                evicted.extend(_read_for_demotion(Path(path)))
            Path(path).unlink(missing_ok=True)
            total -= size
            evicted_mine += path in mine
        self._bytes_at_scan, self._written_since_scan = total, 0
        if evicted:
            self.on_evict(evicted)
        return evicted_mine


def _read_for_demotion(path: Path) -> list[tuple[bytes, bytes]]:
    """[(key, bytes)] of a block file about to be evicted; [] if another process took it first."""
    try:
        return [(bytes.fromhex(path.name[:-len(SUFFIX)]), path.read_bytes())]
    except (FileNotFoundError, ValueError):
        return []


def _entries(directory: Path) -> list[os.DirEntry]:
    """The directory's entries; none before the first write has made it."""
    try:
        with os.scandir(directory) as entries:
            return list(entries)
    except FileNotFoundError:
        return []


def _check_creatable(path: Path, setting: str) -> None:
    """Refuse, creating nothing, a path no write could ever make a directory of: an existing
    non-directory, or one whose nearest existing ancestor is not a directory this process may
    write into."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    name = f"{setting} {str(path)!r}"
    if not existing.is_dir():
        raise ValueError(f"{name} is not a directory ({existing} is a file)")
    if existing != path and not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{name} cannot be created: {existing} is not writable by this process")


def _touch(path: Path) -> bool:
    """Mark a block just used (its modification time is its place in the LRU order); False if it is gone."""
    try:
        now = time.time_ns()
        os.utime(path, ns=(now, now))  # finer than the kernel's own file times (a few ms)
    except FileNotFoundError:
        return False
    return True
