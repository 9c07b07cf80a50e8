"""Structured output with the real SmolLM2: every constrained output parses and validates (jsonschema,
re.fullmatch, the grammar's language), through LLM and through the real openai / anthropic clients; grammars
compile once; bad grammars are 400s and the server keeps serving."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import anthropic
import httpx
import jsonschema
import openai
import pytest
import torch

from openinfer import SamplingParams
from openinfer.engine.scheduler import Scheduler
from openinfer.kv_cache.kv_cache_manager import KVCacheManager
from openinfer.outputs import RequestMetrics
from openinfer.request import Request
from openinfer.sampling.bitmask import GrammarBitmask, apply_token_bitmask
from openinfer.structured_output.manager import GrammarState
from openinfer.structured_output.params import StructuredOutputsParams
from tests.conftest import assert_pool_idle
from tests.live_server import LiveServer

PERSON = {"type": "object", "properties": {
    "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"]}},
    "required": ["person"]}
COLORS = {"type": "object", "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                      "minItems": 1, "maxItems": 3}},
          "required": ["colors"]}
PRODUCT = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                            "price": {"type": "integer", "minimum": 1, "maximum": 99},
                                            "in_stock": {"type": "boolean"}},
           "required": ["code", "price", "in_stock"]}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
SQL = '''root ::= "SELECT " cols " FROM " table where? ";"
cols ::= col (", " col)?
col ::= "id" | "name" | "age"
table ::= "users" | "orders"
where ::= " WHERE " col " = " [0-9] [0-9]?'''
SQL_RE = r"SELECT (id|name|age)(, (id|name|age))? FROM (users|orders)( WHERE (id|name|age) = [0-9][0-9]?)?;"
EOS = 2   # SmolLM2's <|im_end|>


def _obj(**props) -> dict:
    """An object schema as OpenAI's strict mode wants it: every property required, no others."""
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


# ---- params: bad shapes are ValueErrors naming the field, before any engine work --------------------------
@pytest.mark.parametrize("bad, reason", [
    ({"choice": []}, "choice"), ({"regex": ""}, "regex"), ({"json": "{not json"}, "not valid JSON"),
    ({"json": {"type": "object", "not": {"required": ["a"]}}}, "'not'"),
    ({"json": {"type": "string", "format": "credit-card"}}, "format"),
    ({"regex": "a", "choice": ["b"]}, "exactly one"), ({"xml": "<a/>"}, "unknown key"),
])
def test_bad_structured_outputs_are_value_errors_naming_the_field(bad, reason):
    with pytest.raises(ValueError, match="structured_outputs") as e:
        SamplingParams(structured_outputs=bad)
    assert reason in str(e.value)


def test_so_args_is_an_alias():
    p = SamplingParams(so_args={"choice": ["a", "b"]})
    assert p.structured_outputs == StructuredOutputsParams(choice=["a", "b"]) and p.so_args is None
    with pytest.raises(ValueError, match="alias"):
        SamplingParams(so_args={"choice": ["a"]}, structured_outputs={"choice": ["a"]})


