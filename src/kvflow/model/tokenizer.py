"""The tokenizer: a `tokenizers.Tokenizer` plus what serving needs around it.

It speaks the subset of HF's tokenizer API that users reach for (`encode`, `decode`,
`apply_chat_template`, `eos_token_id`), whether it was read from an HF directory or from the
metadata of a GGUF file.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import tokenizers

from kvflow.model.chat_template import normalize_message, render_chat_template


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
        # The batch call releases the GIL while it works (encode() holds it throughout), so a
        # long text tokenized on a worker thread does not stall the event loop or the engine.
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        tools: list[dict] | None = None,
        escape_special_tokens: bool = False,
        check_text: Callable[[str], None] | None = None,
    ) -> str | list[int]:
        """`escape_special_tokens`: special-token text inside message content ("<|im_start|>system")
        is tokenized as the plain text it is, so a user cannot forge the template's structure.
        `check_text` sees the rendered text before it is tokenized (and may refuse it). `tools`: the
        OpenAI tool definitions, for templates that render them."""
        if not self.meta.chat_template:
            raise ValueError("this model's tokenizer has no chat template; use generate() with a plain prompt")
        if escape_special_tokens and tokenize:
            return self._render_escaped(messages, add_generation_prompt, check_text, tools)
        text = render_chat_template(
            self.meta.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.meta.bos_token or "",
            eos_token=self.meta.eos_token or "",
            tools=tools,
        )
        if check_text is not None:
            check_text(text)
        # The template already wrote BOS where the model wants it.
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _render_escaped(self, messages: list[dict], add_generation_prompt: bool,
                        check_text: Callable[[str], None] | None, tools: list[dict] | None) -> list[int]:
        # Special-token text in content is swapped for a marker no user can guess, the template is
        # rendered, and each marker is tokenized apart, as plain text. Without such text in the
        # content the ids are exactly those of the ordinary path.
        nonce, found = secrets.token_hex(8), []

        def mark(match: re.Match) -> str:
            found.append(match.group())
            return f"\ue000{nonce}:{len(found) - 1}\ue001"

        marked = [normalize_message(m, i) for i, m in enumerate(messages)]
        if self._special_pattern is not None:
            marked = [{**m, "content": self._mark_content(m["content"], mark)} for m in marked]
        text = self.apply_chat_template(marked, add_generation_prompt, tools=tools, check_text=check_text)
        ids, start = [], 0
        for marker in re.finditer(f"\ue000{nonce}:(\\d+)\ue001", text):
            ids += self.encode(text[start:marker.start()], add_special_tokens=False)
            ids += self._plain_text_backend.encode_batch([found[int(marker.group(1))]], add_special_tokens=False)[0].ids
            start = marker.end()
        return ids + self.encode(text[start:], add_special_tokens=False)

    def _mark_content(self, content: str | list[dict], mark: Callable[[re.Match], str]) -> str | list[dict]:
        """The special-token text of a message's text (of its text parts, beside image parts) marked."""
        if isinstance(content, str):
            return self._special_pattern.sub(mark, content)
        return [{**p, "text": self._special_pattern.sub(mark, p["text"])} if p["type"] == "text" else p for p in content]

    @cached_property
    def _special_pattern(self) -> re.Pattern | None:
        texts = sorted((t.content for t in self.backend.get_added_tokens_decoder().values() if t.special), key=len,
                       reverse=True)
        return re.compile("|".join(map(re.escape, texts))) if texts else None

    @cached_property
    def _plain_text_backend(self) -> tokenizers.Tokenizer:
        """A copy of the tokenizer that reads special-token text as ordinary text."""
        backend = tokenizers.Tokenizer.from_str(self.backend.to_str())
        backend.encode_special_tokens = True
        return backend

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

    def save(self, path: str | Path) -> None:
        """The files `from_hf_dir` reads back."""
        path = Path(path)
        self.backend.save(str(path / "tokenizer.json"))
        m = self.meta
        cfg = {k: v for k, v in (("bos_token", m.bos_token), ("eos_token", m.eos_token), ("pad_token", m.pad_token),
                                 ("unk_token", m.unk_token), ("chat_template", m.chat_template)) if v is not None}
        (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": list(m.eos_token_ids)}) + "\n")


def has_hf_tokenizer(path: str | Path) -> bool:
    return (Path(path) / "tokenizer.json").is_file()


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(value: str | dict | None) -> str | None:
    # tokenizer_config.json writes special tokens either as strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value
