"""Which grammar library a name means, checked when the engine starts, and built on first use.

The libraries are imported here only when chosen: an engine that never sees a grammar never
loads either.
"""

from __future__ import annotations

import importlib.util

from kvflow.structured_output.backend import GrammarBackend

BACKENDS = ("guidance", "xgrammar")  # vLLM's names for llguidance and xgrammar


def check_backend(name: str) -> None:
    """Refuse an unknown or uninstalled backend when the engine starts, not at the first request."""
    if name not in BACKENDS:
        raise ValueError(f"structured_outputs_backend must be one of {', '.join(BACKENDS)}; got {name!r}")
    package = {"guidance": "llguidance", "xgrammar": "xgrammar"}[name]
    if importlib.util.find_spec(package) is None:
        raise ValueError(f"structured_outputs_backend {name!r} needs the {package} package: pip install {package}")


def make_backend(name: str, tokenizer, vocab_size: int, eos_token_ids: list[int],
                 strict_schemas: bool = True) -> GrammarBackend:
    """`tokenizer`: the `tokenizers.Tokenizer` of the model; `vocab_size`: its logits' width;
    `strict_schemas`: an object schema that names its keys allows no others (strict_schema.py)."""
    check_backend(name)
    if name == "guidance":
        from kvflow.structured_output.llguidance_backend import LLGuidanceBackend as backend_class
    else:
        from kvflow.structured_output.xgrammar_backend import XGrammarBackend as backend_class
    try:
        return backend_class(tokenizer, vocab_size, eos_token_ids, strict_schemas)
    except (ValueError, RuntimeError) as e:  # the library cannot read this tokenizer (its decoder, say)
        raise ValueError(f"structured output is unavailable with this model: the {name} backend cannot read "
                         f"its tokenizer ({str(e)[:300]})") from None
