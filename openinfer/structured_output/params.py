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
                               "dependentSchemas", "dependentRequired", "unevaluatedProperties", "unevaluatedItems",
                               "$dynamicRef", "$dynamicAnchor", "$recursiveRef", "$recursiveAnchor")
SUPPORTED_FORMATS = ("email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
                     "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer")
# Keywords that constrain one kind of value. xgrammar 0.2.9 enforces them only in a schema whose `type` names that
# kind (`{"maxLength": 2}` without `"type": "string"` accepts "abc"), or, for objects and arrays, one that
# `properties` / `additionalProperties` / `items` / `prefixItems` make an object / array schema.
KEYWORD_KINDS = {
    "minLength": ("string",), "maxLength": ("string",), "pattern": ("string",), "format": ("string",),
    "minimum": ("integer", "number"), "maximum": ("integer", "number"), "exclusiveMinimum": ("integer", "number"),
    "exclusiveMaximum": ("integer", "number"), "multipleOf": ("integer",),
    "minItems": ("array",), "maxItems": ("array",),
    "minProperties": ("object",), "maxProperties": ("object",), "required": ("object",),
    "patternProperties": ("object",), "propertyNames": ("object",),
}
_IMPLIES_KIND = {"properties": "object", "additionalProperties": "object", "items": "array", "prefixItems": "array"}
# keywords that constrain the value; the others are annotations (title, description, default, examples, ...)
VALIDATION_KEYWORDS = frozenset({*KEYWORD_KINDS, *_IMPLIES_KIND, "type", "enum", "const", "anyOf", "oneOf", "allOf",
                                 "$ref", "uniqueItems", "additionalItems"})
# xgrammar 0.2.9 enforces each of these alone: any other validation keyword beside one is ignored (`anyOf` with a
# `minimum` beside it, `$ref` with `required`, `enum` with `maxLength`, ...); `enum` / `const` may have a `type`
_EXCLUSIVE = ("anyOf", "oneOf", "allOf", "$ref", "enum", "const")
_ALL_KINDS = frozenset({"string", "integer", "number", "boolean", "null", "array", "object"})


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


def _refused(key: str, path: str, why: str) -> ValueError:
    return _bad(f"JSON schema keyword {key!r} at {path} is not enforced by constrained decoding: {why}")


def check_schema_keywords(schema: Any, path: str = "#") -> None:
    """Raise ValueError naming the first keyword the grammar engine (xgrammar 0.2.9) would not enforce: keywords it
    ignores, and keywords it ignores where they stand (see `_Enforceable`). What passes is enforced exactly, except
    that `pattern`s match whole strings (as if anchored) and objects with `properties` get no other keys unless
    `additionalProperties` / `patternProperties` allow them: outputs are then a subset of what the schema allows."""
    _check_unsupported(schema, path)
    _Enforceable(schema).visit(schema, path)


def _check_unsupported(schema: Any, path: str) -> None:
    if isinstance(schema, list):
        for i, s in enumerate(schema):
            _check_unsupported(s, f"{path}/{i}")
        return
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        if key in UNSUPPORTED_SCHEMA_KEYWORDS:
            raise _bad(f"JSON schema keyword {key!r} at {path} is not supported by constrained decoding")
        if key == "allOf" and isinstance(value, list) and len(value) > 1:
            raise _bad(f"JSON schema keyword 'allOf' with several subschemas at {path} is not supported")
        if key == "uniqueItems" and value is True:
            raise _refused(key, path, "items may repeat")
        if key == "format" and isinstance(value, str) and value not in SUPPORTED_FORMATS:
            raise _bad(f"JSON schema string format {value!r} at {path} is not supported "
                       f"(supported: {', '.join(SUPPORTED_FORMATS)})")
        if key in ("properties", "patternProperties", "$defs", "definitions"):
            if isinstance(value, dict):
                for name, sub in value.items():
                    _check_unsupported(sub, f"{path}/{key}/{name}")
        elif key not in ("enum", "const", "required", "examples", "default"):
            _check_unsupported(value, f"{path}/{key}")


def _kinds_of_value(v: Any) -> set[str]:
    if v is None:
        return {"null"}
    if isinstance(v, bool):
        return {"boolean"}
    if isinstance(v, int):
        return {"integer", "number"}
    if isinstance(v, float):
        return {"integer", "number"} if v.is_integer() else {"number"}
    if isinstance(v, str):
        return {"string"}
    return {"array"} if isinstance(v, list) else {"object"}


def _canonical(v: Any) -> str:
    return json.dumps(v, sort_keys=True)


