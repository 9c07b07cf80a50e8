"""`openinfer serve` as a real process (`python -m openinfer`), its engine core a process of its own: the KV pool is
resident from the start; SIGTERM lets in-flight requests finish, refuses new ones, exits 0 and leaves no process;
a core that dies makes the server answer 503 and exit 1, never hang. (On the tiny random Llama: no property here
reads the weights.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil

from openinfer.benchmarks.soak import read_rss_mib
from tests.live_server import _free_port, wait_healthy


def test_sigterm_finishes_in_flight_and_exits_zero(tiny_llama_dir):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "openinfer", "serve", "--model", str(tiny_llama_dir),
                             "--device", "cpu", "--port", str(port), "--served-model-name", "tiny"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, 120, proc)
        # the default CPU pool (2 GiB) is touched before serving: memory does not creep as blocks are first used
        children = psutil.Process(proc.pid).children(recursive=True)
        core = next(c for c in children if "engine-core" in c.name() or read_rss_mib(c.pid) > 2048)
        assert read_rss_mib(core.pid) > 2048
        result = {}

        def stream():
            text, finish = "", None
            body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 256, "ignore_eos": True,
                    "stream": True}
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        choice = json.loads(line[6:])["choices"][0]
                        text += choice["text"]
                        finish = choice["finish_reason"] or finish
                    if line.startswith("data: ") and "started" not in result:
                        result["started"] = True
            result.update(text=text, finish=finish)

        t = threading.Thread(target=stream)
        t.start()
        while "started" not in result:
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        t.join(timeout=60)
        assert result["finish"] == "length" and result["text"]      # the in-flight stream ran to its end
        assert proc.wait(timeout=60) == 0
        # the engine core is stopped before the server exits; the fork server it came from follows its parent
        assert not psutil.wait_procs(children, timeout=10)[1]
        try:
            refused = httpx.get(base + "/health", timeout=2).status_code != 200
        except httpx.HTTPError:
            refused = True
        assert refused
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_dead_engine_core_makes_the_server_answer_503_and_exit_1(tiny_llama_dir):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "openinfer", "serve", str(tiny_llama_dir), "--device", "cpu",
                             "--port", str(port), "--served-model-name", "tiny", "--kv-cache-memory-bytes",
                             str(64 << 20)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, 120, proc)
        cores = [c for c in psutil.Process(proc.pid).children(recursive=True) if read_rss_mib(c.pid) > 100]
        assert cores
        for c in cores:
            c.kill()
        assert proc.wait(timeout=60) == 1                  # stopped, not hung
        log = proc.stdout.read().decode(errors="replace")
        assert "engine core died" in log, log[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
