"""The Ray executor backend (`distributed_executor_backend="ray"`) on CPU with gloo, over one local Ray cluster for
the whole module (started here with `ray.init`; the engines in this process join it as the driver that started it,
`openinfer serve` in a subprocess joins it through RAY_ADDRESS).

Each rank is a Ray actor placed by a placement group; the front end is the same one as for processes. DP2 + EP2 on
the tiny DeepSeek-V4 and TP2 on a tiny Llama give the outputs of one process; `openinfer serve` runs on it unchanged
(the openai client); a rank failing at start, an actor killed mid-run and ranks the cluster cannot place are errors
naming the rank (or the groups), never a hang; after shutdown or a failure no actor process is left and the cluster
holds no placement group or CPU it did not hold before. Without Ray the option is refused naming the extra."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import ray
from ray.util.placement_group import placement_group_table

from openinfer import LLM, EngineConfig
from openinfer.executor.multiproc import WorkerError
from tests.live_server import _free_port, wait_healthy
from tests.test_deepseek_v4 import prompts_of
from tests.test_parallel import EP2, V4_OPTS, assert_gone, assert_same_outputs, generate, params

RAY = dict(distributed_executor_backend="ray")
CLUSTER_CPUS = 4
V4 = "deepseek-v4-tiny"          # generated once into the openinfer cache (shared with other test modules)
PROMPTS = prompts_of(5, 40, 77, 13, seed=3)     # chunked prefill (16-token chunks), both DP groups busy


@pytest.fixture(scope="module")
def ray_address():
    """One local Ray cluster for the module (4 logical CPUs: a 2-rank engine takes 2), stopped at the end: its
    processes are this one's children, so nothing outlives the module."""
    context = ray.init(address="local", num_cpus=CLUSTER_CPUS, object_store_memory=128 << 20, include_dashboard=False,
                       logging_level="WARNING")
    yield context.address_info["gcs_address"]
    ray.shutdown()


@pytest.fixture(scope="module")
def reference():
    """One process's greedy outputs and logprobs."""
    llm = LLM(V4, **V4_OPTS)
    try:
        return generate(llm, PROMPTS)
    finally:
        llm.shutdown()


def cluster_holds() -> tuple[set[str], float]:
    """(ids of the placement groups not removed, CPUs in use) on the cluster now."""
    groups = {gid for gid, g in placement_group_table().items() if g["state"] != "REMOVED"}
    return groups, CLUSTER_CPUS - ray.available_resources().get("CPU", 0)


def assert_holds_no_more_than(before: tuple[set[str], float], timeout: float = 15.0) -> None:
    """The cluster holds no placement group and no CPU that it did not hold at `before` (Ray frees them
    asynchronously: waits up to `timeout`)."""
    deadline = time.time() + timeout
    while True:
        groups, cpus = cluster_holds()
        if groups <= before[0] and cpus <= before[1]:
            return
        assert time.time() < deadline, (f"left on the cluster: placement groups {groups - before[0]}, {cpus} CPUs "
                                        f"in use (before: {before[1]})")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def v4_on_ray(ray_address):
    """DP2 + EP2 tiny V4 with its ranks as Ray actors, for the next two tests (the second kills a rank: it ends the
    engine, before the tests that want the whole cluster free)."""
    llm = LLM(V4, **V4_OPTS, **EP2, **RAY)
    yield llm
    llm.shutdown()


def test_dp2_ep2_v4_under_ray_equals_one_process(v4_on_ray, reference):
    engine = v4_on_ray.engine
    assert engine._procs == [None, None]                           # no rank is a process of ours: Ray's workers
    assert [psutil.Process(pid).parent().name() for pid in engine._ray.pids] == ["raylet", "raylet"]
    assert_same_outputs(generate(v4_on_ray, PROMPTS), reference)
    assert all(s["prefix_cache_queried_tokens"] > 0 for s in engine.stats()["per_rank"])   # both DP ranks served
    groups = [placement_group_table(g) for g in engine._ray.groups]
    assert [(g["strategy"], len(g["bundles"]), g["state"]) for g in groups] == [("STRICT_PACK", 1, "CREATED")] * 2


def test_a_killed_actor_is_named_and_stops_the_engine(v4_on_ray):
    """Rank 1's actor process is killed mid-run: the next step fails naming rank 1 and Ray's account of its death;
    rank 0's actor is stopped too, the placement groups are removed, every CPU is free again."""
    engine = v4_on_ray.engine
    pids = list(engine._ray.pids)
    before = cluster_holds()
    own = {g.id.hex() for g in engine._ray.groups}
    assert own <= before[0] and before[1] >= 2
    engine.add_request(prompts_of(10, seed=2)[0], params(30))
    engine.step()
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(WorkerError) as err:
        for _ in range(1000):
            engine.step()
    text = str(err.value)
    assert text.startswith("worker rank 1 (Ray actor on ") and f"pid {pids[1]})" in text, text
    assert "The actor is dead because its worker process has died" in text, text
    assert text.endswith("the engine was shut down"), text
    assert_gone(pids, timeout=10)
    assert_holds_no_more_than((before[0] - own, before[1] - 2))