# (schema, a value the schema forbids that xgrammar 0.2.9 accepts anyway, the keyword the refusal names)
IGNORED_BY_XGRAMMAR = [
    ({"maxLength": 2}, '"abc"', "maxLength"),                                    # no "type": "string" beside it
    ({"minimum": 3}, "2", "minimum"),
    ({"pattern": "^a+$"}, '"b"', "pattern"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]", "uniqueItems"),
    ({"type": "number", "multipleOf": 0.5}, "1.3", "multipleOf"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 2}, '"aaa"', "maxLength"),
    ({"type": "string", "format": "date", "minLength": 20}, '"2020-01-02"', "minLength"),
    ({"type": "integer", "minimum": 3, "anyOf": [{"type": "integer", "maximum": 10}]}, "2", "minimum"),
    ({"$defs": {"x": {"type": "object", "properties": {"a": {"type": "integer"}}}}, "$ref": "#/$defs/x",
      "required": ["a"]}, "{}", "required"),
    ({"type": "string", "enum": ["a", "abc"], "minLength": 2}, '"a"', "minLength"),
    ({"type": "string", "enum": ["a", 1]}, "1", "type"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]}, '{"a": 1}', "required"),
    ({"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]}, "1", "oneOf"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, '{"a": 1}', "dependentRequired"),
]


@pytest.mark.parametrize("schema, violating, keyword", IGNORED_BY_XGRAMMAR)
def test_keywords_the_grammar_would_ignore_are_refused(schema, violating, keyword):
    """Each refusal is backed by xgrammar accepting a value the schema forbids (if xgrammar starts enforcing one,
    this fails and the keyword can be let through)."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(violating), schema)
    assert _is_grammar_accept_string(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False), violating)
    with pytest.raises(ValueError, match=f"keyword '{re.escape(keyword)}' at #"):
        SamplingParams(structured_outputs={"json": schema})


@pytest.mark.parametrize("schema", [
    PERSON, COLORS, PRODUCT,
    {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None, "title": "Optional"},
    {"$defs": {"C": {"enum": ["a", "b"], "type": "string"}}, "type": "object",
     "properties": {"c": {"$ref": "#/$defs/C", "description": "annotations may stand beside $ref"}}, "required": ["c"]},
    {"oneOf": [_obj(kind={"const": "cat"}, lives={"type": "integer"}), _obj(kind={"const": "dog"})],
     "discriminator": {"propertyName": "kind"}},
    {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]},
    {"type": ["string", "null"], "maxLength": 3}, {"type": "integer", "multipleOf": 3},
    {"items": {"type": "integer"}, "minItems": 1}, {"properties": {"a": {"type": "integer"}}, "required": ["a"]},
])
def test_schemas_the_grammar_enforces_pass_the_check(schema):
    SamplingParams(structured_outputs={"json": schema})


def test_bitmask_apply_is_one_batched_op_over_the_sampler_rows():
    v = 70
    mask = torch.zeros(1, 3, dtype=torch.int32)
    mask[0, 0] = 1 << 5                      # only token 5 allowed
    mask[0, 2] = 1 << (65 - 64)              # and token 65
    bm = GrammarBitmask({("b", 0): 0}, mask).for_batch([("a", 0), ("b", 0)])
    logits = torch.randn(2, v)
    before = logits.clone()
    apply_token_bitmask(logits, bm)
    assert torch.equal(logits[0], before[0])                       # unconstrained row untouched
    allowed = (logits[1] > float("-inf")).nonzero().flatten().tolist()
    assert allowed == [5, 65]


# ---- compilation: once per grammar, errors named, requests wait without holding up others ----------------
def test_concurrent_submits_compile_once_and_errors_name_the_problem(llm):
    pool = llm.engine.structured_output.pool
    schema = StructuredOutputsParams(json={"type": "object", "properties": {"n": {"type": "integer"}},
                                           "required": ["n"], "title": f"once-{time.time_ns()}"})
    before = pool.num_compiles
    with ThreadPoolExecutor(8) as ex:
        futs = list(ex.map(lambda _: pool.submit(schema), range(8)))
    assert pool.num_compiles == before + 1 and all(f is futs[0] for f in futs)
    futs[0].result(timeout=30)
    t0 = time.perf_counter()
    pool.compile_blocking(schema)                     # cached: no new compile
    assert pool.num_compiles == before + 1 and time.perf_counter() - t0 < 0.05
    for bad, reason in [({"regex": "a(b"}, "parenthesis"), ({"grammar": 'root ::= "a" |'}, "EBNF"),
                        ({"json": {"type": 5}}, "Type")]:
        with pytest.raises(ValueError, match=reason):
            pool.compile_blocking(StructuredOutputsParams(**bad))


def _request(rid: str, grammar=None) -> Request:
    r = Request(rid, [1, 2, 3], SamplingParams(max_tokens=4), RequestMetrics(time.time()))
    r.grammar = grammar
    return r


def test_a_request_waiting_for_its_grammar_does_not_hold_up_the_queue():
    sched = Scheduler(KVCacheManager(16, 4, True), max_num_seqs=8, max_num_batched_tokens=64)
    compiling = Future()
    state = GrammarState(StructuredOutputsParams(regex="a+"), compiling, timeout_s=60)
    first, second = _request("g", state), _request("plain")
    sched.add(first)
    sched.add(second)
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["plain"]
    assert list(sched.waiting) == [first]                      # kept its place
    compiling.set_result(object())
    sched.update_after_step(out.scheduled)
    assert [s.request.request_id for s in sched.schedule().scheduled] == ["plain", "g"]   # admitted once ready


def test_a_grammar_compile_past_the_timeout_is_an_error():
    state = GrammarState(StructuredOutputsParams(regex="a+"), Future(), timeout_s=0.01)
    assert state.error() is None
    time.sleep(0.03)
    assert "did not compile within" in state.error()


# ---- LLM: every output valid, ended by EOS in an accepting state ----------------------------------------
def test_llm_outputs_match_their_constraints(llm):
    ask = lambda text: [{"role": "user", "content": text}]  # noqa: E731
    cases = [  # (conversation, structured_outputs, sampling)
        (ask("Describe a person as JSON."), {"json": PERSON}, dict(temperature=0)),
        (ask("List some colors as JSON."), {"json": COLORS}, dict(temperature=1.0, seed=3)),
        (ask("Give a product record as JSON."), {"json": PRODUCT}, dict(temperature=0)),
        (ask('Reply with this JSON: {"ok": true}'), {"json_object": True}, dict(temperature=0)),
        (ask("What is your phone number?"), {"regex": PHONE}, dict(temperature=1.0, seed=1)),
        (ask("Write an SQL query over users."), {"grammar": SQL}, dict(temperature=0.7, seed=2)),
        (ask("Is the sky blue? Answer yes or no."), {"choice": ["yes", "no", "maybe"]}, dict(temperature=1.0, seed=0)),
    ]
    outs = llm.chat([c for c, _, _ in cases],
                    [SamplingParams(max_tokens=48, structured_outputs=so, **kw) for _, so, kw in cases], use_tqdm=False)
    for (_, so, _), o in zip(cases, outs):
        c = o.outputs[0]
        assert c.finish_reason == "stop" and c.token_ids[-1] == EOS, (so, c.text)   # EOS, accepting state
        if "json" in so:
            jsonschema.validate(json.loads(c.text), so["json"])
        elif "json_object" in so:
            assert isinstance(json.loads(c.text), dict)
        elif "regex" in so:
            assert re.fullmatch(PHONE, c.text), c.text
        elif "grammar" in so:
            assert re.fullmatch(SQL_RE, c.text), c.text
        else:
            assert c.text in so["choice"]
    assert_pool_idle(llm.engine)


def test_max_tokens_mid_structure_reports_length(llm):
    o = llm.generate(["Data:"], SamplingParams(temperature=0, max_tokens=3, structured_outputs={"json": PERSON}),
                     use_tqdm=False)[0].outputs[0]
    assert o.finish_reason == "length" and len(o.token_ids) == 3
    with pytest.raises(ValueError):
        json.loads(o.text)


def test_llm_rejects_a_bad_grammar_before_queueing_anything(llm):
    with pytest.raises(ValueError, match="regex"):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=2),
                                  SamplingParams(max_tokens=2, structured_outputs={"regex": "(["})], use_tqdm=False)
    assert_pool_idle(llm.engine)


# ---- the server, with the real clients -------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(smollm_dir):
    with LiveServer(str(smollm_dir), served_model_name="smollm2", max_num_seqs=16, block_size=16) as s:
        yield s


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone", "strict": True,
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 16}},
                   "required": ["tz"], "additionalProperties": False}}}


def test_openai_response_format_and_strict_tools(server, oai):
    user = [{"role": "user", "content": "What's the weather in Paris? Answer in JSON."}]
    echo = [{"role": "user", "content": 'Reply with this JSON: {"ok": true}'}]
    calls = {
        "schema": dict(response_format={"type": "json_schema",
                                        "json_schema": {"name": "product", "schema": PRODUCT, "strict": True}}),
        "object": dict(response_format={"type": "json_object"}),
        "required": dict(tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required"),
        "named": dict(tools=[WEATHER_TOOL, TIME_TOOL], tool_choice={"type": "function", "function": {"name": "get_time"}}),
    }
    with ThreadPoolExecutor(len(calls)) as ex:   # concurrently: they share decode steps
        futs = {k: ex.submit(oai.chat.completions.create, model="smollm2", messages=echo if k == "object" else user,
                             max_tokens=40,
                             temperature=0, **kw) for k, kw in calls.items()}
        res = {k: f.result() for k, f in futs.items()}
    jsonschema.validate(json.loads(res["schema"].choices[0].message.content), PRODUCT)
    assert isinstance(json.loads(res["object"].choices[0].message.content), dict)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER_TOOL, TIME_TOOL)}
    for k in ("required", "named"):
        choice = res[k].choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0].function
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    assert res["named"].choices[0].message.tool_calls[0].function.name == "get_time"

    # streaming: the call arrives as tool_call deltas whose arguments assemble to valid JSON
    chunks = list(oai.chat.completions.create(model="smollm2", messages=user, max_tokens=40, temperature=0,
                                              stream=True, **calls["named"]))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_time"
    jsonschema.validate(json.loads("".join(d.function.arguments or "" for d in deltas)), schemas["get_time"])
    assert server.wait_idle()


# one schema per keyword family, and a question that pulls the model past its bounds (unconstrained, SmolLM2 lists
# dozens of colors and writes long names)
KEYWORD_FAMILIES = {
    "arrays": ("List twenty colors as JSON.",
               _obj(colors={"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 2,
                            "maxItems": 3})),
    "strings": ("Give a very long name as JSON.",
                _obj(name={"type": "string", "minLength": 3, "maxLength": 6},
                     city={"type": "string", "minLength": 2, "maxLength": 5})),
    "numbers": ("Give an age and a score as JSON.",
                _obj(age={"type": "integer", "minimum": 18, "maximum": 30},
                     score={"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1})),
    "patterns": ("Give a product code as JSON.",
                 _obj(code={"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                      phone={"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"})),
}


@pytest.mark.parametrize("family", list(KEYWORD_FAMILIES))
def test_strict_schemas_are_enforced_as_the_client_sent_them(server, oai, family):
    """deepseek-recipe normalises a strict schema as OpenAI's strict mode does, dropping minItems / maxItems /
    minLength / maxLength; the server compiles the body's schema instead (before: 60+ colors under maxItems 3)."""
    question, schema = KEYWORD_FAMILIES[family]
    rf = {"type": "json_schema", "json_schema": {"name": family, "schema": schema, "strict": True}}
    with ThreadPoolExecutor(4) as ex:
        rs = list(ex.map(lambda seed: oai.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": question}], max_tokens=60, temperature=1.0,
            seed=seed, response_format=rf), range(4)))
    for r in rs:
        c = r.choices[0]
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), schema)


