"""`openinfer serve --api-server-count 2` as a real process: two API servers over one engine core
(serving/api_servers.py). Through the real `openai` client: greedy outputs equal the engine alone, streaming or
not; 128 concurrent streams spread over both API servers complete, and /metrics from either counts all of them; a
hang-up frees its request; a killed API server is restarted and its request aborted in the core; SIGTERM stops
every process; a dead core makes both API servers answer 503 and the server exit 1. One server for the module
(its last test stops it), one more for the core's death."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import psutil
import pytest

from openinfer import LLM, SamplingParams
from openinfer.benchmarks.soak import metric_value
from tests.live_server import _free_port

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
CHAT = [{"role": "user", "content": "Name three colors."}]


class Serve:
    """`python -m openinfer serve ... --api-server-count 2` on loopback, its output in a file."""

    def __init__(self, model_dir, log_path, api_servers: int = 2):
        self.port, self.n, self.log_path = _free_port(), api_servers, log_path
        self.base = f"http://127.0.0.1:{self.port}"
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "openinfer", "serve", str(model_dir), "--device", "cpu", "--port",
                 str(self.port), "--served-model-name", "smollm2", "--api-server-count", str(api_servers),
                 "--kv-cache-memory-bytes", str(256 << 20), "--block-size", "16", "--max-num-seqs", "128"],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        deadline = time.time() + 180
        while f"{api_servers} API servers on" not in self.log():      # every API server is up
            assert self.proc.poll() is None and time.time() < deadline, self.log()[-3000:]
            time.sleep(0.2)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def descendants(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def api_servers(self) -> list[psutil.Process]:
        """The processes listening on the server's port."""
        return [p for p in self.descendants() if any(c.status == psutil.CONN_LISTEN and c.laddr.port == self.port
                                                     for c in _tcp(p))]

    def core(self) -> psutil.Process:
        """The engine core: the process that takes the API servers' connections on its Unix socket."""
        return next(p for p in self.descendants()
                    if any(str(c.laddr).endswith("core.sock") for c in p.net_connections(kind="unix")))

    def metrics(self) -> str:
        return httpx.get(self.base + "/metrics", timeout=30).text      # a new connection: either API server

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _tcp(p: psutil.Process):
    try:
        return p.net_connections(kind="tcp")
    except psutil.Error:
        return []


