"""From a choice's text, as it streams, to content and tool calls in OpenAI's shape.

One `ChoiceOutput` per choice is fed the text deltas in order (`final` with the last) and answers
each with the content to send and the tool-call deltas to send; the non-streaming path feeds the
whole text once. What it parses depends on the request's tool_choice:

- a named function: the whole text is that function's arguments, streamed as it comes;
- `required`: the text is a JSON array of calls; each call is sent once it is complete;
- `auto`: the model's own format, by template family (`TOOL_PARSERS`). Hermes (Qwen 2.5, Hermes,
  SmolLM2 as kvflow prompts it): calls are JSON objects (or lists of them) between `<tool_call>`
  and `</tool_call>`; the text around them is content. A block that does not parse stays content.

The model's text is JSON a client can steer, so it is parsed only within json_depth's bound: a
block nested deeper is not a call (content, as any block that does not parse).
"""

from __future__ import annotations

import json
import uuid

from kvflow.entrypoints.openai import json_depth
from kvflow.entrypoints.openai.responses import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChoiceOutput:
    """Plain content: no tools."""

    def __init__(self) -> None:
        self.num_calls = 0

    def feed(self, text: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        return text, []

    def _call(self, name: str, arguments: str) -> DeltaToolCall:
        """A whole call, as its first and only delta."""
        self.num_calls += 1
        return DeltaToolCall(index=self.num_calls - 1, id=new_call_id(), type="function",
                             function=DeltaFunctionCall(name=name, arguments=arguments))


class NamedFunctionOutput(ChoiceOutput):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        if self.num_calls == 0 and (text or final):
            return "", [self._call(self.name, text)]
        return "", [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text))] if text else []


class RequiredCallsOutput(ChoiceOutput):
    """`[{"name": ..., "arguments": {...}}, ...]`; the grammar made it valid JSON, so every
    element that decodes is complete."""

    def __init__(self) -> None:
        super().__init__()
        self.text = ""
        self.pos = 0  # where the next element may start
        self.decoder = json.JSONDecoder()

    def feed(self, text: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        self.text += text
        calls = []
        while True:
            start = self.pos
            while start < len(self.text) and self.text[start] in "[, \n\t\r":
                start += 1
            try:
                json_depth.check_depth(self.text[start:])  # the grammar bounds no arguments' nesting
                element, end = self.decoder.raw_decode(self.text, start)
            except ValueError:  # not complete yet (or cut off by max_tokens, or too deep to parse)
                return "", calls
            self.pos = end
            calls.append(self._call(element["name"], json.dumps(element["arguments"], ensure_ascii=False)))


class HermesOutput(ChoiceOutput):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self.buffer = ""
        self.in_call = False
        self.blank = ""  # whitespace after a call: content only if more content follows

    def feed(self, text: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        self.buffer += text
        content, calls = "", []
        while True:
            if not self.in_call:
                start = self.buffer.find(self.OPEN)
                if start < 0:
                    keep = 0 if final else _partial_suffix(self.buffer, self.OPEN)
                    content += self._content(self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                content += self._content(self.buffer[:start])
                self.buffer = self.buffer[start + len(self.OPEN):]
                self.in_call = True
                continue
            end = self.buffer.find(self.CLOSE)
            if end < 0 and not final:
                break
            block = self.buffer if end < 0 else self.buffer[:end]
            self.buffer = "" if end < 0 else self.buffer[end + len(self.CLOSE):]
            self.in_call = False
            parsed = _parse_calls(block)
            if parsed is None:
                content += self._content(self.OPEN + block + ("" if end < 0 else self.CLOSE))
            else:
                self.blank = ""
                calls += [self._call(name, arguments) for name, arguments in parsed]
        return content, calls

    def _content(self, text: str) -> str:
        if not self.num_calls:
            return text
        self.blank += text
        if not self.blank.strip():
            return ""
        text, self.blank = self.blank, ""
        return text


TOOL_PARSERS = {"hermes": HermesOutput}


def choice_output(tool_mode: str, parser: str, function: str | None = None) -> ChoiceOutput:
    if tool_mode == "named":
        return NamedFunctionOutput(function)
    if tool_mode == "required":
        return RequiredCallsOutput()
    if tool_mode == "auto":
        return TOOL_PARSERS[parser]()
    return ChoiceOutput()


def whole_calls(deltas: list[DeltaToolCall]) -> list[ToolCall]:
    """The complete calls that a choice's deltas add up to."""
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        call = calls.get(delta.index)
        if call is None:
            calls[delta.index] = ToolCall(id=delta.id, function=FunctionCall(name=delta.function.name,
                                                                             arguments=delta.function.arguments or ""))
        else:
            call.function.arguments += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)]


def _parse_calls(block: str) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) of each call in a block: one call object or a list of them."""
    try:
        value = json_depth.loads(block)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        calls.append((item["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)))
    return calls


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that `tag` starts with (held back: it may be
    the beginning of a tag)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