def test_strict_tool_parameters_and_responses_schemas_are_enforced_as_sent(server, oai):
    tags = {"type": "function", "function": {"name": "tag_article", "description": "Tag an article", "strict": True,
                                             "parameters": _obj(tags={"type": "array", "minItems": 1, "maxItems": 2,
                                                                      "items": {"type": "string", "minLength": 3,
                                                                                "maxLength": 8}})}}
    user = [{"role": "user", "content": "Tag this article about cooking pasta with twenty tags."}]
    with ThreadPoolExecutor(3) as ex:
        rs = list(ex.map(lambda seed: oai.chat.completions.create(
            model="smollm2", messages=user, max_tokens=60, temperature=1.0, seed=seed, tools=[tags],
            tool_choice="required"), range(3)))
    for r in rs:
        call = r.choices[0].message.tool_calls[0].function
        assert r.choices[0].finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.arguments), tags["function"]["parameters"])
    question, schema = KEYWORD_FAMILIES["arrays"]
    body = {"model": "smollm2", "input": question, "max_output_tokens": 60, "temperature": 1.0,
            "text": {"format": {"type": "json_schema", "name": "colors", "schema": schema, "strict": True}}}
    r = httpx.post(server.base_url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    text = "".join(part["text"] for item in r.json()["output"] if item["type"] == "message" for part in item["content"])
    jsonschema.validate(json.loads(text), schema)
    assert server.wait_idle()


def test_n_choices_each_make_their_own_tool_call(server, oai):
    """Models without a tool format: each choice's constrained JSON call becomes that choice's tool call."""
    r = oai.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                    max_tokens=40, temperature=1.0, seed=3, n=3, tools=[WEATHER_TOOL],
                                    tool_choice="required")
    assert [c.index for c in r.choices] == [0, 1, 2]
    args = []
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
        args.append(json.loads(c.message.tool_calls[0].function.arguments))
        jsonschema.validate(args[-1], WEATHER_TOOL["function"]["parameters"])
    assert len({json.dumps(a, sort_keys=True) for a in args}) > 1       # sampled independently
    assert server.wait_idle()


