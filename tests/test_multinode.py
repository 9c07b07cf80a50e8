"""Several hosts, on one machine over loopback (CPU, gloo): the front end runs rank 0, a real `openinfer worker`
process runs rank 1 and connects to the front end over an HMAC-authenticated `multiprocessing.connection`;
tensors go through torch.distributed's tcp:// rendezvous. DP2 + EP2 on the tiny DeepSeek-V4 gives the
outputs of one process; shutdown ends the remote command; a wrong authkey is refused; a remote rank that
dies is named; bad multi-host configs fail before anything starts. Each engine start imports torch in three
processes (front end, local rank, remote rank): the time is mostly that, and grows with the machine's load."""

from __future__ import annotations

import multiprocessing.connection as mpc
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from openinfer import LLM, EngineConfig
from openinfer.executor.multiproc import WorkerError
from tests.live_server import _free_port
from tests.test_deepseek_v4 import prompts_of
from tests.test_parallel import EP2, V4_OPTS, assert_gone, assert_same_outputs, generate, params, v4_path  # noqa: F401 (fixture)

REPO = Path(__file__).resolve().parents[1]
PROMPTS = dict(lengths=(5, 40, 77, 13), seed=3)


@pytest.fixture(scope="module")
def reference(v4_path):
    llm = LLM(str(v4_path), **V4_OPTS)
    try:
        return generate(llm, prompts_of(*PROMPTS["lengths"], seed=PROMPTS["seed"]), max_tokens=12)
    finally:
        llm.shutdown()


