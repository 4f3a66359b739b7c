"""Output constraints on the wire: what a request's text must match (docs/architecture.md §6).

A request carries at most one. Each names its kind in `type` and compiles to one llguidance
grammar (`compiled()`); a constraint whose grammar does not compile fails validation with
llguidance's reason, so the producer, the gateway (a 400) and the batcher (a `rejected`
final chunk) all refuse it before a rank ever sees it.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Annotated, Any, Literal

from llguidance import LLMatcher
from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_CHOICES = 256


class _Constraint(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def compiled(self) -> str:
        """The llguidance grammar this constraint compiles to."""
        raise NotImplementedError

    @model_validator(mode="after")
    def _compiles(self) -> _Constraint:
        error = _grammar_error(self.compiled())
        if error:
            raise ValueError(f"{self.type} does not compile: {error}")  # type: ignore[attr-defined]
        return self


class JsonSchema(_Constraint):
    """A JSON value valid against `json_schema` (draft 2020-12 as llguidance reads it).
    `strict` as OpenAI means it: properties not listed are not allowed unless the schema
    allows them; a schema that does not say so is closed when `strict`."""

    type: Literal["json_schema"] = "json_schema"
    json_schema: dict[str, Any]
    strict: bool = False

    def compiled(self) -> str:
        options = {"whitespace_flexible": False}
        schema = _closed(self.json_schema) if self.strict else self.json_schema
        return _json_grammar(json.dumps(schema), json.dumps(options))


class JsonObject(_Constraint):
    """Any JSON object (OpenAI's "JSON mode")."""

    type: Literal["json_object"] = "json_object"

    def compiled(self) -> str:
        return _json_grammar('{"type": "object"}', '{"whitespace_flexible": false}')


class Regex(_Constraint):
    """Text matching `pattern` whole (Rust `regex` syntax, as llguidance reads it)."""

    type: Literal["regex"] = "regex"
    pattern: Annotated[str, Field(min_length=1, max_length=16_384)]

    def compiled(self) -> str:
        return LLMatcher.grammar_from_regex(self.pattern)


class Choice(_Constraint):
    """Exactly one of `choices`."""

    type: Literal["choice"] = "choice"
    choices: Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)]

    def compiled(self) -> str:
        return LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(choice) for choice in self.choices)
        )


class Grammar(_Constraint):
    """Text of a context-free grammar in llguidance's Lark syntax (`start:` is the top rule;
    `%json {...}` embeds a JSON schema)."""

    type: Literal["grammar"] = "grammar"
    grammar: Annotated[str, Field(min_length=1, max_length=65_536)]

    def compiled(self) -> str:
        return LLMatcher.grammar_from_lark(self.grammar)


Constraint = Annotated[
    JsonSchema | JsonObject | Regex | Choice | Grammar, Field(discriminator="type")
]


def _closed(schema: Any) -> Any:
    """`schema` with every object that does not say otherwise closed to unlisted
    properties (OpenAI's `strict`)."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _closed(value) for key, value in schema.items()}
    if out.get("type") == "object" or "properties" in out:
        out.setdefault("additionalProperties", False)
    return out


@lru_cache(maxsize=256)
def _json_grammar(schema: str, options: str) -> str:
    return LLMatcher.grammar_from_json_schema(schema, overrides=json.loads(options))


@lru_cache(maxsize=256)
def _grammar_error(grammar: str) -> str:
    """llguidance's reason a grammar does not compile, on one line; "" if it compiles."""
    lines = [line.strip() for line in LLMatcher.validate_grammar(grammar).splitlines()]
    kept = [lines[0], *(line for line in lines[1:] if line.startswith("error:"))] if lines else []
    return " ".join(kept)