class _Enforceable:
    """Where xgrammar 0.2.9 ignores a keyword because of what stands beside it (each rule found by compiling a
    schema and feeding it a violating value, which it accepted):
    - a kind-specific keyword (`KEYWORD_KINDS`) without a `type` naming its kind (nor, for objects and arrays, a
      keyword that makes the schema one): `{"minimum": 3}` accepts 2;
    - any validation keyword beside `anyOf` / `oneOf` / `allOf` / `$ref` / `enum` / `const` (only those are
      enforced), and `enum` / `const` values whose kind the schema's `type` excludes;
    - `multipleOf` of a `number` (enforced for integers only); `minLength` / `maxLength` beside `pattern` or
      `format` (only the pattern / format is enforced); a `required` name not in `properties`;
    - `oneOf` is enforced as `anyOf` (one or more subschemas match): refused unless its subschemas cannot both
      match (different kinds, different const / enum values, or a property both require with different const /
      enum values, a discriminator);
    - `$ref` other than a local JSON pointer (`#`, `#/...`)."""

    def __init__(self, root: Any):
        self.root = root

    def visit(self, s: Any, path: str) -> None:
        if not isinstance(s, dict):
            return
        excl = next((k for k in _EXCLUSIVE if k in s), None)
        if excl is not None:
            beside = sorted(k for k in s if k in VALIDATION_KEYWORDS and k != excl
                            and not (excl in ("enum", "const") and k == "type"))
            if beside:
                where = ("list only values that satisfy it" if excl in ("enum", "const") else
                         "move it into each subschema" if excl in ("anyOf", "oneOf", "allOf") else
                         "move it into the schema it names")
                raise _refused(beside[0], path, f"only {excl!r} beside it is ({where})")
        t = s.get("type")
        types = {t} if isinstance(t, str) else set(t) if isinstance(t, list) else None
        implied = {_IMPLIES_KIND[k] for k in s if k in _IMPLIES_KIND}
        for key in s:
            kinds = KEYWORD_KINDS.get(key)
            if kinds is not None and types is None and not implied.intersection(kinds):
                raise _refused(key, path, f'it needs "type": {kinds[0]!r} beside it')
        if "multipleOf" in s and types is not None and "number" in types:
            raise _refused("multipleOf", path, 'only integers are kept to multiples ("type": "integer")')
        if types is None or "string" in types:
            for key in ("minLength", "maxLength"):
                other = next((o for o in ("pattern", "format") if o in s), None)
                if key in s and other is not None:
                    raise _refused(key, path, f"beside {other!r} only the {other} is (fold the length into a "
                                              f"pattern)")
        if types is not None and ("enum" in s or "const" in s):
            values = s["enum"] if isinstance(s.get("enum"), list) else [s["const"]] if "const" in s else []
            for v in values:
                if not _kinds_of_value(v) & types:
                    raise _refused("type", path, f"the value {v!r} of its enum / const is not of type {t!r}")
        if isinstance(s.get("required"), list) and (types is None or "object" in types):
            props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
            missing = next((r for r in s["required"] if r not in props), None)
            if missing is not None:
                raise _refused("required", path, f"the required name {missing!r} is not in 'properties'")
        if "$ref" in s:
            ref = s["$ref"]
            if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
                raise _refused("$ref", path, f"only local references ('#/...') are followed, got {ref!r}")
        if isinstance(s.get("oneOf"), list):
            subs = s["oneOf"]
            for i in range(len(subs)):
                for j in range(i + 1, len(subs)):
                    if not self._disjoint(subs[i], subs[j]):
                        raise _refused("oneOf", path, f"it is treated as anyOf, and subschemas {i} and {j} may both "
                                                      f"match (use anyOf, or tell them apart by type or by a "
                                                      f"const / enum property both require)")
        for key in ("properties", "patternProperties", "$defs", "definitions"):
            if isinstance(s.get(key), dict):
                for name, sub in s[key].items():
                    self.visit(sub, f"{path}/{key}/{name}")
        for key in ("items", "additionalProperties", "additionalItems", "propertyNames"):
            self.visit(s.get(key), f"{path}/{key}")
        for key in ("prefixItems", "anyOf", "oneOf", "allOf"):
            if isinstance(s.get(key), list):
                for i, sub in enumerate(s[key]):
                    self.visit(sub, f"{path}/{key}/{i}")

    # ---- oneOf: can two subschemas both match? ------------------------------------------------------------------
    def _resolve(self, s: Any, depth: int = 0) -> Any:
        while isinstance(s, dict) and isinstance(s.get("$ref"), str) and depth < 32:
            ref, depth = s["$ref"], depth + 1
            if ref == "#":
                s = self.root
                continue
            if not ref.startswith("#/"):
                return None
            node = self.root
            for part in ref[2:].split("/"):
                part = part.replace("~1", "/").replace("~0", "~")
                node = node.get(part) if isinstance(node, dict) else None
            s = node
        return s

    def _values(self, s: Any) -> list | None:
        s = self._resolve(s)
        if not isinstance(s, dict):
            return None
        if "const" in s:
            return [s["const"]]
        return s["enum"] if isinstance(s.get("enum"), list) else None

    def _kinds(self, s: Any, depth: int = 0) -> set[str]:
        s = self._resolve(s)
        if s is False:
            return set()
        if not isinstance(s, dict) or depth > 16:
            return set(_ALL_KINDS)
        values = self._values(s)
        if values is not None:
            return set().union(*(_kinds_of_value(v) for v in values)) if values else set()
        t = s.get("type")
        if isinstance(t, (str, list)):
            kinds = {t} if isinstance(t, str) else set(t)
            return kinds | {"integer"} if "number" in kinds else kinds
        for key in ("anyOf", "oneOf", "allOf"):
            if isinstance(s.get(key), list):
                return set().union(*(self._kinds(b, depth + 1) for b in s[key]))
        implied = {_IMPLIES_KIND[k] for k in s if k in _IMPLIES_KIND}
        return implied or set(_ALL_KINDS)

    def _disjoint(self, a: Any, b: Any) -> bool:
        if not self._kinds(a) & self._kinds(b):
            return True
        va, vb = self._values(a), self._values(b)
        if va is not None and vb is not None:
            return not {_canonical(v) for v in va} & {_canonical(v) for v in vb}
        a, b = self._resolve(a), self._resolve(b)
        if not (isinstance(a, dict) and isinstance(b, dict)):
            return False
        pa, pb = a.get("properties"), b.get("properties")
        if not (isinstance(pa, dict) and isinstance(pb, dict)):
            return False
        common = set(a.get("required") or ()) & set(b.get("required") or ()) & set(pa) & set(pb)
        for name in common:
            xa, xb = self._values(pa[name]), self._values(pb[name])
            if xa is not None and xb is not None and not {_canonical(v) for v in xa} & {_canonical(v) for v in xb}:
                return True
        return False


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
