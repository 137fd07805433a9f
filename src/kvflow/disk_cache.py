"""Keys for what kvflow caches on disk: a file's content hash, and a fingerprint of the code that
derived the cached value from it (so a code change never reads a stale entry)."""

from __future__ import annotations

import hashlib
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
