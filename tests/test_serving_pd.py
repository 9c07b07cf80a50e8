"""Prefill/decode disaggregation through the shared prefix-KV store, and the router in front of it
(serving/router.py, balancers.py, load.py; docs/serving.md): real `openinfer serve` processes on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import uvicorn

from openinfer.kv_cache.kv_store import TieredKVStore
from openinfer.kv_cache.tiers import HostMemoryTier
from openinfer.serving.balancers import (BUCKET_EDGES, InstanceState, QuotaRounds, assign_buckets, bucket_of,
                                         pick_decode, pick_prefill, prefill_cost)
from openinfer.serving.load import BusyMeter, prefill_body
from openinfer.serving.router import Router, RouterConfig, build_router_app, estimate_prompt_tokens
from tests.live_server import LiveServer, _free_port, wait_healthy

BS = 16                 # small blocks: short prompts have full blocks to hand over
MODEL = "smollm2"
ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--block-size", str(BS), "--max-num-seqs", "8",
                "--kv-cache-memory-bytes", str(128 << 20), "--served-model-name", MODEL]
PROMPT = ("The lighthouse keeper climbed the spiral stairs every evening, counting each of the one hundred and "
          "twelve steps, wiping the salt from the windows with an old grey cloth, and then lit the great lamp so "
          "that the fishing boats coming home through the fog would find the harbour, and the ships")
MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow and say which one you like best, "
                                        "in one short sentence."}]


# ---- pure parts -------------------------------------------------------------------------------------------
def test_store_flush_waits_for_queued_writes_up_to_a_timeout():
    release = threading.Event()

    class Slow(HostMemoryTier):
        def put(self, key, payload, ttl_s):
            release.wait(5)
            super().put(key, payload, ttl_s)

    store = TieredKVStore([Slow(1 << 20)], payload_bytes=3, default_ttl_s=60.0)
    store.put(b"k", lambda: b"abc")
    t0 = time.perf_counter()
    assert store.flush(timeout=0.05) is False and time.perf_counter() - t0 < 1
    release.set()
    assert store.flush(timeout=5) is True and store.tiers[0].contains(b"k")
    store.close()


def test_prefill_balancer_buckets_by_length_and_sizes_them_by_last_rounds_quota():
    assert [bucket_of(n) for n in (1, 16383, 16384, 65535, 65536, 262143, 262144)] == [0, 0, 1, 1, 2, 2, 3]
    assert BUCKET_EDGES == (16384, 65536, 262144)
    assert prefill_cost(1000, 50_000) > prefill_cost(1000) > 1000           # attention grows with the context
    urls = [f"p{i}" for i in range(8)]
    # short prompts asked for 3/4 of last round's compute, long ones 1/4: 6 and 2 of the 8 (largest remainders)
    split = assign_buckets(urls, [300.0, 0.0, 100.0, 0.0])
    assert split[0] == urls[:6] and split[2] == urls[6:]
    assert split[1] == split[3] == urls                          # no demand last round: anywhere
    assert all(len(b) >= 1 for b in assign_buckets(urls, [1000.0, 1.0, 1.0, 1.0]))   # a demanded bucket gets one
    assert assign_buckets(urls[:2], [1.0, 1.0, 1.0, 0.0]) == [urls[:2]] * 4             # too few to split
    assert assign_buckets(urls, [0.0] * 4) == [urls] * 4
    # level 2: within the bucket, the most quota left (least outstanding compute), then the least busy
    states = [InstanceState("p0", quota_load=5000), InstanceState("p1", quota_load=100),
              InstanceState("p6", quota_load=0, busy=0.9), InstanceState("p7", quota_load=0, busy=0.1)]
    assert pick_prefill(states, 1000, split).url == "p1"              # a short prompt: p0..p5 only
    assert pick_prefill(states, 100_000, split).url == "p7"           # a long one: p6, p7
    assert pick_prefill(states[:2], 100_000, split).url == "p1"       # its bucket's instances all down: any
    assert pick_prefill([], 10) is None


def test_quota_rounds_report_the_last_complete_round():
    r = QuotaRounds(round_s=10)
    r.add(0, 5.0, now=0)
    r.add(2, 1.0, now=3)
    assert r.demand(now=9) == [0.0] * 4                          # round 1 not over yet
    assert r.demand(now=11) == [5.0, 0.0, 1.0, 0.0]
    r.add(1, 2.0, now=12)
    assert r.demand(now=21) == [0.0, 2.0, 0.0, 0.0]
    assert r.demand(now=45) == [0.0] * 4                         # idle rounds: no demand


def test_decode_balancer_weighs_request_count_and_kv_length():
    a = InstanceState("a", num_requests=2, kv_tokens=30_000, kv_capacity_tokens=100_000)
    b = InstanceState("b", num_requests=2, kv_tokens=2_000, kv_capacity_tokens=100_000)
    c = InstanceState("c", num_requests=6, kv_tokens=1_000, kv_capacity_tokens=100_000)
    # a short request: low concurrency first, and of those the instance with the most KV
    assert pick_decode([a, b, c], 500).url == "a"
    # a long one: the least KV
    assert pick_decode([a, b, c], 20_000).url == "c"
    # an instance whose free KV cannot hold the request is passed over while another can
    full = InstanceState("full", num_requests=0, kv_tokens=99_800, kv_capacity_tokens=100_000)
    assert pick_decode([full, c], 500).url == "c"
    assert pick_decode([full], 500).url == "full"
    # counts stay balanced: within one request of the least loaded only
    d = InstanceState("d", num_requests=0, kv_tokens=0)
    assert pick_decode([a, d], 500).url == "d"
    assert pick_decode([], 1) is None


def test_request_shaping_and_estimates():
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 400}], "stream": True,
            "stream_options": {"include_usage": True}, "max_completion_tokens": 50, "min_tokens": 3}
    p = prefill_body("/v1/chat/completions", body, stream=False)
    assert p == {"model": "m", "messages": body["messages"], "max_tokens": 1}
    assert prefill_body("/v1/messages", {"max_tokens": 9, "stream": True})["max_tokens"] == 1
    assert prefill_body("/v1/completions", {"max_tokens": 9, "stream": True}) == {"max_tokens": 1, "stream": True}
    assert 100 <= estimate_prompt_tokens(body) <= 110
    assert estimate_prompt_tokens({"prompt": [1, 2, 3, 4]}) == 4
    m = BusyMeter(window_s=10)
    m.on_step(True, now=0.0)
    m.on_step(True, now=1.0)            # a step of 1 s, straight after the previous one
    m.on_step(False, now=2.0)
    m.on_step(False, now=9.0)           # after 7 s idle: counted at the steps' mean length, not 7 s
    assert 0.25 <= m.fraction(now=9.0) <= 0.4
    assert m.fraction(now=30.0) == 0.0


def _load(model="smollm2", role="decode", ns="abc", **kw):
    return {"role": role, "model": model, "num_requests_running": 0, "num_requests_waiting": 0, "kv_tokens": 0,
            "kv_capacity_tokens": 1000, "prefill_tokens_queued": 0, "busy_fraction": 0.0,
            "kv_store_namespace": ns, **kw}


def _router(loads: dict, **cfg) -> Router:
    def handler(request: httpx.Request):
        ld = loads[f"{request.url.scheme}://{request.url.netloc.decode()}"]
        if isinstance(ld, Exception):
            raise ld
        return httpx.Response(200, json=ld)
    transport = httpx.MockTransport(handler)
    return Router(RouterConfig(**cfg), transport=transport, sync_transport=transport)


def test_router_refuses_mismatched_instances_at_start():
    with pytest.raises(ValueError, match="different models"):
        _router({"http://a": _load(), "http://b": _load(model="other")}, decode=["http://a", "http://b"]).verify()
    with pytest.raises(ValueError, match="its role is 'decode'"):
        _router({"http://p": _load(), "http://d": _load()}, prefill=["http://p"], decode=["http://d"]).verify()
    with pytest.raises(ValueError, match="namespace"):
        _router({"http://p": _load(role="prefill"), "http://d": _load(ns="other")},
                prefill=["http://p"], decode=["http://d"]).verify()
    with pytest.raises(ValueError, match="without a shared prefix-KV store"):
        _router({"http://p": _load(role="prefill"), "http://d": _load(ns=None)},
                prefill=["http://p"], decode=["http://d"]).verify()
    with pytest.raises(ValueError, match="at least one --decode"):
        RouterConfig(prefill=["http://p"])
    # a consistent set starts; an instance not answering yet starts drained
    r = _router({"http://p": _load(role="prefill"), "http://d": _load(), "http://e": httpx.ConnectError("no")},
                prefill=["http://p"], decode=["http://d", "http://e"])
    r.verify()
    assert [i.healthy for i in r.instances] == [True, True, False] and r.model == "smollm2"


def test_health_checks_drain_and_bring_back_instances():
    import asyncio

    loads = {"http://d": _load(), "http://e": _load()}
    r = _router(loads, decode=["http://d", "http://e"], health_failures=2)
    r.verify()
    d, e = r.instances

    async def go():
        r.client = httpx.AsyncClient(transport=r._transport)
        loads["http://d"] = httpx.ConnectError("refused")
        loads["http://e"] = httpx.ReadTimeout("slow")
        await asyncio.gather(r.poll(d), r.poll(e))
        assert not d.healthy and "refused" in d.reason          # refused: drained at once
        assert e.healthy                                         # one timeout: not yet
        await r.poll(e)
        assert not e.healthy                                     # two in a row: drained
        loads["http://d"] = _load(num_requests_running=3)
        await r.poll(d)
        assert d.healthy and d.state().num_requests == 3         # answering again: back
        loads["http://e"] = _load(model="other")
        await r.poll(e)
        assert not e.healthy and "model" in e.excluded           # a changed model: kept out
        await r.client.aclose()
    asyncio.run(go())


# ---- real processes ---------------------------------------------------------------------------------------
class ThreadServer:
    """A uvicorn app on loopback in a thread of this process."""

    def __init__(self, app, port: int):
        self.base_url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        _wait_up(self.base_url, 30)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)


def _wait_up(base: str, timeout: float, proc: subprocess.Popen | None = None, log: str | None = None) -> None:
    if wait_healthy(base, timeout, proc, ok=(200, 503)):
        return
    if proc is not None and proc.poll() is not None:
        raise RuntimeError(f"{base} exited with {proc.returncode}: {open(log).read()[-3000:]}")
    raise RuntimeError(f"{base} did not come up" + (f": {open(log).read()[-3000:]}" if log else ""))


def _serve_process(smollm_dir, role: str, store: str, log: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "openinfer", "serve", "--model", str(smollm_dir), "--port", str(port),
           "--role", role, "--kv-store-dir", store, *ENGINE_FLAGS]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def cluster(smollm_dir, tmp_path_factory):
    """One prefill and two decode processes sharing a store directory, a router over them, and a plain
    `both` server (no store) as the reference."""
    tmp = tmp_path_factory.mktemp("pd")
    store = str(tmp / "kv")
    procs = {name: _serve_process(smollm_dir, role, store, str(tmp / f"{name}.log"))
             for name, role in (("prefill", "prefill"), ("decode1", "decode"), ("decode2", "decode"))}
    reference = LiveServer(str(smollm_dir), served_model_name=MODEL, dtype="float32", block_size=BS,
                           max_num_seqs=8, kv_cache_memory_bytes=128 << 20)
    router = None
    try:
        with reference:
            for name, (proc, url) in procs.items():
                _wait_up(url, 120, proc, str(tmp / f"{name}.log"))
            router = Router(RouterConfig(prefill=[procs["prefill"][1]],
                                         decode=[procs["decode1"][1], procs["decode2"][1]],
                                         health_interval_s=0.5, health_timeout_s=2.0))
            router.verify()
            with ThreadServer(build_router_app(router), _free_port()) as front:
                yield {"router": router, "base": front.base_url, "reference": reference.base_url,
                       "urls": {name: url for name, (_, url) in procs.items()},
                       "procs": {name: proc for name, (proc, _) in procs.items()}}
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc, _ in procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


def _post(base: str, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=timeout)


def _stream_text(base: str, path: str, body: dict) -> tuple[str, list[dict]]:
    text, events = "", []
    with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                events.append(ev)
                choice = (ev.get("choices") or [{}])[0]
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text, events


def _store_hits(url: str) -> int:
    return httpx.get(url + "/load", timeout=5).json()["prefix_cache_store_hit_tokens"]


def test_router_with_prefill_and_decode_equals_one_instance(cluster):
    base, ref, urls = cluster["base"], cluster["reference"], cluster["urls"]
    load = httpx.get(urls["prefill"] + "/load", timeout=5).json()
    assert load["role"] == "prefill" and load["model"] == MODEL and load["kv_store_namespace"]
    assert httpx.get(urls["decode1"] + "/health").json() == {"status": "ok", "role": "decode"}
    metrics = httpx.get(urls["decode1"] + "/metrics").text
    assert 'openinfer:server_role{model_name="smollm2",role="decode"} 1.0' in metrics

    decode_urls = [urls["decode1"], urls["decode2"]]
    hits_before = sum(_store_hits(u) for u in decode_urls)
    comp = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    want = _post(ref, "/v1/completions", comp).json()
    got = _post(base, "/v1/completions", comp).json()
    assert got["choices"][0]["text"] == want["choices"][0]["text"] and want["choices"][0]["text"]
    n_prompt = got["usage"]["prompt_tokens"]
    full_blocks = (n_prompt - 1) // BS * BS           # the last token is always computed: a partial block is
    assert n_prompt > 2 * BS                          # recomputed, a final full one too
    # the decode instance found the prompt's full blocks in the store: it computed only the last partial block
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == full_blocks
    assert sum(_store_hits(u) for u in decode_urls) - hits_before == full_blocks
    # again: the decode instance holds those blocks now; they are pool hits, not read from the store again
    again = _post(base, "/v1/completions", comp).json()
    assert again["choices"][0]["text"] == want["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == full_blocks
    assert sum(_store_hits(u) for u in decode_urls) - hits_before == full_blocks

    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    want_chat = _post(ref, "/v1/chat/completions", chat).json()["choices"][0]["message"]["content"]
    assert _post(base, "/v1/chat/completions", chat).json()["choices"][0]["message"]["content"] == want_chat

    msgs = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    want_msg = _post(ref, "/v1/messages", msgs).json()["content"][0]["text"]
    assert _post(base, "/v1/messages", msgs).json()["content"][0]["text"] == want_msg

    # streaming through the router: the same text, event by event
    text, events = _stream_text(base, "/v1/completions", {**comp, "prompt": PROMPT + " sailing"})
    assert text == _post(ref, "/v1/completions", {**comp, "prompt": PROMPT + " sailing"}).json()["choices"][0]["text"]
    assert len(events) > 2
    text, _ = _stream_text(base, "/v1/chat/completions", chat)
    assert text == want_chat

    m = httpx.get(base + "/metrics").text
    assert 'openinfer:router_requests_total{route="/v1/completions",status="200"} 3.0' in m
    assert f'openinfer:router_routed_total{{instance="{urls["prefill"]}",role="prefill"}} 6.0' in m
    health = httpx.get(base + "/health").json()
    assert health["status"] == "ok" and all(i["healthy"] for i in health["instances"])


def test_killing_a_decode_instance_under_load(cluster):
    router, base, urls = cluster["router"], cluster["base"], cluster["urls"]
    victim = next(i for i in router.instances if i.url == urls["decode2"])
    results: dict[int, dict] = {}

    def client(k: int):
        body = {"model": MODEL, "prompt": f"{k}: {PROMPT}", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        t0 = time.perf_counter()
        try:
            if k % 2:
                events = []
                with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                    status = r.status_code
                    for line in r.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            events.append(json.loads(line[6:]))
                results[k] = {"status": status, "stream": True, "error": any("error" in e for e in events),
                              "text": "".join(e["choices"][0]["text"] for e in events if "choices" in e)}
            else:
                r = httpx.post(base + "/v1/completions", json=body, timeout=60)
                results[k] = {"status": r.status_code, "stream": False,
                              "text": r.json()["choices"][0]["text"] if r.status_code == 200 else ""}
        except Exception as e:          # a hang would end here as a timeout
            results[k] = {"status": None, "exc": repr(e)}
        results[k]["s"] = time.perf_counter() - t0

    threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    deadline = time.time() + 60
    while victim.inflight == 0 and time.time() < deadline:      # requests are on the victim
        time.sleep(0.05)
    time.sleep(0.5)
    cluster["procs"]["decode2"].send_signal(signal.SIGKILL)
    killed = time.perf_counter()
    while victim.healthy and time.perf_counter() - killed < 10:
        time.sleep(0.05)
    drained_after = time.perf_counter() - killed
    assert not victim.healthy and drained_after <= router.config.health_interval_s + 0.5
    for t in threads:
        t.join(timeout=90)
    assert not any(t.is_alive() for t in threads), "a request hung"
    # the kill hit requests in flight: streams cut mid-answer, or requests retried on the survivor
    assert router.m_cut._value.get() + router.m_retries.labels("decode")._value.get() >= 1
    for k, res in results.items():
        assert res["status"] == 200, res                          # no 5xx: cut streams end with an error event
        if not res["stream"]:
            assert res["text"], res                               # not started: retried on decode1
        elif not res["error"]:
            assert res["text"], res
    # new requests: all to the survivor
    before = router.m_routed.labels(victim.url, "decode")._value.get()
    for k in range(3):
        r = _post(base, "/v1/completions", {"model": MODEL, "prompt": f"after {k}", "max_tokens": 2})
        assert r.status_code == 200
    assert router.m_routed.labels(victim.url, "decode")._value.get() == before
    health = httpx.get(base + "/health").json()
    assert [i["healthy"] for i in health["instances"]] == [True, True, False]


def test_a_prefill_instance_that_stops_answering_is_drained_and_comes_back(cluster):
    router, base = cluster["router"], cluster["base"]
    prefill = next(i for i in router.instances if i.role == "prefill")
    proc = cluster["procs"]["prefill"]
    fallbacks = router.m_fallbacks._value.get()
    proc.send_signal(signal.SIGSTOP)          # alive, listening, silent
    try:
        t0 = time.perf_counter()
        r = _post(base, "/v1/completions", {"model": MODEL, "prompt": PROMPT + " slowly", "max_tokens": 2}, timeout=30)
        waited = time.perf_counter() - t0
        assert r.status_code == 200 and r.json()["choices"][0]["text"]     # decoded whole: the prefill was skipped
        assert not prefill.healthy and router.m_fallbacks._value.get() == fallbacks + 1
        c = router.config      # cut at the drain (failed checks in a row), not at the 600 s upstream timeout
        assert waited < c.health_failures * (c.health_timeout_s + c.health_interval_s) + 3
    finally:
        proc.send_signal(signal.SIGCONT)
    deadline = time.time() + 15
    while not prefill.healthy and time.time() < deadline:
        time.sleep(0.1)
    assert prefill.healthy                    # answering again: routed to again


def test_no_healthy_decode_instance_is_a_503_with_the_reason():
    dead = f"http://127.0.0.1:{_free_port()}"
    router = Router(RouterConfig(decode=[dead], health_interval_s=0.5))
    router.verify()                                  # not answering at start: starts drained, not refused
    with ThreadServer(build_router_app(router), _free_port()) as front:
        for path, anthropic in (("/v1/chat/completions", False), ("/v1/messages", True)):
            r = httpx.post(front.base_url + path, json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4},
                           timeout=10)
            assert r.status_code == 503
            message = r.json()["error"]["message"]
            assert "no healthy decode instance" in message and dead in message and "refused" in message
            assert (r.json().get("type") == "error") == anthropic
        assert httpx.get(front.base_url + "/health").status_code == 503
        assert httpx.post(front.base_url + "/v1/completions", content=b"{not json", timeout=10).status_code == 400


def test_prefill_role_needs_a_shared_store(smollm_dir):
    from openinfer.entrypoints.cli import main

    assert main(["serve", "--model", str(smollm_dir), "--role", "prefill"]) == 2
