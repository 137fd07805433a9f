"""The settings kvflow reads from the environment: three, each a user's, read once per process.

Everything else kvflow does is chosen by engine and server arguments (`config.EngineArgs`, the
CLI's flags); the environment holds only what belongs to the user's session rather than to one
engine (a cache directory, a secret, a trust decision):

- `KVFLOW_CACHE_DIR` (default `~/.cache/kvflow`): where kvflow caches what it derives: built C++
  kernels, GGUF parses and packed weights, assembled model packages;
- `KVFLOW_API_KEY` (default none: no key): `kvflow serve`'s `--api-key` when the flag is not given;
- `KVFLOW_ALLOW_RUNTIME_LORA_UPDATING` (default off): `kvflow serve`'s
  `--allow-runtime-lora-updating` when neither flag form is given, as vLLM's
  `VLLM_ALLOW_RUNTIME_LORA_UPDATING`: `1`/`true` or `0`/`false`.

`get()` reads them the first time it is asked and keeps the result: nothing reads the environment
in a step or a call. A value kvflow cannot read is an error naming the variable, not a silent
default.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

CACHE_DIR = "KVFLOW_CACHE_DIR"
API_KEY = "KVFLOW_API_KEY"
ALLOW_RUNTIME_LORA_UPDATING = "KVFLOW_ALLOW_RUNTIME_LORA_UPDATING"
_TRUE, _FALSE = ("1", "true"), ("0", "false", "")


@dataclass(frozen=True)
class Settings:
    cache_dir: Path
    api_key: str | None = None  # None: unset (an empty key is refused where it is used: api_server.build_app)
    allow_runtime_lora_updating: bool = False

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Settings:
        """The settings `environ` holds (unset variables take their defaults); ValueError naming a
        variable whose value is not one it takes."""
        return cls(cache_dir=Path(environ.get(CACHE_DIR) or Path.home() / ".cache" / "kvflow"),
                   api_key=environ.get(API_KEY),
                   allow_runtime_lora_updating=_flag(environ, ALLOW_RUNTIME_LORA_UPDATING))


def _flag(environ: Mapping[str, str], name: str) -> bool:
    value = environ.get(name, "").strip().lower()
    if value not in _TRUE + _FALSE:
        raise ValueError(f"{name} must be 1, true, 0 or false (or unset); got {environ[name]!r}")
    return value in _TRUE


@functools.cache
def get() -> Settings:
    """This process's settings, read from its environment on first use."""
    return Settings.from_environ(os.environ)
