"""Soak benchmark: hold a server under mixed load for a while and check that nothing accumulates.

For `duration_s`, `clients` concurrent streaming clients ask one request after another, rotating over the
four generation endpoints (/v1/completions, /v1/chat/completions, /v1/messages, /v1/responses). Beside them,
spread evenly over the run: `cut_requests` requests whose client hangs up part-way (half streaming, cut after a
few events; half non-streaming, cut by a short client timeout) and `fuzz_bodies` mutated request bodies. The
server's RSS (from /proc, when its pid is known) and its /metrics gauges are sampled every `rss_interval_s`.

Afterwards the server must go idle: no request running or waiting, and `kv_cache_blocks_in_use` back to 0
(anything else is a leaked block). Reported: answers, errors (any non-2xx for a valid request, a stream
without its end or with an error event), fuzz statuses (a 5xx or a non-JSON error body is an error), RSS at
start / plateau (median of the second half) / end, and the leaked blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import httpx

from openinfer.benchmarks.serve import _WORDS

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses")
# the line that ends a complete stream, per endpoint
_STREAM_END = {"/v1/completions": ("data: [DONE]",), "/v1/chat/completions": ("data: [DONE]",),
               "/v1/messages": ("event: message_stop",),
               "/v1/responses": ("event: response.completed", "event: response.incomplete")}
_JUNK = (None, True, False, 0, -1, 1.5, 10**12, -10**12, float("nan"), float("inf"), "", "x" * 300, "\udcff",
         [], [1, "a"], [-5, 10**9], {}, {"a": 1}, [{"role": "user"}], [{"role": "bogus", "content": 3}])
_FIELDS = ("model", "messages", "prompt", "input", "max_tokens", "max_output_tokens", "max_completion_tokens",
           "temperature", "top_p", "stop", "n", "seed", "stream", "logprobs", "top_logprobs", "stream_options",
           "system", "tools", "tool_choice", "response_format", "echo", "ignore_eos", "bogus_field")


@dataclass
class SoakConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None          # default: the server's first model
    clients: int = 32
    duration_s: float = 600.0
    cut_requests: int = 200
    fuzz_bodies: int = 1000
    max_tokens: int = 64              # per streamed answer (drawn from [max_tokens // 4, max_tokens])
    cut_max_tokens: int = 300         # requests that get cut ask for this many (EOS ignored where possible)
    rss_pid: int | None = None        # the server's pid, to sample its RSS
    rss_interval_s: float = 5.0
    seed: int = 0
    api_key: str | None = None


def _body(path: str, model: str, text: str, max_tokens: int | None, stream: bool) -> dict:
    body: dict = {"model": model, "stream": stream}
    if path == "/v1/completions":
        body.update(prompt=text, ignore_eos=max_tokens is not None and max_tokens > 100)
    elif path == "/v1/responses":
        body["input"] = text
    else:
        body["messages"] = [{"role": "user", "content": text}]
    if max_tokens is not None:
        body["max_output_tokens" if path == "/v1/responses" else "max_tokens"] = max_tokens
    return body


def _fuzz(rng: random.Random, path: str, model: str) -> bytes:
    """A valid small request, then one to three mutations (or not a JSON object at all)."""
    r = rng.random()
    if r < 0.05:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))
    if r < 0.10:
        return json.dumps(rng.choice(_JUNK)).encode()
    body = _body(path, model, " ".join(rng.choices(_WORDS, k=8)), 8, rng.random() < 0.3)
    for _ in range(rng.randint(1, 3)):
        field = rng.choice(_FIELDS + tuple(body))
        if rng.random() < 0.2:
            body.pop(field, None)
        else:
            body[field] = rng.choice(_JUNK)
    raw = json.dumps(body).encode()
    return raw[:rng.randrange(len(raw))] if rng.random() < 0.05 else raw   # sometimes cut short


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus metric's samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def read_rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class _Soak:
    def __init__(self, cfg: SoakConfig, client: httpx.AsyncClient):
        self.cfg, self.client = cfg, client
        self.rng = random.Random(cfg.seed)
        self.answers: Counter = Counter()
        self.errors: Counter = Counter()
        self.fuzz_status: Counter = Counter()
        self.cuts: Counter = Counter()
        self.server_5xx = 0
        self.samples: list[dict] = []

    def _text(self) -> str:
        return " ".join(self.rng.choices(_WORDS, k=self.rng.randint(16, 64)))

    def error(self, what: str, status: int | None = None) -> None:
        self.errors[what[:200]] += 1
        self.server_5xx += status is not None and status >= 500

    async def stream(self, path: str, body: dict, cut_after: int | None = None) -> None:
        """Read one streamed answer to its end (or hang up after `cut_after` events)."""
        events, ended, failed = 0, False, None
        async with self.client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                self.error(f"{path} HTTP {resp.status_code}: {(await resp.aread())[:100]!r}", resp.status_code)
                return
            async for line in resp.aiter_lines():
                if line.startswith(('data: {"error"', "event: error")):
                    failed = line[:120]
                ended = ended or line in _STREAM_END[path]
                events += line.startswith("data: ")
                if cut_after is not None and events >= cut_after:
                    self.cuts["stream"] += 1
                    return                  # leaving the block closes the connection mid-stream
        if failed or not ended:
            self.error(f"{path} stream {'error event ' + failed if failed else 'ended without its end marker'}")
        elif cut_after is None:
            self.answers[path] += 1

    async def client_loop(self, index: int, deadline: float) -> None:
        i = index
        while time.monotonic() < deadline:
            path = ENDPOINTS[i % len(ENDPOINTS)]
            i += 1
            n = self.rng.randint(max(1, self.cfg.max_tokens // 4), self.cfg.max_tokens)
            try:
                await self.stream(path, _body(path, self.cfg.model, self._text(), n, True))
            except httpx.HTTPError as e:
                self.error(f"{path} {type(e).__name__}: {e}")

    async def cut_one(self, k: int) -> None:
        path = ENDPOINTS[(k // 2) % len(ENDPOINTS)]
        body = _body(path, self.cfg.model, self._text(), self.cfg.cut_max_tokens, k % 2 == 0)
        try:
            if k % 2 == 0:
                await self.stream(path, body, cut_after=self.rng.randint(1, 4))
            else:
                r = await asyncio.wait_for(self.client.post(path, json=body), self.rng.uniform(0.3, 1.5))
                self.cuts["non_streaming_answered_in_time"] += 1
                if r.status_code != 200:
                    self.error(f"{path} HTTP {r.status_code}: {r.text[:100]}", r.status_code)
        except asyncio.TimeoutError:        # the client gives up: its connection is closed
            self.cuts["non_streaming"] += 1
        except httpx.HTTPError as e:
            self.error(f"{path} cut {type(e).__name__}: {e}")

    async def fuzz_one(self, k: int) -> None:
        path = ENDPOINTS[k % len(ENDPOINTS)]
        raw = _fuzz(self.rng, path, self.cfg.model)
        try:
            # a mutated body may be valid and ask for a long answer (streamed or not): hang up after 10 s
            r = await asyncio.wait_for(self.client.post(path, content=raw,
                                                        headers={"content-type": "application/json"}), 10)
        except asyncio.TimeoutError:
            self.fuzz_status["timeout (client hung up)"] += 1
            return
        except httpx.HTTPError as e:
            self.error(f"fuzz {path} {type(e).__name__}: {e}")
            return
        self.fuzz_status[str(r.status_code)] += 1
        if r.status_code >= 500:
            self.error(f"fuzz {path} HTTP {r.status_code} for {raw[:120]!r}: {r.text[:80]}", r.status_code)
        elif r.status_code >= 400:
            try:
                msg = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = None
            if not isinstance(msg, str) or not msg:
                self.error(f"fuzz {path} HTTP {r.status_code}: error body is not JSON with a message: {r.text[:100]}")

    async def spread(self, count: int, fn, deadline: float) -> None:
        """Start `count` calls of fn evenly over the time left."""
        start, tasks = time.monotonic(), []
        span = max(deadline - start, 0.0)
        for k in range(count):
            await asyncio.sleep(max(0.0, start + span * k / max(count, 1) - time.monotonic()))
            tasks.append(asyncio.create_task(fn(k)))
        await asyncio.gather(*tasks)

    async def sample(self, t0: float) -> dict:
        s = {"t_s": round(time.monotonic() - t0, 1)}
        if self.cfg.rss_pid is not None:
            s["rss_mib"] = read_rss_mib(self.cfg.rss_pid)
        try:
            text = (await self.client.get("/metrics", timeout=10)).text
            for key, name in (("running", "openinfer:num_requests_running"),
                              ("waiting", "openinfer:num_requests_waiting"),
                              ("kv_blocks_in_use", "openinfer:kv_cache_blocks_in_use")):
                s[key] = int(metric_value(text, name))
        except httpx.HTTPError as e:
            self.error(f"/metrics {type(e).__name__}: {e}")
        self.samples.append(s)
        return s

    async def sampler(self, t0: float, deadline: float) -> None:
        while time.monotonic() < deadline:
            await asyncio.sleep(min(self.cfg.rss_interval_s, max(deadline - time.monotonic(), 0.0)))
            await self.sample(t0)


async def _run(cfg: SoakConfig) -> dict:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.clients + 64, max_keepalive_connections=cfg.clients + 64)
    async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers, timeout=300, limits=limits) as client:
        if cfg.model is None:
            cfg.model = (await client.get("/v1/models")).json()["data"][0]["id"]
        soak = _Soak(cfg, client)
        t0 = time.monotonic()
        await soak.sample(t0)
        deadline = t0 + cfg.duration_s
        await asyncio.gather(*(soak.client_loop(i, deadline) for i in range(cfg.clients)),
                             soak.spread(cfg.cut_requests, soak.cut_one, deadline),
                             soak.spread(cfg.fuzz_bodies, soak.fuzz_one, deadline),
                             soak.sampler(t0, deadline))
        load_s = time.monotonic() - t0
        idle_deadline, idle_after = time.monotonic() + 60, None    # the last aborts land at a step boundary
        while time.monotonic() < idle_deadline:
            last = await soak.sample(t0)
            if last.get("running") == 0 and last.get("waiting") == 0 and last.get("kv_blocks_in_use") == 0:
                idle_after = round(time.monotonic() - t0 - load_s, 2)
                break
            await asyncio.sleep(0.5)
        if idle_after is None:
            soak.error(f"server not idle 60 s after the load: {soak.samples[-1]}")
        metrics = (await client.get("/metrics")).text
        health = (await client.get("/health")).status_code
    return {
        "config": asdict(cfg), "load_s": round(load_s, 1),
        "answers": sum(soak.answers.values()), "answers_by_endpoint": dict(soak.answers),
        "errors": sum(soak.errors.values()), "error_samples": dict(soak.errors.most_common(10)),
        "server_5xx": soak.server_5xx,
        "cuts": dict(soak.cuts), "fuzz_status": dict(sorted(soak.fuzz_status.items())),
        "aborted_client_disconnect": metric_value(metrics, "openinfer:request_aborted_total", reason="client_disconnect"),
        "generation_tokens": metric_value(metrics, "openinfer:generation_tokens_total"),
        "idle_after_load_s": idle_after,
        "leaked_blocks": soak.samples[-1].get("kv_blocks_in_use"),
        "health_after": health,
        "rss_mib": _rss_summary(soak.samples, cfg.duration_s),
        "samples": soak.samples,
    }


def _rss_summary(samples: list[dict], duration_s: float) -> dict | None:
    """RSS at start (before any load), plateau (median of the second half), end (idle, after the load), max, and
    the growth over the second half (last minus first sample there)."""
    rss = [(s["t_s"], s["rss_mib"]) for s in samples if s.get("rss_mib") is not None]
    late = [v for t, v in rss if duration_s / 2 <= t <= duration_s]
    if not rss or not late:
        return None
    return {"start": rss[0][1], "plateau": sorted(late)[len(late) // 2], "end": rss[-1][1],
            "max": max(v for _, v in rss), "growth_second_half": late[-1] - late[0]}


@contextlib.contextmanager
def serve_process(serve_args: list[str], log_path: str,
                  startup_timeout_s: float = 300) -> Iterator[tuple[str, subprocess.Popen]]:
    """`python -m openinfer serve SERVE_ARGS` on a free loopback port, output to log_path; yields (base_url,
    process) once /health answers. On exit: SIGTERM, and the process's returncode is set (0: a clean stop)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base_url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "openinfer", "serve", *serve_args, "--host", "127.0.0.1",
                                 "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if proc.poll() is not None:
                tail = Path(log_path).read_text(errors="replace")[-3000:]
                raise RuntimeError(f"the server exited with {proc.returncode} while starting; see {log_path}; "
                                   f"its last output:\n{tail}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not answer /health in {startup_timeout_s:.0f} s; see {log_path}")
            try:
                if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield base_url, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_soak(cfg: SoakConfig, quiet: bool = False) -> dict:
    result = asyncio.run(_run(cfg))
    if not quiet:
        r = result["rss_mib"]
        print(f"{result['load_s']:.0f}s, {cfg.clients} clients: {result['answers']} answers, "
              f"{result['errors']} errors, {result['server_5xx']} server 5xx; cuts {result['cuts']}; "
              f"fuzz {result['fuzz_status']}")
        print(f"  aborted by client disconnect: {result['aborted_client_disconnect']:.0f}; idle "
              f"{result['idle_after_load_s']} s after the load; leaked blocks: {result['leaked_blocks']}")
        if r:
            print(f"  RSS MiB: start {r['start']:.0f}, plateau {r['plateau']:.0f}, end {r['end']:.0f}, "
                  f"max {r['max']:.0f}, second-half growth {r['growth_second_half']:+.0f}")
        for e, n in result["error_samples"].items():
            print(f"  error x{n}: {e}")
    return result