@pytest.fixture(scope="module")
def server(smollm_dir, tmp_path_factory):
    s = Serve(smollm_dir, tmp_path_factory.mktemp("serve") / "serve.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(smollm_dir):
    """Greedy outputs of the engine alone: the completions prompts, and the chat prompt as token ids."""
    llm = LLM(str(smollm_dir), device="cpu")
    params = SamplingParams(temperature=0, max_tokens=12)
    completions = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    yield llm, params, completions
    llm.shutdown()


def test_openai_client_streaming_and_not_equals_greedy_offline(server, reference):
    """Each call on a connection of its own (new clients): the kernel spreads them over both API servers."""
    llm, params, want = reference
    for prompt, text in zip(PROMPTS, want):
        oai = openai.OpenAI(base_url=server.base + "/v1", api_key="x")
        r = oai.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0)
        assert r.choices[0].text == text
        stream = openai.OpenAI(base_url=server.base + "/v1", api_key="x").completions.create(
            model="smollm2", prompt=prompt, max_tokens=12, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream) == text
    ids = httpx.post(server.base + "/tokenize", json={"messages": CHAT}).json()["tokens"]
    chat_want = llm.generate(prompt_token_ids=[ids], sampling_params=params, use_tqdm=False)[0].outputs[0].text
    oai = openai.OpenAI(base_url=server.base + "/v1", api_key="x")
    r = oai.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == chat_want
    stream = openai.OpenAI(base_url=server.base + "/v1", api_key="x").chat.completions.create(
        model="smollm2", messages=CHAT, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat_want


def test_128_concurrent_streams_over_both_api_servers_and_either_counts_them_all(server):
    before = [server.metrics() for _ in range(4)]
    n, tokens = 128, 4

    async def one(client: httpx.AsyncClient, i: int) -> tuple[str, str, str]:
        body = {"model": "smollm2", "prompt": f"Story number {i}:", "max_tokens": tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        text, rid, finish = "", "", None
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    rid, text = chunk["id"], text + chunk["choices"][0]["text"]
                    finish = chunk["choices"][0]["finish_reason"] or finish
        return rid, text, finish

    async def all_at_once():
        async with httpx.AsyncClient(base_url=server.base, timeout=300,
                                     limits=httpx.Limits(max_connections=n)) as client:
            return await asyncio.gather(*(one(client, i) for i in range(n)), return_exceptions=True)

    results = asyncio.run(all_at_once())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert all(finish == "length" and text for _, text, finish in results)
    assert len({rid for rid, _, _ in results}) == n
    # ids carry their API server's number: both served some of the streams
    assert len({rid.split("-")[1] for rid, _, _ in results}) == 2
    # either API server reports the core's totals and every API server's requests (summed)
    for text_before, text in zip(before, [server.metrics() for _ in range(4)]):
        assert metric_value(text, "openinfer:request_success_total") - metric_value(
            text_before, "openinfer:request_success_total") == n
        assert metric_value(text, "openinfer:generation_tokens_total") - metric_value(
            text_before, "openinfer:generation_tokens_total") == n * tokens
    steps = {metric_value(server.metrics(), "openinfer:engine_steps_total") for _ in range(4)}
    assert len(steps) == 1 and steps.pop() > 0


def _idle(server, timeout: float = 30.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        text = server.metrics()
        if (metric_value(text, "openinfer:num_requests_running") == 0
                and metric_value(text, "openinfer:kv_cache_blocks_in_use") == 0):
            return True
        time.sleep(0.1)
    return False


def test_a_hang_up_frees_its_request(server):
    before = metric_value(server.metrics(), "openinfer:request_aborted_total", reason="client_disconnect")
    for _ in range(4):          # four connections of their own: both API servers see hang-ups
        body = {"model": "smollm2", "prompt": "Write a long story.", "max_tokens": 2000, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=60) as r:
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data: ")
                if events == 2:
                    break                                  # hang up, two tokens in
    assert _idle(server)
    deadline = time.time() + 10
    while metric_value(server.metrics(), "openinfer:request_aborted_total", reason="client_disconnect") - before < 4:
        assert time.time() < deadline
        time.sleep(0.1)
    for _ in range(4):
        assert metric_value(server.metrics(), "openinfer:request_aborted_total",
                            reason="client_disconnect") - before == 4


def _open_stream(server) -> socket.socket:
    """A streaming request on a raw connection, its first event read: the connection's port names its API server."""
    body = json.dumps({"model": "smollm2", "prompt": "Write a long story.", "max_tokens": 2000, "ignore_eos": True,
                       "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    got = b""
    while b"data: " not in got:
        got += sock.recv(65536)
    return sock


def test_a_killed_api_server_is_restarted_and_its_request_aborted(server):
    sock = _open_stream(server)
    port = sock.getsockname()[1]
    victim = next(p for p in server.api_servers() if any(c.raddr and c.raddr.port == port for c in _tcp(p)))
    others = {p.pid for p in server.api_servers()} - {victim.pid}
    victim.kill()
    sock.settimeout(30)
    while True:                                            # its connection ends with it
        try:
            if not sock.recv(65536):
                break
        except ConnectionResetError:
            break
    sock.close()
    assert _idle(server)                                   # the core aborted the request: its blocks are free
    deadline = time.time() + 60
    while len(server.api_servers()) < 2:                   # a new API server in its place
        assert time.time() < deadline, server.log()[-3000:]
        time.sleep(0.2)
    assert others < {p.pid for p in server.api_servers()} and victim.pid not in {p.pid for p in server.api_servers()}
    assert f"(pid {victim.pid}) died" in server.log() and "restarting it" in server.log()
    for _ in range(6):                                     # and the server answers on every socket again
        r = httpx.post(server.base + "/v1/completions", timeout=60,
                       json={"model": "smollm2", "prompt": "Hello", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text


def test_sigterm_lets_in_flight_finish_and_leaves_no_process(server):
    """(The module's last test: it stops the server.)"""
    everyone = server.descendants()
    assert len(server.api_servers()) == 2
    result = {}

    def stream():
        body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True,
                "stream": True}
        text, finish = "", None
        with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    result["started"] = True
                    choice = json.loads(line[6:])["choices"][0]
                    text, finish = text + choice["text"], choice["finish_reason"] or finish
        result.update(text=text, finish=finish)

    t = threading.Thread(target=stream)
    t.start()
    deadline = time.time() + 30
    while "started" not in result:
        assert time.time() < deadline
        time.sleep(0.01)
    server.proc.send_signal(signal.SIGTERM)
    t.join(timeout=60)
    assert result["finish"] == "length" and result["text"]       # the stream in flight ran to its end
    assert server.proc.wait(timeout=60) == 0
    assert not psutil.wait_procs(everyone, timeout=10)[1]          # no API server, core or fork server left


def test_a_dead_core_makes_both_api_servers_answer_503_and_the_server_exit_1(smollm_dir, tmp_path):
    s = Serve(smollm_dir, tmp_path / "serve.log")
    try:
        everyone = s.descendants()
        statuses: list[int] = []

        def ask():      # not streamed: the answer waits for the whole request
            statuses.append(httpx.post(s.base + "/v1/completions", timeout=60, json={
                "model": "smollm2", "prompt": "Write a long story.", "max_tokens": 2000, "ignore_eos": True}
            ).status_code)

        threads = [threading.Thread(target=ask) for _ in range(8)]    # eight connections: both API servers
        for t in threads:
            t.start()
        deadline = time.time() + 60
        while metric_value(s.metrics(), "openinfer:num_requests_running") < 8:
            assert time.time() < deadline
            time.sleep(0.1)
        busy = [p for p in s.api_servers() if any(c.status == psutil.CONN_ESTABLISHED for c in _tcp(p))]
        assert len(busy) == 2                                   # requests in flight on each API server
        s.core().kill()
        for t in threads:
            t.join(timeout=60)
        assert statuses == [503] * 8
        assert s.proc.wait(timeout=60) == 1
        log = s.log()
        assert log.count("the engine core died; stopping the server") == 2, log[-3000:]     # each API server
        assert not psutil.wait_procs(everyone, timeout=10)[1]
    finally:
        s.stop()