@pytest.mark.parametrize("schema, keyword", [
    (_obj(tags={"type": "array", "items": {"type": "string"}, "uniqueItems": True}), "uniqueItems"),
    (_obj(x={"type": "number", "multipleOf": 0.5}), "multipleOf"),
    (_obj(s={"type": "string", "pattern": "^a+$", "maxLength": 3}), "maxLength"),
    (_obj(v={"anyOf": [{"type": "integer"}, {"type": "number"}], "minimum": 0}), "minimum"),
])
def test_keywords_the_grammar_cannot_enforce_are_400s_naming_them(server, schema, keyword):
    """In response_format and in strict tools alike (the recipe would have dropped or kept them silently)."""
    base = {"model": "smollm2", "messages": [{"role": "user", "content": "json"}], "max_tokens": 4}
    for param, extra in [
        ("response_format", {"response_format": {"type": "json_schema",
                                                 "json_schema": {"name": "x", "schema": schema, "strict": True}}}),
        ("tools", {"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": schema}}],
                   "tool_choice": "required"}),
    ]:
        for stream in (False, True):
            r = httpx.post(f"{server.base_url}/v1/chat/completions", json={**base, **extra, "stream": stream},
                           timeout=60)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == param and f"'{keyword}'" in err["message"], err
    assert server.wait_idle()


