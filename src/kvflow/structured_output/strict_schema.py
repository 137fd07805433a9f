"""Closing JSON schemas: an object schema that says nothing of other keys allows none.

JSON Schema lets an object carry keys its `properties` do not name unless the schema says
`"additionalProperties": false`. A grammar built that way lets the model add key after key until
`max_tokens`: a client that asks for `{"city": ...}` (a tool's parameters, a pydantic model) gets
truncated JSON back. So kvflow compiles schemas strictly, as vLLM's default does (and xgrammar's
`strict_mode`): every object schema that names its `properties` but not `additionalProperties`
(nor `unevaluatedProperties`) gets `"additionalProperties": false`; a schema that asks for extra keys keeps them. The members of
an `allOf` stay open, since each declares only part of the keys the others may name.
`--structured-outputs-lenient-schemas` compiles schemas as they are written (xgrammar: its
`strict_mode` off).
"""

from __future__ import annotations

import json
from typing import Any

# Keywords whose value is a schema, a list of schemas, or a name → schema map.
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "additionalProperties",
        "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_MANY = ("prefixItems", "anyOf", "oneOf")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_schema_text(text: str) -> str:
    """The schema in `text` (JSON) with its object schemas closed; `text` as it is if it is not
    a JSON object (the grammar library reports what is wrong with it)."""
    try:
        schema = json.loads(text)
    except ValueError:
        return text
    return json.dumps(closed(schema)) if isinstance(schema, dict) else text


def closed(schema: Any, in_all_of: bool = False) -> Any:
    """A copy of `schema` whose object schemas forbid undeclared keys (the module's rule)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [closed(s) for s in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed(s, in_all_of=True) for s in out["allOf"]]
    for key in _NAMED:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(s) for name, s in out[key].items()}
    if not in_all_of and _is_object(out) and "additionalProperties" not in out \
            and "unevaluatedProperties" not in out and "allOf" not in out:
        out["additionalProperties"] = False
    return out


def _is_object(schema: dict) -> bool:
    """An object schema that declares its keys: one that names none (`{"type": "object"}`, any
    JSON object) stays open."""
    kind = schema.get("type", "object")
    return "properties" in schema and (kind == "object" or (isinstance(kind, list) and "object" in kind))
