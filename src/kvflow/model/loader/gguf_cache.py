"""What parsing a GGUF yields, kept on disk keyed by the file's SHA-256, so a restart skips the parse.

gguf-py's reader decodes every metadata field when it opens a file — for SmolLM2 that is 49,152
token strings and 48,900 merges, seconds of Python — and the tokenizer is then rebuilt from them.
Neither changes while the file does not, so the first load writes, under
`$KVFLOW_CACHE_DIR/gguf/<sha256>/`:

- `index.json`: the HF-style config and, per tensor, its type, shape and byte range in the file;
- `tokenizer/`: the rebuilt tokenizer in HF's files (`Tokenizer.save` / `from_hf_dir`);

and later loads memory-map the tensors straight from the file. The directory name also carries a
fingerprint of the code that produced its contents (this package's parsing modules), so a change
to that code never reads a stale entry. Entries are written under a temporary name and renamed
when whole: concurrent starts never see half an entry. Derived forms of the weights (the int4
planes of `kvflow.quant.gguf`) live beside them, in `entry_dir()`. A new entry deletes the same
file's entries of older code beyond the newest KEEP_ENTRIES, with everything derived in them:
each change of the parsing code had left one behind, SmolLM2's with ~1 GB of packed weights
(4.9 GB here after a day of development).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from kvflow import settings
from kvflow.disk_cache import beyond_newest, file_digest
from kvflow.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class IndexedTensor:
    """The parts of a `gguf.ReaderTensor` the loader reads, rebuilt from the index."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: np.ndarray  # GGUF order: innermost dimension first
    data: np.ndarray  # a read-only view of the file's bytes, as the reader would give it


@dataclass(frozen=True)
class GGUFIndex:
    hf_config: dict
    arch: str  # general.architecture
    tensors: list  # IndexedTensor or gguf.ReaderTensor
    tokenizer: Tokenizer | None
    cache_dir: Path  # this file's entry: derived forms of its weights may be cached there too


def file_digest_remembered(path: Path) -> str:
    """`disk_cache.file_digest(path)`, remembered in `$KVFLOW_CACHE_DIR/gguf/digests.json` by the
    file's identity (device, inode, size, modification time in ns): hashing SmolLM2's 98 MB at
    every start read the whole file from disk on a cold start, ~0.2 s of a ~4.5 s start. A file
    written again has a new modification time, so it is hashed again."""
    stat = path.stat()
    identity = [stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns]
    memo_path, key = settings.get().cache_dir / "gguf" / "digests.json", str(path.resolve())
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    if not isinstance(memo, dict):
        memo = {}
    known = memo.get(key)
    if isinstance(known, dict) and known.get("identity") == identity and isinstance(known.get("sha256"), str):
        return known["sha256"]
    digest = file_digest(path)
    memo[key] = {"identity": identity, "sha256": digest}
    partial = memo_path.with_name(f"{memo_path.name}.{os.getpid()}.partial")
    try:  # best effort: a read-only cache only hashes again next time
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(memo))
        partial.replace(memo_path)
    except OSError:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
    return digest


KEEP_ENTRIES = 2  # a file's entries: this code's and the newest other (two versions in turn)
_ENTRY_NAME = re.compile(r"[0-9a-f]{64}-[0-9a-f]{12}")  # <sha256>-<code fingerprint>; not a .partial


def entry_dir(digest: str, fingerprint: str) -> Path:
    return settings.get().cache_dir / "gguf" / f"{digest}-{fingerprint}"


def read_index(entry: Path, path: Path, with_tokenizer: bool) -> GGUFIndex | None:
    """The cached index of `path`, or None when there is none. An entry holds the tokenizer
    whenever the file has one (only loads that build it write entries)."""
    index_file = entry / "index.json"
    if not index_file.is_file():
        return None
    index = json.loads(index_file.read_text())
    data = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = [IndexedTensor(t["name"], gguf.GGMLQuantizationType(t["type"]), np.array(t["shape"]),
                             data[t["offset"]:t["offset"] + t["n_bytes"]].view(np.dtype(t["dtype"])).reshape(t["data_shape"]))
               for t in index["tensors"]]
    tokenizer = None
    if with_tokenizer and (entry / "tokenizer").is_dir():
        tokenizer = Tokenizer.from_hf_dir(entry / "tokenizer")
    return GGUFIndex(index["hf_config"], index["arch"], tensors, tokenizer, entry)


def write_index(entry: Path, index: GGUFIndex) -> None:
    """Store `index` (best effort: a read-only or full cache directory only costs the next start).
    The tokenizer and the index are renamed into place in that order: a reader that finds
    index.json finds the tokenizer too."""
    partial = entry.with_name(f"{entry.name}.{os.getpid()}.partial")
    try:
        partial.mkdir(parents=True, exist_ok=True)
        tensors = [{"name": t.name, "type": int(t.tensor_type), "shape": [int(d) for d in t.shape],
                    "offset": int(t.data_offset), "n_bytes": int(t.n_bytes), "dtype": t.data.dtype.str,
                    "data_shape": list(t.data.shape)} for t in index.tensors]
        (partial / "index.json").write_text(json.dumps({"hf_config": index.hf_config, "arch": index.arch, "tensors": tensors}))
        entry.mkdir(parents=True, exist_ok=True)
        if index.tokenizer is not None and not (entry / "tokenizer").exists():
            (partial / "tokenizer").mkdir()
            index.tokenizer.save(partial / "tokenizer")
            (partial / "tokenizer").rename(entry / "tokenizer")  # fails if another start won the race
        (partial / "index.json").replace(entry / "index.json")
    except (OSError, TypeError, ValueError):  # unwritable, or a value JSON cannot hold: parse next time
        pass
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    _prune_older_entries(entry)


def _prune_older_entries(entry: Path) -> None:
    """Delete the entries of the same file by other code beyond the newest KEEP_ENTRIES (by their
    index's time). A process still mapping a file from one keeps its pages: unlinking does not
    unmap; one starting from it meanwhile finds no index and parses again."""
    digest = entry.name.rsplit("-", 1)[0]
    others = (p for p in entry.parent.glob(f"{digest}-*") if p != entry and _ENTRY_NAME.fullmatch(p.name))
    for old in beyond_newest(others, KEEP_ENTRIES - 1, lambda p: p / "index.json"):
        shutil.rmtree(old, ignore_errors=True)