def test_anthropic_tool_choice_gives_a_valid_tool_use(server):
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused")
    tool = {"name": "get_weather", "description": "Current weather in a city",
            "input_schema": WEATHER_TOOL["function"]["parameters"]}
    msg = client.messages.create(model="smollm2", max_tokens=40, tools=[tool],
                                 tool_choice={"type": "tool", "name": "get_weather"},
                                 messages=[{"role": "user", "content": "Weather in Rome?"}])
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, tool["input_schema"])
    # {"type": "any"}: some tool must be called
    clock = {"name": "get_time", "description": "Current time in a timezone",
             "input_schema": TIME_TOOL["function"]["parameters"]}
    msg = client.messages.create(model="smollm2", max_tokens=40, tools=[tool, clock], tool_choice={"type": "any"},
                                 messages=[{"role": "user", "content": "Hello there!"}])
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and len(uses) == 1
    jsonschema.validate(uses[0].input, {"get_weather": tool, "get_time": clock}[uses[0].name]["input_schema"])


def test_anthropic_structured_output_is_enforced(server):
    """Anthropic's structured outputs (`output_config.format`, and the beta `output_format`): deepseek-recipe does
    not read them, so the server takes the schema from the body rather than answer unconstrained."""
    question, schema = KEYWORD_FAMILIES["arrays"]
    base = {"model": "smollm2", "max_tokens": 60, "temperature": 1.0,
            "messages": [{"role": "user", "content": question}]}
    for extra in ({"output_config": {"format": {"type": "json_schema", "schema": schema}}},
                  {"output_format": {"type": "json_schema", "schema": schema}}):
        r = httpx.post(server.base_url + "/v1/messages", json={**base, **extra}, timeout=60)
        assert r.status_code == 200, r.text
        text = "".join(b["text"] for b in r.json()["content"] if b["type"] == "text")
        jsonschema.validate(json.loads(text), schema)
    bad = {"type": "json_schema", "schema": _obj(t={"type": "array", "items": {"type": "string"}, "uniqueItems": True})}
    r = httpx.post(server.base_url + "/v1/messages", json={**base, "output_config": {"format": bad}}, timeout=60)
    assert r.status_code == 400 and "'uniqueItems'" in r.json()["error"]["message"]


