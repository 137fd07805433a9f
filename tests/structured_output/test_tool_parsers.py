"""Tool calls read from a choice's text: the same calls and content whether the text comes whole
or in pieces cut anywhere, for the Hermes format (`auto`), the JSON array `required` forces, and a
named function's streamed arguments; and the prompt side for templates without tool support."""

from __future__ import annotations

import json

import pytest

from kvflow.entrypoints.openai.tool_calls import messages_for_template
from kvflow.entrypoints.openai.tool_parsers import HermesOutput, choice_output, whole_calls

HERMES = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "now", "parameters": {}}]</tool_call>')
HERMES_CALLS = [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2}), ("now", {})]
REQUIRED = '[{"name": "add", "arguments": {"a": 1, "b": [2, "]}"]}}, {"name": "now", "arguments": {}}]'


def run(output, pieces: list[str]) -> tuple[str, list[tuple[str, dict]], list[str]]:
    """Feed the pieces; (content, calls, ids)."""
    content, deltas = "", []
    for i, piece in enumerate(pieces):
        text, calls = output.feed(piece, final=i == len(pieces) - 1)
        content += text
        deltas += calls
    calls = whole_calls(deltas)
    return content, [(c.function.name, json.loads(c.function.arguments)) for c in calls], [c.id for c in calls]


def splits(text: str):
    """The whole text, every cut in two, and one character at a time."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)


@pytest.mark.parametrize("mode, text, content, calls", [
    ("auto", HERMES, "Let me check. ", HERMES_CALLS),
    ("auto", "No tools needed <tool here>.", "No tools needed <tool here>.", []),
    ("auto", "Broken <tool_call>{not json}</tool_call> end", "Broken <tool_call>{not json}</tool_call> end", []),
    ("auto", 'Cut off <tool_call>{"name": "now", "arguments": {}}', "Cut off ", [("now", {})]),
    ("auto", "Cut off <tool_call>{\"name\": \"no", "Cut off <tool_call>{\"name\": \"no", []),
    ("required", REQUIRED, "", [("add", {"a": 1, "b": [2, "]}"]}), ("now", {})]),
    ("named", '{"a": 3, "b": 4}', "", [("add", {"a": 3, "b": 4})]),
])
def test_whole_or_in_pieces_gives_the_same_calls(mode, text, content, calls):
    for pieces in splits(text):
        got_content, got_calls, ids = run(choice_output(mode, "hermes", "add"), pieces)
        assert (got_content, got_calls) == (content, calls), pieces
        assert len(set(ids)) == len(ids) and all(i.startswith("call_") for i in ids)


def test_a_required_call_is_sent_as_soon_as_it_is_complete():
    output = choice_output("required", "hermes")
    first_end = REQUIRED.index("}}, ") + 2
    assert output.feed(REQUIRED[:first_end - 1], final=False) == ("", [])
    _, calls = output.feed(REQUIRED[first_end - 1:first_end], final=False)
    assert [c.function.name for c in calls] == ["add"] and calls[0].index == 0


def test_hermes_holds_back_only_what_may_start_a_tag():
    output = HermesOutput()
    assert output.feed("Hello <to", final=False) == ("Hello ", [])
    assert output.feed("ast>", final=False) == ("<toast>", [])


def test_named_arguments_stream_under_one_id():
    output = choice_output("named", "hermes", "add")
    _, [first] = output.feed('{"a"', final=False)
    _, [second] = output.feed(": 1}", final=True)
    assert first.id and first.function.name == "add" and first.function.arguments == '{"a"'
    assert second.id is None and second.function.name is None and second.function.arguments == ": 1}"


TOOLS = [{"type": "function", "function": {"name": "now", "description": "The time"}}]
PAST = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "now", "arguments": {}}}]},
        {"role": "tool", "content": "12:00", "tool_call_id": "c1"}]


def test_templates_without_tools_get_them_in_the_system_message():
    messages = messages_for_template(PAST, TOOLS, "{{ messages }}")
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\n") and '"name": "now"' in messages[0]["content"]
    assert messages[2]["content"] == '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    assert messages[3]["content"] == "<tool_response>\n12:00\n</tool_response>"
    assert messages_for_template(PAST[1:2], TOOLS, None)[0]["role"] == "system"  # added when there is none
    assert messages_for_template(PAST, None, "x")[0] == PAST[0]  # no tools: past calls still as text


def test_templates_with_tools_get_the_messages_as_they_are():
    template = "{% for t in tools %}{{ t.function.name }}{% endfor %}"
    assert messages_for_template(PAST, TOOLS, template) is PAST
