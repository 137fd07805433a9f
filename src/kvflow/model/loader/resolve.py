"""One entry point for every model reference: None (the embedded default), a short name of a
packaged model (`gemma3-270m`), a .gguf file, or an HF directory."""

from __future__ import annotations

from pathlib import Path

from kvflow.model.default_model import default_model_path
from kvflow.model.loader import Checkpoint
from kvflow.model.packaged_models import MODEL_ALIASES


def load_checkpoint(model: str | None, load_tokenizer: bool = True, load_weights: bool = True,
                    native_gguf: bool = True) -> Checkpoint:
    """`load_weights=False` (dummy weights): an HF directory then needs only its config.json.
    `native_gguf=False`: a GGUF's quantized blocks are dequantized to float32 (to re-quantize them)."""
    if model in MODEL_ALIASES:
        path = MODEL_ALIASES[model]()
    else:
        path = Path(model) if model else default_model_path()
    if not path.exists():
        raise FileNotFoundError(f"model {str(path)!r} does not exist (give an HF directory or a .gguf file)")
    if path.is_dir():
        from kvflow.model.loader.hf import load_hf_dir

        return load_hf_dir(path, load_tokenizer, load_weights)
    from kvflow.model.loader.gguf import load_gguf

    return load_gguf(path, with_tokenizer=load_tokenizer, native=native_gguf)
