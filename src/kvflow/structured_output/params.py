"""What a request asks its output to match, with vLLM's names: exactly one of `json` (a JSON
schema), `regex`, `choice`, `grammar` (EBNF/GBNF or Lark) or `json_object` (any JSON object).

Only the shape is checked here; whether the schema, regex or grammar compiles is the compiler's
question, answered before the request reaches the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint in canonical text: the compile cache's key."""

    kind: str  # one of KINDS
    text: str  # a JSON schema or choice list as compact JSON; a regex or grammar as given

    @property
    def label(self) -> str:
        return {"json": "the JSON schema", "regex": "the regex", "choice": "the choice list",
                "grammar": "the grammar", "json_object": "the JSON-object grammar"}[self.kind]


@dataclass
class StructuredOutputsParams:
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    spec: GrammarSpec = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) is not None]
        if self.json_object is False:  # vLLM's way of not asking for it
            given.remove("json_object")
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar or "
                             f"json_object; got {', '.join(given) or 'none'}")
        kind = given[0]
        self.spec = GrammarSpec(kind, _canonical_text(kind, getattr(self, kind)))


def _canonical_text(kind: str, value: Any) -> str:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object); got {type(value).__name__}")
        # Key order is kept: it is the order the properties are generated in.
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    if kind == "choice":
        if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) and c for c in value):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        return json.dumps(list(value), ensure_ascii=False)
    if kind == "json_object":
        if value is not True:
            raise ValueError(f"structured_outputs.json_object must be true; got {value!r}")
        return ""
    if not isinstance(value, str) or not value:
        raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
    return value