def test_completions_regex_and_choice(server, oai):
    r = oai.completions.create(model="smollm2", prompt="Call me at", max_tokens=20, temperature=1.0, seed=5,
                               extra_body={"structured_outputs": {"regex": PHONE}})
    assert re.fullmatch(PHONE, r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = oai.completions.create(model="smollm2", prompt="Pick a color:", max_tokens=5, temperature=1.0, seed=5,
                               extra_body={"structured_outputs": {"choice": ["red", "blue"]}})
    assert r.choices[0].text in ("red", "blue")


def test_concurrent_requests_with_one_schema_compile_it_once(server, oai):
    pool = server.engine.structured_output.pool
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "title": f"shared-{time.time_ns()}"}
    before = pool.num_compiles
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    with ThreadPoolExecutor(6) as ex:
        rs = list(ex.map(lambda i: oai.chat.completions.create(
            model="smollm2", max_tokens=12, temperature=1.0, seed=i, response_format=rf,
            messages=[{"role": "user", "content": f"JSON please ({i})"}]), range(6)))
    assert pool.num_compiles == before + 1
    for r in rs:
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


@pytest.mark.parametrize("route, extra, reason", [
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "schema"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}}, "'not'"),
    ("completions", {"structured_outputs": {"regex": "a(b"}}, "parenthesis"),
    ("completions", {"structured_outputs": {"grammar": "root ::= (\"a\""}}, "EBNF"),
    ("completions", {"structured_outputs": {"choice": []}}, "choice"),
    ("completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}}, "Type"),
])
def test_bad_grammars_are_400_and_the_server_keeps_serving(server, route, extra, reason):
    if route == "chat":
        body = {"model": "smollm2", "messages": [{"role": "user", "content": "json"}], "max_tokens": 4, **extra}
    else:
        body = {"model": "smollm2", "prompt": "x", "max_tokens": 4, **extra}
    for stream in (False, True):
        r = httpx.post(f"{server.base_url}/v1/{'chat/completions' if route == 'chat' else 'completions'}",
                       json={**body, "stream": stream}, timeout=60)
        assert r.status_code == 400 and reason in r.json()["error"]["message"], r.text
    ok = httpx.post(f"{server.base_url}/v1/completions", json={"model": "smollm2", "prompt": "Hi", "max_tokens": 2},
                    timeout=60)
    assert ok.status_code == 200
    assert server.wait_idle()


# ---- DeepSeek models: constraints through the recipe's encoding and DSML tool calls ---------------------
@pytest.fixture(scope="module")
def ds_server(tmp_path_factory):
    from tests.test_server_deepseek import make_scripted_model

    path = tmp_path_factory.mktemp("ds-structured")
    make_scripted_model(path)          # a tiny model scripted to say "Hello world": the grammar must win
    with LiveServer(str(path), served_model_name="DeepSeek-V4-Pro", max_num_seqs=8, block_size=16) as s:
        yield s


