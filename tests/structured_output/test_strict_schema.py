"""Object schemas that name their keys allow no others unless they say so (strict_schema.py),
with both grammar libraries, and `--structured-outputs-lenient-schemas` keeps JSON Schema's
open default."""

from __future__ import annotations

import json

import pytest

from kvflow import LLM, SamplingParams
from kvflow.structured_output.params import StructuredOutputsParams
from kvflow.structured_output.strict_schema import closed, closed_schema_text


def test_objects_that_name_their_keys_are_closed_and_the_rest_kept():
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"x": {"type": "integer"}}},  # nested: closed too
        "b": {"type": "object", "properties": {"y": {}}, "additionalProperties": {"type": "string"}},  # asks: kept
        "c": {"type": "object"},  # names no key: any object
        "d": {"type": "array", "items": {"properties": {"z": {}}}},  # no "type": an object schema still
        "e": {"anyOf": [{"type": "object", "properties": {"p": {}}}, {"type": "string"}]},
        "f": {"allOf": [{"type": "object", "properties": {"q": {}}}, {"properties": {"r": {}}}]},  # parts stay open
    }, "$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}}}
    out = closed(schema)
    props = out["properties"]
    assert out["additionalProperties"] is False
    assert props["a"]["additionalProperties"] is False
    assert props["b"]["additionalProperties"] == {"type": "string"}
    assert "additionalProperties" not in props["c"]
    assert props["d"]["items"]["additionalProperties"] is False
    assert props["e"]["anyOf"][0]["additionalProperties"] is False and props["e"]["anyOf"][1] == {"type": "string"}
    assert all("additionalProperties" not in part for part in props["f"]["allOf"])
    assert out["$defs"]["node"]["additionalProperties"] is False
    assert schema["properties"]["a"] == {"type": "object", "properties": {"x": {"type": "integer"}}}  # a copy
    assert closed_schema_text("not json") == "not json"


OPEN = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string", "maxLength": 12}}}


@pytest.fixture(scope="module")
def engines():
    made = {}

    def get(backend: str, lenient: bool) -> LLM:
        if (backend, lenient) not in made:
            made[backend, lenient] = LLM(structured_outputs_backend=backend, structured_outputs_lenient_schemas=lenient,
                                         max_model_len=512, kv_cache_memory_gb=0.1, disable_log_stats=True)
        return made[backend, lenient]

    yield get
    for llm in made.values():
        llm.llm_engine.shutdown()


def _outputs(llm: LLM) -> list[str]:
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=40, structured_outputs=StructuredOutputsParams(json=OPEN))
              for s in range(6)]
    return [o.outputs[0].text for o in llm.generate(["Name a city, as JSON:"] * 6, params, use_tqdm=False)]


@pytest.mark.parametrize("backend", ["guidance", "xgrammar"])
def test_an_open_schema_yields_only_its_keys_by_default(engines, backend):
    for text in _outputs(engines(backend, False)):
        assert set(json.loads(text)) == {"city"}, text


def test_lenient_schemas_let_the_model_add_keys(engines):
    """The mode a user can ask for: JSON Schema's default, where other keys are allowed (here the
    model adds some in at least one of six samples, or runs out of tokens doing so)."""
    texts = _outputs(engines("guidance", True))
    def only_city(text: str) -> bool:
        try:
            return set(json.loads(text)) == {"city"}
        except ValueError:
            return False
    assert not all(only_city(t) for t in texts), texts