def start_worker(port: int, log: Path, authkey: str = "test", ranks: str = "1") -> subprocess.Popen:
    """`openinfer worker` as a user on the other host would run it (the authkey from the environment)."""
    env = {**os.environ, "OPENINFER_WORKER_AUTHKEY": authkey}
    return subprocess.Popen([sys.executable, "-m", "openinfer", "worker", "--connect", f"127.0.0.1:{port}",
                             "--ranks", ranks, "--device", "cpu", "--connect-timeout", "60"],
                            cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def two_host_options(listen_port: int, **extra) -> dict:
    return {**V4_OPTS, **EP2, "num_local_ranks": 1, "worker_listen_address": f"127.0.0.1:{listen_port}",
            "distributed_init_method": f"tcp://127.0.0.1:{_free_port()}", "worker_authkey": "test",
            "worker_start_timeout_s": 60, **extra}


def remote_rank_pids(proc: subprocess.Popen) -> list[int]:
    """The rank processes of an `openinfer worker` command (not multiprocessing's resource tracker)."""
    return [c.pid for c in psutil.Process(proc.pid).children()
            if not any("resource_tracker" in part for part in c.cmdline())]


def test_two_hosts_equal_one_process_and_shutdown_ends_the_remote_worker(v4_path, reference, tmp_path):
    port = _free_port()
    log = tmp_path / "worker.log"
    # the front end starts first and must accept a late connection; the remote command starts a second later.
    # (The LLM is built in this thread, not a helper thread: a local rank's parent-death signal fires when the
    # thread that spawned it ends.)
    started: dict = {}
    timer = threading.Timer(1.0, lambda: started.setdefault("proc", start_worker(port, log)))
    timer.start()
    try:
        try:
            llm = LLM(str(v4_path), **two_host_options(port))
        except BaseException:
            timer.join()
            print("--- worker log:\n" + log.read_text())
            raise
        timer.join()
        proc = started["proc"]
        try:
            assert llm.engine._procs[0] is not None and llm.engine._procs[1] is None   # rank 1 is remote
            remote_pids = remote_rank_pids(proc)
            assert len(remote_pids) == 1
            outs = generate(llm, prompts_of(*PROMPTS["lengths"], seed=PROMPTS["seed"]), max_tokens=12)
            assert_same_outputs(outs, reference)
            per_rank = llm.engine.stats()["per_rank"]
            assert all(s["prefix_cache_queried_tokens"] > 0 for s in per_rank)    # both DP ranks served
        finally:
            llm.shutdown()
        assert proc.wait(timeout=10) == 0, log.read_text()
        assert_gone(remote_pids, timeout=5)
    finally:
        timer.cancel()
        proc = started.get("proc")
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_dead_remote_rank_is_named(v4_path, tmp_path):
    """The remote command's worker process is killed mid-run: the next step fails naming rank 1 (its
    connection closed), the local rank stops, and the remote command exits."""
    port = _free_port()
    log = tmp_path / "worker.log"
    proc = start_worker(port, log)           # started first: it retries until the front end listens
    try:
        llm = LLM(str(v4_path), **two_host_options(port))
        local = llm.engine._procs[0]
        try:
            engine = llm.engine
            engine.add_request(prompts_of(10, seed=2)[0], params(30))
            engine.step()
            for pid in remote_rank_pids(proc):
                psutil.Process(pid).kill()
            with pytest.raises(WorkerError, match="rank 1"):
                while True:
                    engine.step()
            assert_gone([local.pid], timeout=10)
        finally:
            llm.shutdown()
        assert proc.wait(timeout=10) != 0       # its rank was killed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_wrong_authkey_is_refused(v4_path):
    """A client with the wrong key (the stdlib Client the workers use) is refused by the HMAC challenge both
    ways: it gets AuthenticationError, and the front end, still missing rank 1 at its start timeout, fails
    naming the rank and the failed authentication."""
    port = _free_port()
    seen: dict = {}

    def intruder():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                conn = mpc.Client(("127.0.0.1", port), family="AF_INET", authkey=b"not-the-key")
            except ConnectionRefusedError:
                time.sleep(0.05)
                continue
            except mpc.AuthenticationError as e:
                seen["error"] = e
                return
            seen["accepted"] = True
            conn.send(("hello", 1))
            return

    t = threading.Thread(target=intruder, daemon=True)
    t.start()
    with pytest.raises(WorkerError, match=r"rank\(s\) \[1\] did not connect.*failed authentication"):
        LLM(str(v4_path), **two_host_options(port, worker_start_timeout_s=3))
    t.join(timeout=10)
    assert "accepted" not in seen and isinstance(seen.get("error"), mpc.AuthenticationError), seen


def test_multi_host_configs_are_checked_before_anything_starts():
    base = dict(device="cpu", data_parallel_size=2, num_local_ranks=1, worker_listen_address="127.0.0.1:29999",
                distributed_init_method="tcp://10.0.0.1:29500", worker_authkey="k")
    EngineConfig(**base)                                             # complete: accepted
    with pytest.raises(ValueError, match="worker_listen_address"):
        EngineConfig(**{**base, "worker_listen_address": None})
    with pytest.raises(ValueError, match="worker_listen_address"):
        EngineConfig(**{**base, "worker_listen_address": "127.0.0.1"})
    with pytest.raises(ValueError, match="distributed_init_method.*127.0.0.1"):
        EngineConfig(**{**base, "distributed_init_method": None})
    old = os.environ.pop("OPENINFER_WORKER_AUTHKEY", None)
    try:
        with pytest.raises(ValueError, match="OPENINFER_WORKER_AUTHKEY"):
            EngineConfig(**{**base, "worker_authkey": None})
        os.environ["OPENINFER_WORKER_AUTHKEY"] = "from-env"
        assert EngineConfig(**{**base, "worker_authkey": None}).resolved_worker_authkey == "from-env"
    finally:
        os.environ.pop("OPENINFER_WORKER_AUTHKEY", None)
        if old is not None:
            os.environ["OPENINFER_WORKER_AUTHKEY"] = old
    for n in (0, 3):
        with pytest.raises(ValueError, match="num_local_ranks"):
            EngineConfig(**{**base, "num_local_ranks": n})
    with pytest.raises(ValueError, match="worker_listen_address is only used"):
        EngineConfig(**{**base, "num_local_ranks": 2})