def test_tp2_llama_under_ray_equals_one_process(ray_address, tmp_path, smollm_dir):
    """The two TP ranks are one placement group's two bundles (STRICT_PACK: one node)."""
    from tests.test_models_tiny import make_tiny

    path, _ = make_tiny(tmp_path, smollm_dir, "llama3-rope-bias")
    opts = dict(device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    prompts = [[(7 * i + 3 * j) % 4000 + 10 for j in range(n)] for i, n in enumerate((13, 3, 19, 9))]
    one = LLM(str(path), **opts)
    expected = generate(one, prompts)
    one.shutdown()
    before = cluster_holds()
    llm = LLM(str(path), tensor_parallel_size=2, **opts, **RAY)
    pids = list(llm.engine._ray.pids)
    try:
        (group,) = [placement_group_table(g) for g in llm.engine._ray.groups]
        assert (group["strategy"], len(group["bundles"])) == ("STRICT_PACK", 2)
        assert_same_outputs(generate(llm, prompts), expected)
    finally:
        llm.shutdown()
    assert_gone(pids, timeout=10)
    assert_holds_no_more_than(before)


def test_a_rank_error_at_start_is_named_and_leaves_nothing(ray_address):
    """Every rank fails building its engine (the KV pool is too small for max_model_len): the WorkerError carries a
    rank's own traceback; no actor or placement group is left."""
    before = cluster_holds()
    with pytest.raises(WorkerError) as err:
        LLM(V4, **{**V4_OPTS, "max_model_len": 4096}, **EP2, **RAY)
    text = str(err.value)
    assert "raised during 'start'" in text and "does not fit the KV pool" in text, text
    assert_holds_no_more_than(before)


def test_ranks_the_cluster_cannot_place_fail_naming_the_groups_and_leave_nothing(ray_address):
    """One more one-CPU DP group than the cluster has free CPUs: at the start timeout, an error naming what could
    not be placed and what the cluster has; the groups that were placed are removed."""
    before = cluster_holds()
    dp = int(CLUSTER_CPUS - before[1]) + 1
    with pytest.raises(WorkerError, match=rf"Ray could not place 1 of the {dp} rank groups \(1 x \{{'CPU': 1\}} each"):
        LLM(V4, **V4_OPTS, data_parallel_size=dp, worker_start_timeout_s=1, **RAY)
    assert_holds_no_more_than(before)


def test_serve_on_ray_through_the_openai_client(ray_address, tmp_path):
    """`openinfer serve --distributed-executor-backend ray` joins the cluster at RAY_ADDRESS; SIGTERM stops it
    cleanly and leaves nothing on the cluster."""
    import openai

    port = _free_port()
    before = cluster_holds()
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "openinfer", "serve", V4, "--device", "cpu",
                                 "--dtype", "float32", "--port", str(port), "--block-size", "32", "--max-num-seqs",
                                 "4", "--kv-cache-memory-bytes", str(32 << 20), "--data-parallel-size", "2",
                                 "--enable-expert-parallel", "--distributed-executor-backend", "ray"],
                                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "RAY_ADDRESS": ray_address})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, 180, proc)
        assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
        assert cluster_holds()[1] == before[1] + 2                # its two ranks hold a CPU each
        client = openai.OpenAI(base_url=base + "/v1", api_key="x")
        (model,) = [m.id for m in client.models.list().data]
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=6, temperature=0,
                                           extra_body={"thinking": {"type": "disabled"}})
        assert r.choices[0].message.content
        assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 6
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log_path.read_text(errors="replace")[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert_holds_no_more_than(before)


def test_the_ray_backend_is_checked_before_anything_starts(monkeypatch):
    """Without Ray the option names the extra to install; options of the other backend, or a single rank, are
    refused by name."""
    from openinfer.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "m", "--distributed-executor-backend", "ray"])
    assert args.distributed_executor_backend == "ray"
    with pytest.raises(ValueError, match="needs several ranks"):
        EngineConfig(device="cpu", **RAY)
    with pytest.raises(ValueError, match="num_local_ranks is for ranks started by `openinfer worker`"):
        EngineConfig(device="cpu", data_parallel_size=2, num_local_ranks=1, **RAY)
    # the GPUs are the cluster's: a front end without one may still ask for CUDA ranks (under mp it may not)
    assert EngineConfig(device="cuda", data_parallel_size=2, **RAY).device == "cuda"
    with pytest.raises(ValueError, match="torch sees no CUDA device"):
        EngineConfig(device="cuda", data_parallel_size=2)
    monkeypatch.setitem(sys.modules, "ray", None)          # `import ray` raises ImportError
    with pytest.raises(ValueError, match=r"pip install 'openinfer\[ray\]'"):
        EngineConfig(device="cpu", data_parallel_size=2, **RAY)
