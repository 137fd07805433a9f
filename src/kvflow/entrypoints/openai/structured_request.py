"""The request fields that constrain the output, as OpenAI and vLLM's clients send them.

- OpenAI: `response_format` = {"type": "text"} | {"type": "json_object"} |
  {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}};
- vLLM: `structured_outputs` = {"json" | "regex" | "choice" | "grammar" | "json_object": ...},
  and its older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

A request may use one of them; they all become one `StructuredOutputsParams`. Whether the schema,
regex or grammar compiles is checked later, off the engine thread (a 400 if not).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvflow.entrypoints.openai.json_depth import check_depth
from kvflow.sampling_params import StructuredOutputsParams


def _bounded_schema_text(schema: dict | str | None) -> dict | str | None:
    """A schema given as JSON text is parsed later (StructuredOutputsParams): bound its nesting
    now, as the body's parser bounded a schema given as an object."""
    return check_depth(schema) if isinstance(schema, str) else schema


class _Part(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)


class JsonSchemaFormat(_Part):
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")  # none: any JSON object
    strict: bool | None = None  # the output always matches the schema, strict or not


class ResponseFormat(_Part):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a json_schema response format needs its json_schema object")
        return self


class StructuredOutputsField(_Part):
    """vLLM's `structured_outputs` extra field."""

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    _bounded_json = field_validator("json_")(_bounded_schema_text)


class StructuredOutputFields(BaseModel):
    """Mixed into the chat and completion request bodies."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    _bounded_guided_json = field_validator("guided_json")(_bounded_schema_text)

    @model_validator(mode="after")
    def _one_constraint(self):
        given = [name for name, value in self._constraints().items() if value is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one of {', '.join(given)}: each constrains the whole output")
        return self

    def _constraints(self) -> dict[str, Any]:
        fmt = self.response_format
        return {
            "response_format": None if fmt is None or fmt.type == "text" else fmt,
            "structured_outputs": self.structured_outputs,
            "guided_json": self.guided_json,
            "guided_regex": self.guided_regex,
            "guided_choice": self.guided_choice,
            "guided_grammar": self.guided_grammar,
        }

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The constraint, or None; ValueError (naming the field) if its shape is wrong."""
        name, value = next(((n, v) for n, v in self._constraints().items() if v is not None), (None, None))
        try:
            if name is None:
                return None
            if name == "response_format":
                schema = value.json_schema.schema_ if value.type == "json_schema" else None
                return StructuredOutputsParams(json=schema) if schema is not None else StructuredOutputsParams(json_object=True)
            if name == "structured_outputs":
                return StructuredOutputsParams(json=value.json_, regex=value.regex, choice=value.choice,
                                               grammar=value.grammar, json_object=value.json_object)
            kind = name.removeprefix("guided_")
            return StructuredOutputsParams(**{kind: value})
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