def test_deepseek_required_tool_call_is_a_valid_dsml_call(ds_server):
    client = openai.OpenAI(base_url=ds_server.base_url + "/v1", api_key="x")
    tool = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,5}$"},   # strict
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},     # drops maxLength
        "required": ["city", "days"], "additionalProperties": False}}}
    r = client.chat.completions.create(model="DeepSeek-V4-Pro", messages=[{"role": "user", "content": "Weather?"}],
                                       max_tokens=400, temperature=0, tools=[tool], tool_choice="required",
                                       extra_body={"thinking": {"type": "disabled"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", (choice, r.usage)
    assert choice.message.tool_calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), tool["function"]["parameters"])


def test_deepseek_response_format_with_and_without_thinking(ds_server):
    client = openai.OpenAI(base_url=ds_server.base_url + "/v1", api_key="x")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}
    r = client.chat.completions.create(model="DeepSeek-V4-Pro", messages=[{"role": "user", "content": "json"}],
                                       max_tokens=100, temperature=0, response_format=rf,
                                       extra_body={"thinking": {"type": "disabled"}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)    # not "Hello world"
    # thinking mode: the reasoning is free (the scripted "Let me think"), the answer follows the schema
    r = client.chat.completions.create(model="DeepSeek-V4-Pro", messages=[{"role": "user", "content": "json"}],
                                       max_tokens=100, temperature=0, response_format=rf)
    assert r.choices[0].message.model_extra["reasoning_content"] == "Let me think"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    assert ds_server.wait_idle()


def test_strict_tools_under_auto_constrain_only_the_dsml_invokes(ds_server):
    """tool_choice=auto with strict tools (DeepSeek): text is free, an invoke must follow its tool's schema."""
    import xgrammar as xgr

    from openinfer.structured_output.tool_calls import dsml_strict_tools_tag

    tool = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,5}$"},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
    pool = ds_server.engine.structured_output.pool
    compiled = pool.compile_blocking(StructuredOutputsParams(structural_tag=dsml_strict_tools_tag([tool])))
    call = ('<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="days" string="false">{}</｜DSML｜parameter>\n</｜DSML｜invoke>')

    def accepts(text: str) -> bool:
        m = xgr.GrammarMatcher(compiled)
        return m.accept_string(text) and m.is_completed()
    assert accepts("Let me look.\n\n<｜DSML｜tool_calls>\n" + call.format(3) + "\n</｜DSML｜tool_calls>")
    assert accepts("No tool needed: it is sunny.")
    assert not accepts("<｜DSML｜tool_calls>\n" + call.format(9))          # days > maximum
    # through the server: the scripted answer is plain text, which the constraint leaves alone
    client = openai.OpenAI(base_url=ds_server.base_url + "/v1", api_key="x")
    r = client.chat.completions.create(model="DeepSeek-V4-Pro", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=20, tools=[tool])
    assert r.choices[0].message.content == "Hello world" and r.choices[0].finish_reason == "stop"


def test_engine_a_bad_grammar_aborts_its_request_and_nothing_else(llm):
    """Through LLMEngine directly (no pre-compile): the grammar compiles after add_request returns, so the
    failure shows at a step, as an aborted request naming the problem; the request beside it completes."""
    eng = llm.engine
    ok = eng.add_request([1, 2, 3], SamplingParams(max_tokens=2, temperature=0))
    try:
        bad = eng.add_request([1, 2, 3], SamplingParams(max_tokens=2, structured_outputs={
            "regex": f"(unclosed{time.time_ns()}"}))
    except ValueError as e:            # already compiled (and failed) by the time add_request looked
        assert "parenthesis" in str(e)
        bad = None
    done = {}
    for _ in range(50):
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        if ok in done and (bad is None or bad in done):
            break
    assert done[ok].outputs[0].finish_reason == "length"
    if bad is not None:
        assert done[bad].outputs[0].finish_reason == "abort" and "parenthesis" in done[bad].outputs[0].stop_reason
        assert done[bad].outputs[0].token_ids == []
    assert_pool_idle(eng)
