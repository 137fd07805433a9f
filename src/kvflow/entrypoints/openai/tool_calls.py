"""Tool calling on /v1/chat/completions: the request's `tools` and `tool_choice`, how the tools
reach the prompt, and how `tool_choice` constrains the output.

- `none`: the tools are left out of the prompt and the output is plain content.
- `auto`: the tools are in the prompt and the model decides; its text is parsed for calls in its
  template family's format (`tool_parsers.py`).
- `required`: the output is forced to be a JSON array of one or more calls of the listed tools,
  `[{"name": ..., "arguments": {...}}]`, each call's arguments valid for that tool's schema.
- a named function: the output is forced to be that function's arguments object.

The forcing is an ordinary JSON-schema constraint, so it needs nothing of the grammar library but
JSON schemas. Templates that render `tools` themselves get them; for the others (SmolLM2's) the
tools are described in the system message, in the Hermes `<tools>` / `<tool_call>` convention.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvflow.entrypoints.openai.json_depth import check_depth
from kvflow.sampling_params import StructuredOutputsParams

_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


class _Part(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class FunctionDefinition(_Part):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object; none: no arguments
    strict: bool | None = None


class Tool(_Part):
    type: Literal["function"]
    function: FunctionDefinition


class _FunctionName(_Part):
    name: str


class NamedToolChoice(_Part):
    type: Literal["function"]
    function: _FunctionName


class _PastFunctionCall(_Part):
    name: str
    arguments: str  # JSON text

    @field_validator("arguments")
    @classmethod
    def _bounded(cls, arguments: str) -> str:
        # Parsed for the template (PastToolCall.for_template): its nesting must be bounded first.
        return check_depth(arguments)


class PastToolCall(_Part):
    """A call the assistant made earlier in the conversation, as the client sends it back."""

    id: str
    type: Literal["function"] = "function"
    function: _PastFunctionCall

    def for_template(self) -> dict:
        # Templates format the arguments themselves (`| tojson`): they want the object.
        try:
            arguments = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


class ToolFields(BaseModel):
    """Mixed into the chat request body."""

    model_config = ConfigDict(strict=True, extra="ignore")
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _choice_names_a_tool(self):
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: every function needs its own name")
        choice = self.tool_choice
        if choice not in (None, "none") and not names:
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names the function {choice.function.name!r}, which is not in tools")
        return self

    @property
    def tool_mode(self) -> str:
        """"none", "auto", "required" or "named"."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    @property
    def forced_function(self) -> str | None:
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    def template_tools(self) -> list[dict] | None:
        """The tools as chat templates take them (OpenAI's objects); None when left out."""
        if self.tool_mode == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def tool_choice_params(self) -> StructuredOutputsParams | None:
        """The constraint `required` or a named function puts on the output."""
        if self.tool_mode == "named":
            tool = next(t for t in self.tools if t.function.name == self.forced_function)
            return StructuredOutputsParams(json=tool.function.parameters or _NO_PARAMETERS)
        if self.tool_mode != "required":
            return None
        calls = [{"type": "object",
                  "properties": {"name": {"const": t.function.name},
                                 "arguments": t.function.parameters or _NO_PARAMETERS},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for t in self.tools]
        schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if self.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)


def template_renders_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def messages_for_template(messages: list[dict], tools: list[dict] | None, template: str | None) -> list[dict]:
    """Messages for a template that does not render tools itself: the tools go into the system
    message, past calls and their results into text in the same convention."""
    if template_renders_tools(template):
        return messages
    converted = [_as_text(m) for m in messages]
    if not tools:
        return converted
    described = _describe(tools)
    if converted and converted[0]["role"] == "system":
        return [{**converted[0], "content": f"{converted[0]['content']}\n\n{described}"}, *converted[1:]]
    return [{"role": "system", "content": described}, *converted]


def _describe(tools: list[dict]) -> str:
    listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return ("You can call functions to help answer. They are described by these JSON schemas:\n"
            f"<tools>\n{listing}\n</tools>\n"
            "To call one, reply with its name and arguments as a JSON object inside tags, one call per tag:\n"
            '<tool_call>\n{"name": "the function name", "arguments": {"argument": "value"}}\n</tool_call>')


def _as_text(message: dict) -> dict:
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    calls = message.get("tool_calls")
    if message["role"] != "assistant" or not calls:
        return message
    blocks = [json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]}, ensure_ascii=False)
              for c in calls]
    text = "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks)
    content = f"{message['content']}\n{text}" if message.get("content") else text
    return {"role": "assistant", "content": content}
