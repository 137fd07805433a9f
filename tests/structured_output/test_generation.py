"""Structured output end to end with the default model at temperature 1: every output of every
constraint parses and validates — JSON schemas (checked by `jsonschema`), regexes, choices, an
EBNF grammar — while the same batch also runs n > 1 children, shares prompt blocks through the
prefix cache, and is preempted and recomputed (the KV pool holds a fraction of it). Any JSON
object (`json_object`) bounds nothing, so at temperature 1 this model may ramble past any
max_tokens; it is asked greedily.

All cases run in one batch (one engine, one generate call): the sampling is seeded, so what each
request draws does not depend on the batch it is in.
"""

from __future__ import annotations

import ast
import json
import re

import jsonschema
import pytest

from kvflow import LLM, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.slow

N = 2
SCHEMAS = {
    "nested objects": {
        "type": "object", "additionalProperties": False, "required": ["user", "active"],
        "properties": {
            "user": {"type": "object", "additionalProperties": False, "required": ["name", "age"],
                     "properties": {"name": {"type": "string", "minLength": 2, "maxLength": 12},
                                    "age": {"type": "integer", "minimum": 0, "maximum": 130}}},
            "active": {"type": "boolean"}}},
    "arrays with min and max items": {
        "type": "object", "additionalProperties": False, "required": ["tags", "scores"],
        "properties": {"tags": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 6},
                                "minItems": 2, "maxItems": 4},
                       "scores": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
                                  "minItems": 1, "maxItems": 3}}},
    "enums and optional fields": {
        "type": "object", "additionalProperties": False, "required": ["color"],
        "properties": {"color": {"enum": ["red", "green", "blue"]},
                       "size": {"type": "string", "enum": ["S", "M", "L"]},
                       "note": {"type": "string", "maxLength": 10}}},
    "array of objects, anyOf and pattern": {
        "type": "array", "minItems": 1, "maxItems": 2,
        "items": {"type": "object", "additionalProperties": False, "required": ["id", "code", "parent"],
                  "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                 "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                                 "parent": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 1, "maximum": 9}]}}}},
}
REGEXES = [r"(\+33 )?0[1-9]( [0-9]{2}){4}", r"[a-z]{2,8}@[a-z]{2,8}\.(com|org|fr)"]
CHOICES = ["Paris", "London", "New York", "Tokyo"]
GRAMMAR = r"""
root  ::= expr
expr  ::= term (" " op " " term){0,2}
term  ::= num | "(" inner ")"
inner ::= leaf (" " op " " leaf){1,2}
leaf  ::= num | "(" num " " op " " num ")"
op    ::= "+" | "-" | "*"
num   ::= [1-9] [0-9]?
"""


def _cases() -> list[tuple[str, str, StructuredOutputsParams, dict]]:
    """(name, question, constraint, changes to the sampling: temperature 1, n = N, seeded)"""
    cases = [(name, f"Describe something as JSON ({name}).", StructuredOutputsParams(json=schema), {})
             for name, schema in SCHEMAS.items()]
    cases += [(f"regex {i}", "Give me a contact detail.", StructuredOutputsParams(regex=r), {})
              for i, r in enumerate(REGEXES)]
    return cases + [
        ("choice", "Name a big city.", StructuredOutputsParams(choice=CHOICES), {}),
        ("grammar", "Write an arithmetic expression.", StructuredOutputsParams(grammar=GRAMMAR), {}),
        ("json_object", "Give a JSON object with a name and an age.", StructuredOutputsParams(json_object=True),
         {"temperature": 0.0}),
        # the grammar ends after one token or two, long before min_tokens
        ("ends before min_tokens", "Yes or no?", StructuredOutputsParams(choice=["yes", "no"]),
         {"min_tokens": 6, "max_tokens": 12}),
    ]


@pytest.fixture(scope="module")
def llm():
    # 24 blocks of 16 tokens: far less than the batch below would hold at its peak.
    return LLM(max_model_len=512, num_kv_blocks=24, block_size=16, disable_log_stats=True)


@pytest.fixture(scope="module")
def results(llm):
    tokenizer = llm.get_tokenizer()
    cases = _cases()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=True) for _, q, _, _ in cases]
    params = [SamplingParams(**{"n": N, "temperature": 1.0, "seed": 1000 + i, "max_tokens": 160,
                                "structured_outputs": c, **changes})
              for i, (_, _, c, changes) in enumerate(cases)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return {name: out.outputs for (name, *_), out in zip(cases, outputs)}


def _texts(results, name: str) -> list[str]:
    completions = results[name]
    assert len(completions) == N
    assert all(c.finish_reason == "stop" for c in completions), [(c.finish_reason, c.text) for c in completions]
    return [c.text for c in completions]


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_validate(results, name):
    for text in _texts(results, name):
        jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_regex_outputs_match(results):
    for i, regex in enumerate(REGEXES):
        for text in _texts(results, f"regex {i}"):
            assert re.fullmatch(regex, text), text


def test_choice_outputs_are_in_the_list(results):
    assert all(text in CHOICES for text in _texts(results, "choice"))


def test_grammar_outputs_parse(results):
    for text in _texts(results, "grammar"):
        tree = ast.parse(text, mode="eval")  # an independent parser of the same language
        kinds = {type(node).__name__ for node in ast.walk(tree)}
        assert kinds <= {"Expression", "BinOp", "Constant", "Add", "Sub", "Mult"}, (text, kinds)


def test_json_object_outputs_are_objects(results):
    assert all(isinstance(json.loads(text), dict) for text in _texts(results, "json_object"))


def test_the_batch_was_preempted_and_nothing_desynchronised(llm, results):
    engine = llm.llm_engine
    assert engine.scheduler.num_preemptions_total > 0
    manager = engine.structured_output
    engine.step()  # the manager forgets the requests that finished in the last step
    assert manager._requests == {} and not manager.active
    assert engine.kv_cache_usage == 0.0


def test_bad_constraints_are_refused_before_anything_is_queued(llm):
    bad = [(StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}),
            "the JSON schema is invalid or unsupported: .*nonsense"),
           (StructuredOutputsParams(json={"not": {"type": "string"}}), "the JSON schema is invalid or unsupported: .*not"),
           (StructuredOutputsParams(regex="a(b"), "the regex is invalid or unsupported: .*unclosed group"),
           (StructuredOutputsParams(grammar="root ::= ("), "the grammar is invalid or unsupported"),
           (StructuredOutputsParams(grammar="start: undefined_rule"), "the grammar is invalid or unsupported: .*undefined_rule")]
    for params, message in bad:
        with pytest.raises(ValueError, match="(?s)" + message):
            llm.generate(["Hi"], SamplingParams(max_tokens=4, structured_outputs=params), use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()
    [out] = llm.generate(["Hi"], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["ok"])),
                         use_tqdm=False)
    assert out.outputs[0].text == "ok"


def test_a_grammar_that_ends_overrules_min_tokens(results):
    assert all(text in ("yes", "no") for text in _texts(results, "ends before min_tokens"))
