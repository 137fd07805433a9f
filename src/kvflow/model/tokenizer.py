"""The tokenizer: a `tokenizers.Tokenizer` plus what serving needs around it.

It speaks the subset of HF's tokenizer API that users reach for (`encode`, `decode`,
`apply_chat_template`, `eos_token_id`), whether it was read from an HF directory or from the
metadata of a GGUF file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import tokenizers

from kvflow.model.chat_template import render_chat_template


@dataclass(frozen=True)
class TokenizerMeta:
    """Special tokens and templates that live beside the vocabulary."""

    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    chat_template: str | None = None
    # Every id that ends generation: eos_token's id plus generation_config.json's eos ids.
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)


class Tokenizer:
    def __init__(self, backend: tokenizers.Tokenizer, meta: TokenizerMeta) -> None:
        self.backend = backend
        self.meta = meta
        ids = set(meta.eos_token_ids)
        if meta.eos_token is not None and backend.token_to_id(meta.eos_token) is not None:
            ids.add(backend.token_to_id(meta.eos_token))
        self.eos_token_ids: frozenset[int] = frozenset(ids)

    # -- HF-like surface -------------------------------------------------------------------
    @property
    def eos_token_id(self) -> int | None:
        return self._id(self.meta.eos_token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id(self.meta.bos_token)

    @property
    def eos_token(self) -> str | None:
        return self.meta.eos_token

    @property
    def bos_token(self) -> str | None:
        return self.meta.bos_token

    @property
    def chat_template(self) -> str | None:
        return self.meta.chat_template

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        tools: list[dict] | None = None,
    ) -> str | list[int]:
        if not self.meta.chat_template:
            raise ValueError("this model's tokenizer has no chat template; use generate() with a plain prompt")
        text = render_chat_template(
            self.meta.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.meta.bos_token or "",
            eos_token=self.meta.eos_token or "",
            tools=tools,
        )
        # The template already wrote BOS where the model wants it.
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    # -- loading ---------------------------------------------------------------------------
    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """tokenizer.json + tokenizer_config.json (+ generation_config.json for eos ids)."""
        path = Path(path)
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        cfg = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        eos_ids = gen.get("eos_token_id", [])
        meta = TokenizerMeta(
            bos_token=_token_text(cfg.get("bos_token")),
            eos_token=_token_text(cfg.get("eos_token")),
            pad_token=_token_text(cfg.get("pad_token")),
            unk_token=_token_text(cfg.get("unk_token")),
            chat_template=template,
            eos_token_ids=tuple(eos_ids if isinstance(eos_ids, list) else [eos_ids]),
        )
        return cls(backend, meta)


def has_hf_tokenizer(path: str | Path) -> bool:
    return (Path(path) / "tokenizer.json").is_file()


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(value: str | dict | None) -> str | None:
    # tokenizer_config.json writes special tokens either as strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value
