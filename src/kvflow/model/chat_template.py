"""Chat templates: the Jinja2 programs shipped with a model, run in a sandbox.

A template comes from a downloaded file, so it runs in jinja2's ImmutableSandboxedEnvironment:
it can format messages but cannot reach Python objects or mutate its inputs. The environment is
the one transformers renders with (templates are written against it): `{% break %}` and
`{% continue %}` work, and `tojson` writes plain JSON (no HTML escaping, non-ASCII kept, keys in
their order).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

from jinja2 import TemplateError, Undefined
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

VALID_ROLES = ("system", "user", "assistant", "tool", "developer")


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile(source: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=Undefined,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def compile_chat_template(source: str) -> None:
    """Check that a template parses (a server does it at startup: a broken template stops the
    start instead of failing every chat request)."""
    try:
        _compile(source)
    except TemplateError as e:
        raise ValueError(f"the chat template does not compile: {e}") from e


def render_chat_template(
    source: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool,
    bos_token: str = "",
    eos_token: str = "",
    tools: list[dict] | None = None,
) -> str:
    """`tools`: OpenAI-style tool objects, for templates that describe them (HF's convention)."""
    normalize = [normalize_message(m, i) for i, m in enumerate(messages)]
    compile_chat_template(source)
    try:
        return _compile(source).render(
            messages=normalize,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            tools=tools,
        )
    except TemplateError as e:
        raise ValueError(f"chat template failed: {e}") from e


def normalize_message(message: dict, index: int) -> dict:
    """Check a message and flatten OpenAI-style text parts into one string; with image parts
    ({'type': 'image'}, for a template that writes the model's image placeholder) the parts stay a
    list."""
    if not isinstance(message, dict):
        raise ValueError(f"messages[{index}] must be an object with 'role' and 'content'")
    role = message.get("role")
    if role not in VALID_ROLES:
        raise ValueError(f"messages[{index}].role must be one of {', '.join(VALID_ROLES)}; got {role!r}")
    content = message.get("content", "")
    if content is None:
        content = ""
    if isinstance(content, list):
        for j, part in enumerate(content):
            is_text = isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            if not is_text and part != {"type": "image"}:
                raise ValueError(f"messages[{index}].content[{j}] must be a text part {{'type': 'text', 'text': ...}}")
        if any(part["type"] == "image" for part in content):
            return {**message, "content": list(content)}
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise ValueError(f"messages[{index}].content must be a string or a list of text parts")
    return {**message, "content": content}

