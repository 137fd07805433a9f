"""Request bodies of the OpenAI API, with OpenAI's field names, defaults and ranges.

Validation is strict (a string is not a number, 1.0 is not an integer) so that a wrong type is an
error rather than a guess; null is the same as leaving a field out. Fields OpenAI has and kvflow
does not support are refused by name (UNSUPPORTED_FIELDS, vLLM's extras among them); kvflow's own sampling knobs (top_k,
min_p, ...) are accepted as extra fields, as vLLM accepts them; any other unknown field is
ignored, as OpenAI's clients send new ones first.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvflow.entrypoints.openai.structured_request import StructuredOutputFields
from kvflow.entrypoints.openai.tool_calls import PastToolCall, ToolFields
from kvflow.sampling_params import StructuredOutputsParams

MAX_N = 128  # OpenAI's limit
_INT64 = 2**63

MAX_CACHE_SALT_CHARS = 256  # room for a tenant's name or a random token; a key, not a payload

# Fields OpenAI (or vLLM) defines that kvflow does not implement: refused by name, never ignored,
# since a client sending them expects their effect. Sent with a value that asks for nothing
# (null, empty, "none", or vLLM's default in _DEFAULTS) they are accepted. Tools are a chat
# feature: completions refuse them; vLLM's chat extras are refused on chat (completions
# implements its own `echo`).
UNSUPPORTED_FIELDS = ("functions", "function_call", "allowed_token_ids", "bad_words",
                      "truncate_prompt_tokens", "logits_processors", "return_tokens_as_token_ids", "priority",
                      "guided_whitespace_pattern")
CHAT_ONLY_FIELDS = ("tools", "tool_choice")
UNSUPPORTED_CHAT_EXTRAS = ("echo", "continue_final_message", "chat_template", "chat_template_kwargs", "documents")
_ASKS_FOR_NOTHING = (None, [], {}, "none")
_DEFAULTS = {"return_tokens_as_token_ids": False, "priority": 0,
             "echo": False, "continue_final_message": False}


def _asks_for_something(name: str, value: Any) -> bool:
    return value not in _ASKS_FOR_NOTHING and not (name in _DEFAULTS and value == _DEFAULTS[name])


class OpenAIBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        # OpenAI's fields are "X or null", null meaning "the default"; some clients send it.
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(OpenAIBody):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, the usage so far in every chunk


class SamplingFields(OpenAIBody, StructuredOutputFields):
    """What chat and completion requests share (response_format and vLLM's structured-output
    fields come from StructuredOutputFields)."""

    _unsupported: ClassVar[tuple[str, ...]] = UNSUPPORTED_FIELDS

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in cls._unsupported:
                if _asks_for_something(name, data.get(name)):
                    where = (" on /v1/completions (use /v1/chat/completions)" if name in CHAT_ONLY_FIELDS
                             else " on /v1/chat/completions" if name in UNSUPPORTED_CHAT_EXTRAS else "")
                    raise ValueError(f"`{name}` is not supported by this server{where}")
        return data

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-_INT64, lt=_INT64)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = None
    # kvflow's extras, with vLLM's names.
    # Cached KV blocks are shared only among requests with the same salt (none: with no salt).
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    top_k: int = Field(0, ge=-1, lt=_INT64)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=64)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # OpenAI's: token id (as a string, JSON's keys) → bias in [-100, 100] added to its logit.
    logit_bias: dict[str, float] | None = None
    # vLLM's: each prompt token's logprob and the top N at its position (not in a stream).
    prompt_logprobs: int | None = Field(None, ge=0)
    # vLLM's: the n best beams (kvflow.engine.beam_search) instead of n samples; length_penalty ranks them.
    use_beam_search: bool = False
    length_penalty: float = Field(1.0, ge=-100.0, le=100.0)
    # kvflow's: a KV budget for this request (kvflow.core.kv_eviction); absent: the server's.
    kv_eviction_policy: str | None = Field(None, max_length=32)
    kv_budget_tokens: int | None = Field(None, ge=1)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])  # their count: ServerLimits
        if not all(stops):
            raise ValueError("must be non-empty strings")
        return stops

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_numbers(cls, bias: Any) -> Any:
        # Strict mode takes no int for a float; a bias of 5 is 5.0.
        if isinstance(bias, dict):
            return {k: float(v) if isinstance(v, int) and not isinstance(v, bool) else v for k, v in bias.items()}
        return bias

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids; got {key!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"values must be in [-100, 100]; got {value} for token {key}")
        return bias

    def token_logit_bias(self) -> dict[int, float] | None:
        return {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, ids: list[int]) -> list[int]:
        if any(i < 0 for i in ids):
            raise ValueError("must be token ids >= 0")
        return ids

    @model_validator(mode="after")
    def _consistent(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not supported with stream (vLLM's rule too)")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


class TextPart(OpenAIBody):
    type: Literal["text"]
    text: str


class ImageURL(OpenAIBody):
    url: str
    detail: Literal["auto", "low", "high"] | None = None  # OpenAI's; the image processor decides the tiles


class ImagePart(OpenAIBody):
    """OpenAI's image content part. Only `data:` URLs are read: fetching a client's URL from the
    server is not built (it would need an allow-list, a size and time bound: docs/limits.md)."""

    type: Literal["image_url"]
    image_url: ImageURL

    def image_bytes(self) -> bytes:
        url = self.image_url.url
        header, comma, payload = url.partition(",")
        if not url.startswith("data:") or not comma or not header.endswith(";base64"):
            raise ValueError("image_url.url must be a data: URL with base64 content (data:image/png;base64,...); "
                             "the server fetches no remote images")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("image_url.url: its base64 content does not decode") from None


def _content_part(part: Any) -> TextPart | ImagePart:
    if isinstance(part, dict) and part.get("type") == "image_url":
        return ImagePart.model_validate(part)
    return TextPart.model_validate(part)


class ChatMessage(OpenAIBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None
    name: str | None = None
    tool_calls: list[PastToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool result's

    @field_validator("content")
    @classmethod
    def _text_content(cls, content: Any) -> str | list[dict] | None:
        """A string, or a list of text parts (joined), or, with images, the parts in order as
        {'type': 'text', 'text': ...} and {'type': 'image', 'data': bytes}; audio is not supported."""
        if content is None or isinstance(content, str):
            return content
        try:
            parts = [_content_part(p) for p in content] if isinstance(content, list) else None
        except ValidationError:
            parts = None
        if parts is None:
            raise ValueError("must be a string or a list of {'type': 'text', 'text': ...} and "
                             "{'type': 'image_url', 'image_url': {'url': 'data:...'}} parts")
        if all(isinstance(p, TextPart) for p in parts):
            return "".join(p.text for p in parts)
        return [{"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image", "data": p.image_bytes()}
                for p in parts]

    def images(self) -> list[bytes]:
        return [p["data"] for p in self.content if p["type"] == "image"] if isinstance(self.content, list) else []

    @model_validator(mode="after")
    def _has_content(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def for_template(self) -> dict:
        # Chat templates know "system"; "developer" is OpenAI's newer name for it.
        role = "system" if self.role == "developer" else self.role
        content = self.content or ""
        if isinstance(content, list):  # image parts: the template writes the model's image placeholder
            content = [p if p["type"] == "text" else {"type": "image"} for p in content]
        message = {"role": role, "content": content}
        if self.tool_calls:
            message["tool_calls"] = [c.for_template() for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(SamplingFields, ToolFields):
    _unsupported: ClassVar[tuple[str, ...]] = UNSUPPORTED_FIELDS + UNSUPPORTED_CHAT_EXTRAS
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _chat_only(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        forced = self.tool_choice_params()
        if forced is not None and super().structured_outputs_params() is not None:
            raise ValueError(f"tool_choice {self.tool_mode!r} decides the output's format; "
                             "it cannot be combined with response_format or structured_outputs")
        return forced or super().structured_outputs_params()

    @property
    def max_new_tokens(self) -> int | None:
        # None: up to the end of the context, as OpenAI does for chat.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


TokenIds = list[int]


class CompletionRequest(SamplingFields):
    _unsupported: ClassVar[tuple[str, ...]] = UNSUPPORTED_FIELDS + CHAT_ONLY_FIELDS
    prompt: Any
    max_tokens: int | None = Field(16, ge=0)  # 0, with echo: score the prompt, generate nothing (vLLM's)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)  # at most the engine's max_logprobs (vLLM's; OpenAI's is 5)
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, prompt: Any) -> str | list[str] | TokenIds | list[TokenIds]:
        def ids(x: Any) -> bool:
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(prompt, str) or (ids(prompt) and prompt):
            return prompt
        if isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt) or all(ids(p) for p in prompt)):
            return prompt
        raise ValueError("must be a string, a non-empty list of strings, a list of token ids, "
                         "or a list of token-id lists")

    @model_validator(mode="after")
    def _completion_only(self):
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (other than best_of == n)")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 generates nothing: it scores the prompt, with echo (and logprobs)")
        return self

    @property
    def scores_only(self) -> bool:
        """max_tokens 0 with echo: the prompt and its logprobs, no completion."""
        return self.max_tokens == 0

    @property
    def max_new_tokens(self) -> int | None:
        return 1 if self.scores_only else self.max_tokens  # the engine samples a token the answer drops

    def prompts(self) -> list[str | TokenIds]:
        """One entry per prompt: the text or the token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)
