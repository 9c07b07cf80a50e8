"""Enforced tool calls for models whose chat template has no tool-call format (SmolLM2 and other plain
chat models): the tools are described in a system message, the reply is constrained to one JSON object
`{"name": <a tool's name>, "arguments": <that tool's parameters schema>}`, and the server turns it into a
tool call by handing deepseek-recipe's parser the equivalent DSML invoke (the parser that produces
`tool_calls` / `tool_use` in every protocol), so responses keep one code path.
"""

from __future__ import annotations

import json

from openinfer.structured_output.params import check_schema_keywords

_DSML = "｜DSML｜"


def tool_call_schema(tools: list[dict]) -> dict:
    """JSON schema of one call to any of `tools` (Chat Completions function tools)."""
    calls = []
    for t in tools:
        f = t.get("function", t)
        params = f.get("parameters") or {"type": "object"}
        calls.append({"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": params},
                      "required": ["name", "arguments"], "additionalProperties": False})
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def tool_system_prompt(tools: list[dict]) -> str:
    specs = []
    for t in tools:
        f = t.get("function", t)
        specs.append(json.dumps({"name": f["name"], "description": f.get("description") or "",
                                 "parameters": f.get("parameters") or {"type": "object"}}, ensure_ascii=False))
    return ("You can call these tools:\n" + "\n".join(specs) + "\nCall one by answering with a JSON object "
            '{"name": <tool name>, "arguments": <its arguments>}.')


def json_call_to_dsml(text: str, opening: bool = False) -> str | None:
    """The DSML invoke (as DeepSeek models write it after the opening `tool_calls` tag, or with that tag when
    `opening`: the parser was not told the reply starts inside the block) of a JSON call; None if `text` is
    not a complete call (e.g. cut by max_tokens)."""
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(call.get("arguments"), dict):
        return None
    lines = ([f"<{_DSML}tool_calls>"] if opening else []) + [f'<{_DSML}invoke name="{call["name"]}">']
    for k, v in call["arguments"].items():
        if isinstance(v, str):
            lines.append(f'<{_DSML}parameter name="{k}" string="true">{v}</{_DSML}parameter>')
        else:
            lines.append(f'<{_DSML}parameter name="{k}" string="false">{json.dumps(v, ensure_ascii=False)}'
                         f'</{_DSML}parameter>')
    lines += [f"</{_DSML}invoke>", f"</{_DSML}tool_calls>"]
    return "\n".join(lines)


def _dsml_parameters(f: dict) -> "object":
    """xgrammar Grammar of a DSML invoke's parameter lines for function `f`: in schema order, optional ones
    optional, string parameters raw (`string="true"`, enum / const / pattern / minLength / maxLength enforced), the
    others JSON valid for their subschema. The schema is the client's, checked as any constrained schema is
    (`check_schema_keywords`: ValueError naming a keyword that would not be enforced); a raw string's `format` is
    refused too (raw strings are matched by enum / const / pattern / length only)."""
    import xgrammar as xgr

    def lit(text: str):
        return xgr.Grammar.from_ebnf("root ::= " + json.dumps(text, ensure_ascii=False))

    def raw_string(schema: dict):
        if "format" in schema:
            raise ValueError(f"tool {f.get('name')!r}: 'format' of a string parameter is not enforced in DeepSeek's "
                             f"DSML tool calls (use a pattern)")
        if "const" in schema:
            return lit(str(schema["const"]))
        if schema.get("enum"):
            return xgr.Grammar.union(*[lit(str(v)) for v in schema["enum"]])
        if schema.get("pattern"):
            return xgr.Grammar.from_regex(schema["pattern"].removeprefix("^").removesuffix("$"))
        lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
        return xgr.Grammar.from_regex(f"[^<]{{{lo},{int(hi)}}}" if hi is not None else f"[^<]{{{lo},}}")

    params = f.get("parameters") or {}
    check_schema_keywords(params)
    required = set(params.get("required", []))
    parts = [lit("")]
    for name, schema in (params.get("properties") or {}).items():
        schema = schema if isinstance(schema, dict) else {}
        is_str = schema.get("type") == "string"
        value = raw_string(schema) if is_str else xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
        p = xgr.Grammar.concat(lit(f'<{_DSML}parameter name="{name}" string="{"true" if is_str else "false"}">'),
                               value, lit(f"</{_DSML}parameter>\n"))
        parts.append(p if name in required else xgr.Grammar.union(p, lit("")))
    return xgr.Grammar.concat(*parts)


def dsml_tool_grammar(tools: list[dict]) -> str:
    """EBNF of one DSML tool call, as a DeepSeek model writes it after the `tool_calls` opening its prompt
    ends with (tool_choice required / named): an invoke of one of `tools` with parameters per
    `_dsml_parameters`, then the closing tags, after which only EOS is allowed. Built with xgrammar's
    grammar combinators."""
    import xgrammar as xgr

    def lit(text: str):
        return xgr.Grammar.from_ebnf("root ::= " + json.dumps(text, ensure_ascii=False))

    calls = []
    for t in tools:
        f = t.get("function", t)
        calls.append(xgr.Grammar.concat(lit(f'<{_DSML}invoke name="{f["name"]}">\n'), _dsml_parameters(f),
                                        lit(f"</{_DSML}invoke>\n</{_DSML}tool_calls>")))
    return str(calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls))


def dsml_strict_tools_tag(tools: list[dict]) -> dict:
    """xgrammar structural tag for strict tools under tool_choice=auto (DeepSeek models): any text (thinking,
    answer, the `tool_calls` opening) until a DSML invoke starts; inside an invoke of a listed tool the
    parameters follow its schema (`_dsml_parameters`); after `</invoke>` any text again."""
    tags = []
    for t in tools:
        f = t.get("function", t)
        tags.append({"type": "tag", "begin": f'<{_DSML}invoke name="{f["name"]}">\n',
                     "content": {"type": "grammar", "grammar": str(_dsml_parameters(f))},
                     "end": f"</{_DSML}invoke>"})
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [f"<{_DSML}invoke name="],
                                                 "tags": tags, "at_least_one": False, "stop_after_first": False}}
