"""StructuredOutputsParams: what a request's output must match (vLLM's shape), checked on construction.

Exactly one of `json` (a JSON schema, as a dict or JSON text), `json_object` (any JSON object), `regex`,
`grammar` (EBNF, xgrammar's GBNF dialect), `choice` (one of a list of strings) or `structural_tag`
(xgrammar's structural-tag format, as a dict or JSON text: e.g. free text with constrained tagged
sections, which is how strict tools are enforced under tool_choice=auto). Only the shape is checked
here; whether the schema / regex / grammar compiles is the compiler's answer (`compiler.py`), which the
engine asks before a request is scheduled. Nothing here imports xgrammar.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "grammar", "choice", "structural_tag")

# JSON-schema keywords xgrammar parses but does not enforce (checked with xgrammar 0.2.9: a violating
# output is accepted). A schema using one is refused instead of silently unconstrained.
UNSUPPORTED_SCHEMA_KEYWORDS = ("not", "if", "then", "else", "contains", "minContains", "maxContains",
                               "dependentSchemas", "unevaluatedProperties", "unevaluatedItems")
SUPPORTED_FORMATS = ("email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
                     "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer")


def _loads_if_text(value, field: str):
    """A JSON value given as text is parsed; a parse error names the field."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as e:
        raise _bad(f"{field} is not valid JSON: {e}") from None


def _bad(msg: str) -> ValueError:
    return ValueError(f"SamplingParams.structured_outputs: {msg}")


def check_schema_keywords(schema: Any, path: str = "#") -> None:
    """Raise ValueError naming the first keyword the grammar engine would not enforce."""
    if isinstance(schema, list):
        for i, s in enumerate(schema):
            check_schema_keywords(s, f"{path}/{i}")
        return
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        if key in UNSUPPORTED_SCHEMA_KEYWORDS:
            raise _bad(f"JSON schema keyword {key!r} at {path} is not supported by constrained decoding")
        if key == "allOf" and isinstance(value, list) and len(value) > 1:
            raise _bad(f"JSON schema keyword 'allOf' with several subschemas at {path} is not supported")
        if key == "format" and isinstance(value, str) and value not in SUPPORTED_FORMATS:
            raise _bad(f"JSON schema string format {value!r} at {path} is not supported "
                       f"(supported: {', '.join(SUPPORTED_FORMATS)})")
        if key in ("properties", "patternProperties", "$defs", "definitions", "dependentRequired"):
            if isinstance(value, dict):
                for name, sub in value.items():
                    check_schema_keywords(sub, f"{path}/{key}/{name}")
        elif key not in ("enum", "const", "required", "examples", "default"):
            check_schema_keywords(value, f"{path}/{key}")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict | bool | None = None
    json_object: bool | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | None = None
    structural_tag: dict | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise _bad(f"give exactly one of {', '.join(KINDS)}; got {given or 'none'}")
        kind = given[0]
        if kind == "json":
            schema = _loads_if_text(self.json, "json")
            if not isinstance(schema, (dict, bool)):
                raise _bad(f"json must be a JSON schema (an object), got {type(schema).__name__}")
            check_schema_keywords(schema)
            object.__setattr__(self, "json", schema)
        elif kind == "structural_tag":
            tag = _loads_if_text(self.structural_tag, "structural_tag")
            if not isinstance(tag, dict):
                raise _bad("structural_tag must be an object (xgrammar's structural-tag format)")
            object.__setattr__(self, "structural_tag", tag)
        elif kind == "json_object" and self.json_object is not True:
            raise _bad("json_object must be true")
        elif kind in ("regex", "grammar") and (not isinstance(getattr(self, kind), str) or not getattr(self, kind)):
            raise _bad(f"{kind} must be a non-empty string")
        elif kind == "choice":
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise _bad("choice must be a non-empty list of strings")
            if any(not isinstance(c, str) or c == "" for c in self.choice):
                raise _bad("choice must hold non-empty strings only")
            object.__setattr__(self, "choice", tuple(self.choice))

    @classmethod
    def from_any(cls, value: "StructuredOutputsParams | dict") -> "StructuredOutputsParams":
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise _bad(f"must be a dict like {{'json': schema}}, got {type(value).__name__}")
        unknown = sorted(set(value) - set(KINDS))
        if unknown:
            raise _bad(f"unknown key(s) {unknown}; known: {', '.join(KINDS)}")
        return cls(**value)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as canonical text (sorted-key JSON for schemas)."""
        v = getattr(self, self.kind)
        if self.kind in ("json", "structural_tag"):
            return json.dumps(v, sort_keys=True, ensure_ascii=False)
        if self.kind == "choice":
            return json.dumps(list(v), ensure_ascii=False)
        return "" if self.kind == "json_object" else v

    @property
    def key(self) -> str:
        """Hash of (kind, canonical spec): the grammar half of the compile cache key."""
        return hashlib.sha256(f"{self.kind}\0{self.spec}".encode()).hexdigest()

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other) -> bool:
        return isinstance(other, StructuredOutputsParams) and self.key == other.key
