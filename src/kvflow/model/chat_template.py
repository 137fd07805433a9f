"""Chat templates: the Jinja2 programs shipped with a model, run in a sandbox.

A template comes from a downloaded file, so it runs in jinja2's ImmutableSandboxedEnvironment:
it can format messages but cannot reach Python objects or mutate its inputs.
"""

from __future__ import annotations

from datetime import datetime
from functools import lru_cache

from jinja2 import TemplateError, Undefined
from jinja2.sandbox import ImmutableSandboxedEnvironment

VALID_ROLES = ("system", "user", "assistant", "tool", "developer")


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile(source: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=Undefined)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


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
    """Check a message and flatten OpenAI-style text parts into one string."""
    if not isinstance(message, dict):
        raise ValueError(f"messages[{index}] must be an object with 'role' and 'content'")
    role = message.get("role")
    if role not in VALID_ROLES:
        raise ValueError(f"messages[{index}].role must be one of {', '.join(VALID_ROLES)}; got {role!r}")
    content = message.get("content", "")
    if content is None:
        content = ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"messages[{index}].content[{j}] must be a text part {{'type': 'text', 'text': ...}}")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise ValueError(f"messages[{index}].content must be a string or a list of text parts")
    return {**message, "content": content}

