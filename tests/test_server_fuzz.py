"""Hypothesis-generated bad (and odd) request bodies: never a 5xx, every error well-formed."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.live_server import LiveServer

junk = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=True),
                 st.text(max_size=20), st.sampled_from(["\udcff", "a\ud800b"]),   # lone surrogates: not text
                 st.lists(st.integers(-5, 200_000), max_size=4),
                 st.dictionaries(st.text(max_size=5), st.integers(), max_size=2))
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "bogus", ""]),
                                 "content": st.one_of(st.text(max_size=30), junk)})
small_int = st.one_of(st.integers(-3, 3), junk)
common = {"model": st.one_of(st.just("smollm2"), junk), "max_tokens": small_int,
          "temperature": st.one_of(st.floats(-1, 3), junk), "top_p": st.one_of(st.floats(-1, 2), junk),
          "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3), junk),
          "n": small_int, "seed": st.one_of(st.integers(-5, 2**64), junk), "stream": st.one_of(st.booleans(), junk),
          "logprobs": st.one_of(st.booleans(), small_int), "top_logprobs": small_int,
          "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), junk)}
ENDPOINTS = {
    "/v1/chat/completions": {**common, "messages": st.one_of(st.lists(message, max_size=3), junk)},
    "/v1/completions": {**common, "prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(-2, 60_000),
                                                                                         max_size=5), junk)},
    "/v1/messages": {**common, "messages": st.one_of(st.lists(message, max_size=3), junk),
                     "system": st.one_of(st.text(max_size=10), junk)},
    "/v1/responses": {**common, "input": st.one_of(st.text(max_size=20), st.lists(message, max_size=2), junk),
                      "max_output_tokens": small_int},
    "/tokenize": {"prompt": st.one_of(st.text(max_size=20), junk), "messages": st.one_of(st.lists(message), junk)},
    "/detokenize": {"tokens": st.one_of(st.lists(st.integers(-3, 60_000), max_size=5), junk)},
}


def body_for(path):
    fields = ENDPOINTS[path]
    return st.one_of(
        st.fixed_dictionaries({}, optional=fields),          # any subset of (odd) fields
        junk,                                                 # not even an object
        st.binary(max_size=40),                               # not even JSON
    )


request = st.sampled_from(sorted(ENDPOINTS)).flatmap(lambda p: st.tuples(st.just(p), body_for(p)))


@pytest.fixture(scope="module")
def server(smollm_dir):
    with LiveServer(str(smollm_dir), served_model_name="smollm2", max_num_seqs=8, max_model_len=256,
                    block_size=16) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    """One client for every example: a new httpx.Client builds an SSL context (~80% of this module's time on the
    CI machine), and a kept-alive connection also carries each bad body after the previous one."""
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(req=request)
def test_bad_bodies_never_5xx(client, req):
    path, body = req
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()   # NaN/Infinity allowed through
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code < 500, (path, body, r.status_code, r.text[:300])
    if r.status_code >= 400:
        data = r.json()
        if path == "/v1/messages":
            assert data["type"] == "error" and isinstance(data["error"]["message"], str)
        else:
            assert isinstance(data["error"]["message"], str) and data["error"]["message"]
            assert data["error"]["code"] == r.status_code


def test_pool_idle_after_fuzz(server):
    assert server.wait_idle()
