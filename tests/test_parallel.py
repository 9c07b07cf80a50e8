"""Multi-process engines on CPU (2 gloo ranks, real worker processes): attention DP + expert parallelism on
DeepSeek-V4 (fp32 and the published FP8/MXFP4 format) and plain DP give the outputs of one process through
chunked prefill, prefix-cache hits, async scheduling, preemption and aborts; no model parameter requires grad
(every family and layout); moe_lb is live from the first step; EPLB (automatic, or on request between
generations and while serving) lowers it without changing outputs; a worker's error reaches the user whether it
failed at start, in a step, a call or at shutdown; workers never outlive their engine or server; bad layouts fail
before any worker starts."""

from __future__ import annotations

import asyncio
import functools
import math
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file

from openinfer import LLM
from openinfer.distributed.eplb import num_physical_experts
from openinfer.executor.multiproc import WorkerError
from openinfer.sampling_params import SamplingParams
from tests.live_server import _free_port, wait_healthy
from tests.test_deepseek_v4 import make_v4, prompts_of

GREEDY = dict(temperature=0, ignore_eos=True)
# small chunks (chunked prefill), 32-token blocks (prefix hits on short prompts), an explicit small pool
V4_OPTS = dict(device="cpu", dtype="float32", block_size=32, max_num_batched_tokens=16, max_num_seqs=4,
               num_kv_blocks=64)
EP2 = dict(data_parallel_size=2, enable_expert_parallel=True)
LENGTHS = (5, 40, 77, 13, 100, 66)
HOT_EXPERTS = (2, 3, 4)          # all on EP rank 0 in the initial placement (rank 0 holds slots 0..4 of 10)


# ---- helpers ----------------------------------------------------------------------------------------------
def params(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, logprobs=0, **GREEDY)


def generate(llm: LLM, prompts, max_tokens: int = 12):
    return llm.generate(prompt_token_ids=prompts, sampling_params=params(max_tokens), use_tqdm=False)


def assert_same_outputs(outs, refs, tol: float = 1e-4) -> None:
    """Same greedy tokens, and each chosen token's logprob within `tol`."""
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        tokens = r.outputs[0].token_ids
        assert o.outputs[0].token_ids == tokens
        assert len(o.outputs[0].logprobs) == len(tokens) > 0
        for a, b, t in zip(o.outputs[0].logprobs, r.outputs[0].logprobs, tokens):
            assert abs(a[t].logprob - b[t].logprob) < tol, (a[t].logprob, b[t].logprob)


def shared_prefix_prompts():
    """Two prompts sharing a 70-token prefix (two full 32-token blocks)."""
    base = prompts_of(70, seed=11)[0]
    return base + [5, 6, 7], base + [9, 10, 11, 12]


def run_workload(llm: LLM):
    """Six prompts of varied lengths together, then two prompts sharing a prefix one after the other (the
    second hits the first's cached blocks: an idle engine sends a lone request to DP group 0 both times)."""
    first, second = shared_prefix_prompts()
    batch = generate(llm, prompts_of(*LENGTHS, seed=3), max_tokens=16)
    a = generate(llm, [first])
    b = generate(llm, [second])
    return batch + a + b


def rank_stats(llm: LLM) -> list[dict]:
    """Each rank's stats, read from the workers now."""
    return llm.engine.call_ranks("stats")


def assert_ranks_idle(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    for s in rank_stats(llm):
        assert s["num_running"] == 0 and s["num_waiting"] == 0
        assert s["kv_blocks_free"] == s["kv_blocks_total"]


def worker_pids(llm: LLM) -> list[int]:
    return [p.pid for p in llm.engine._procs]


def assert_gone(pids, timeout: float = 30.0) -> None:
    """Every pid has exited (zombies count as exited: nothing runs, nothing is held)."""
    deadline = time.time() + timeout
    alive = list(pids)
    while alive and time.time() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if alive:
            time.sleep(0.1)
    assert not alive, f"processes still alive: {alive}"


def make_rank_raise(engine, rank: int, method: str, message: str) -> None:
    """From now on `rank`'s `LLMEngine.<method>()` raises ValueError naming `message`: an instance attribute
    shadows the method (int() of the text, which raises), set by a call to that rank alone."""
    engine._send(rank, ("call", "__setattr__", (method, functools.partial(int, message))))
    engine._gather_replies([rank], 30, "call")


def metric_values(text: str, name: str, label: str = "model_name") -> dict[str, float]:
    """{value of `label`: sample} of one metric in Prometheus text (its `name{labels} sample` lines)."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, sample = line[len(name):].rsplit(" ", 1)
            out[re.search(label + r'="([^"]*)"', labels).group(1)] = float(sample)
    return out


def make_skewed_v4(path: Path) -> None:
    """The tiny V4 whose every routed token goes to HOT_EXPERTS: hash layers' token->experts tables point
    there, learned layers' correction bias favours them by far."""
    make_v4(path)
    f = next(path.glob("*.safetensors"))
    tensors = load_file(str(f))
    hot = torch.tensor(HOT_EXPERTS)
    for name, t in tensors.items():
        if name.endswith("gate.tid2eid"):
            tok = torch.arange(t.shape[0])
            t[:, 0] = hot[tok % 3]
            t[:, 1] = hot[(tok + 1) % 3]
        elif name.endswith("gate.bias"):
            t.zero_()
            t[hot] = 10.0
    save_file(tensors, str(f), metadata={"format": "pt"})


# ---- fixtures ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def v4_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4")
    make_v4(path)
    return path


@pytest.fixture(scope="module")
def reference(v4_path):
    """One process, synchronous, a pool big enough for everything: the outputs to equal."""
    llm = LLM(str(v4_path), **V4_OPTS)
    outs = run_workload(llm)
    yield llm, outs
    llm.shutdown()


@pytest.fixture(scope="module")
def skewed_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4skew")
    make_skewed_v4(path)
    return path


SKEW_FIXED = prompts_of(6, 9, seed=12)
SKEW_PROMPTS = [[7] * 12, [7, 8] * 5, [9] * 20, [8] * 3]


@pytest.fixture(scope="module")
def skewed_reference(skewed_path):
    """One process's greedy outputs on the skewed model: SKEW_FIXED (6 tokens), SKEW_PROMPTS (40 tokens)."""
    one = LLM(str(skewed_path), **V4_OPTS)
    try:
        yield generate(one, SKEW_FIXED, max_tokens=6), generate(one, SKEW_PROMPTS, max_tokens=40)
    finally:
        one.shutdown()


@pytest.fixture(scope="module")
def ep_sync(v4_path):
    """Built in a thread that ends at once (test_an_engine_built_in_a_thread_outlives_the_thread checks that the
    workers outlive it; every test here using it relies on that too)."""
    import threading

    box = {}
    t = threading.Thread(target=lambda: box.setdefault(
        "llm", LLM(str(v4_path), **V4_OPTS, **EP2, async_scheduling=False)))
    t.start()
    t.join()
    llm = box["llm"]
    yield llm
    llm.shutdown()


# ---- 1. DP2 + EP2 equals one process -------------------------------------------------------------------------
def test_dp_ep_equals_one_process_with_chunks_and_prefix_hits(ep_sync, reference):
    _, ref = reference
    outs = run_workload(ep_sync)
    assert_same_outputs(outs, ref)
    assert outs[-1].num_cached_tokens >= 64                 # the shared prefix's two blocks were reused
    per_rank = ep_sync.engine.stats()["per_rank"]
    assert all(s["prefix_cache_queried_tokens"] > 0 for s in per_rank)   # both DP ranks served requests
    assert "moe_lb" in ep_sync.engine.stats()
    assert_ranks_idle(ep_sync)


def test_dp_ep_async_scheduling_and_preemption_equal_one_process(v4_path, reference):
    _, ref = reference
    llm = LLM(str(v4_path), **{**V4_OPTS, "num_kv_blocks": 6}, **EP2, async_scheduling=True)
    try:
        outs = run_workload(llm)
        assert_same_outputs(outs, ref)
        per_rank = llm.engine.stats()["per_rank"]
        assert sum(s["num_preemptions"] for s in per_rank) > 0, per_rank
        assert_ranks_idle(llm)
    finally:
        llm.shutdown()


# ---- 2. abort mid-run ------------------------------------------------------------------------------------------
def test_abort_mid_run_leaves_others_unchanged_and_pools_idle(ep_sync, reference):
    ref_llm, _ = reference
    prompts = prompts_of(30, 50, 20, 45, seed=8)
    expected = generate(ref_llm, prompts, max_tokens=20)
    engine = ep_sync.engine
    ids = [engine.add_request(p, params(20)) for p in prompts]
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        steps += 1
        if steps == 6:
            assert ids[1] not in done
            engine.abort_request(ids[1])
    assert ids[1] not in done or len(done[ids[1]].outputs[0].token_ids) < 20
    kept = [i for i in range(4) if i != 1]
    assert_same_outputs([done[ids[i]] for i in kept], [expected[i] for i in kept])
    assert_ranks_idle(ep_sync)
    for s in engine.stats()["per_rank"]:
        assert s["kv_blocks_free"] == s["kv_blocks_total"] and s["num_running"] == 0


# ---- 3. plain data parallelism --------------------------------------------------------------------------------
def test_dp_without_ep_equals_one_process_and_uses_both_ranks(v4_path, reference):
    _, ref = reference
    llm = LLM(str(v4_path), **V4_OPTS, data_parallel_size=2)
    try:
        outs = run_workload(llm)
        assert_same_outputs(outs, ref)
        per_rank = llm.engine.stats()["per_rank"]
        assert len(per_rank) == 2
        assert all(s["prefix_cache_queried_tokens"] > 0 for s in per_rank), per_rank
        assert_ranks_idle(llm)
    finally:
        llm.shutdown()


# ---- 4. the published format ----------------------------------------------------------------------------------
def test_published_fp8_mxfp4_checkpoint_with_dp_ep_equals_one_process(tmp_path_factory):
    from tests.test_quantization import TINY_PUBLISHED, write_published

    src = write_published(tmp_path_factory.mktemp("published") / "ckpt", TINY_PUBLISHED)
    prompts = prompts_of(7, 33, 60, 21, seed=5)
    one = LLM(str(src), **V4_OPTS)
    try:
        ref = generate(one, prompts)
    finally:
        one.shutdown()
    llm = LLM(str(src), **V4_OPTS, **EP2)
    try:
        assert_same_outputs(generate(llm, prompts), ref)
        assert_ranks_idle(llm)
    finally:
        llm.shutdown()


# ---- 5. weights never track gradients ---------------------------------------------------------------------------
def test_no_parameter_requires_grad_in_any_family_or_layout(tmp_path, v4_path, smollm_dir):
    """Every family's build freezes what it loads, in one process and on a rank of each layout it takes (TP, EP:
    built here without a process group, as test_v41_parallel builds its ranks): an inference engine has no use
    for gradient tracking, and a weight that tracks one cannot be written in place outside a step (EPLB's moves
    on request, a reload)."""
    from openinfer.config import EngineConfig
    from openinfer.distributed.parallel_state import ParallelContext
    from openinfer.models.registry import load_model
    from tests.test_gemma3 import make_tiny_gemma3
    from tests.test_models_tiny import make_tiny

    tp = ParallelContext(world_size=2, rank=1, tp_size=2, tp_rank=1)
    ep = ParallelContext(world_size=2, rank=1, dp_size=2, dp_rank=1, ep_size=2, ep_rank=1, num_redundant_experts=1)
    fp32, bf16 = EngineConfig(device="cpu", dtype="float32"), EngineConfig(device="cpu", dtype="bfloat16")
    cases = [("llama", make_tiny(tmp_path, smollm_dir, "llama")[0], fp32, [tp]),
             ("gemma3", make_tiny_gemma3(tmp_path, smollm_dir)[0], fp32, [tp]),
             ("deepseek-v4", v4_path, fp32, [tp, ep]),
             ("deepseek-v41", "deepseek-v41-tiny", bf16, [ep])]
    for family, model, config, layouts in cases:
        for ctx in [ParallelContext.single(), *layouts]:
            net = load_model(model, config, parallel=ctx)
            names = [n for n, _ in net.named_parameters()]
            assert names, family
            grad = [n for n, p in net.named_parameters() if p.requires_grad]
            assert not grad, (family, ctx.tp_size, ctx.ep_size, grad[:5])


# ---- 6. EPLB ---------------------------------------------------------------------------------------------------
def test_eplb_rebalances_a_skewed_load_without_changing_outputs(skewed_path, skewed_reference):
    """Automatic: every `interval` forwards; moe_lb is read from the live window from the first step on."""
    assert num_physical_experts(8, 1, 2) == 10               # 1 redundant rounds up to 2: 10 slots, 5 per rank
    ref_fixed, ref_skew = skewed_reference
    interval = 32                  # past the first generation, inside the first round of skewed requests
    llm = LLM(str(skewed_path), **V4_OPTS, **EP2, enable_eplb=True, num_redundant_experts=1, eplb_window_steps=8,
              eplb_rebalance_interval_steps=interval)
    try:
        engine = llm.engine
        before = generate(llm, SKEW_FIXED, max_tokens=6)
        assert engine.stats()["eplb_rebalances"] == 0
        assert_same_outputs(before, ref_fixed)
        # keep skewed requests flowing until the rebalance (requests in flight continue across it)
        ids, done, lb_before = [], {}, []
        for rnd in range(10):
            ids += [engine.add_request(p, params(40), request_id=f"skew{rnd}-{i}") for i, p in enumerate(SKEW_PROMPTS)]
            while engine.has_unfinished_requests():
                for o in engine.step():
                    if o.finished:
                        done[o.request_id] = o
                st = engine.stats()
                if st["eplb_rebalances"] == 0:
                    lb_before.append(st["moe_lb"])
            if engine.stats()["eplb_rebalances"] >= 1:
                break
        stats = engine.stats()
        assert stats["eplb_rebalances"] >= 1
        assert len(lb_before) >= 8                                # read at every step before the rebalance
        assert min(lb_before) > 1.9, lb_before                    # everything on rank 0's experts: 2 = worst
        per_rank = rank_stats(llm)
        assert len({s["moe_lb"] for s in per_rank}) == 1          # every rank computed the same placement
        assert stats["moe_lb"] < min(lb_before) - 0.5, (stats["moe_lb"], lb_before)
        for k, rid in enumerate(ids):
            assert_same_outputs([done[rid]], [ref_skew[k % len(SKEW_PROMPTS)]])
        after = generate(llm, SKEW_FIXED, max_tokens=6)
        assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]
        assert_same_outputs(after, ref_fixed)
        assert_ranks_idle(llm)
    finally:
        llm.shutdown()


def test_moe_lb_is_live_before_any_rebalance_and_rebalance_on_request_between_generations(skewed_path,
                                                                                          skewed_reference):
    """Every token routed to experts on rank 0: after one short generation `stats()` and `/metrics` (the server's
    collector over this engine) already read moe_lb ~2 and the load behind it, long before EPLB's interval;
    `call_ranks("rebalance_experts")` between generations (outside any step: weights move with no gradient
    tracking) moves experts on both ranks alike; the next generation reads the lower moe_lb, and outputs equal
    one process before and after."""
    from prometheus_client import generate_latest

    from openinfer.distributed.eplb import ExpertPlacement
    from openinfer.serving.metrics import EngineMetrics

    ref_fixed, ref_skew = skewed_reference
    llm = LLM(str(skewed_path), **V4_OPTS, **EP2, enable_eplb=True, num_redundant_experts=1,
              eplb_rebalance_interval_steps=10**6)       # EPLB runs when the test says
    try:
        engine = llm.engine
        assert math.isnan(engine.stats()["moe_lb"])       # no step yet
        metrics = EngineMetrics("tiny", engine)
        assert_same_outputs(generate(llm, SKEW_FIXED, max_tokens=6), ref_fixed)
        st = engine.stats()
        assert st["moe_lb"] > 1.9, st["moe_lb"]
        assert st["eplb_rebalances"] == 0 and 0 < st["moe_load_steps"] <= 8
        hot_rank = ExpertPlacement.initial(1, 8, 10, 2).local_logical(0)[0].tolist()
        assert set(HOT_EXPERTS) <= set(hot_rank)
        assert st["moe_rank_load"][0] > 0 and st["moe_rank_load"][1] == 0, st["moe_rank_load"]
        assert sum(st["moe_expert_load"]) > 0
        assert all(n == 0 for e, n in enumerate(st["moe_expert_load"]) if e not in HOT_EXPERTS), st
        text = generate_latest(metrics.registry).decode()
        assert metric_values(text, "openinfer:moe_lb") == {"tiny": st["moe_lb"]}
        assert metric_values(text, "openinfer:moe_rank_load", "ep_rank") == {"0": st["moe_rank_load"][0], "1": 0.0}
        assert metric_values(text, "openinfer:moe_expert_load", "expert") == {
            str(e): n for e, n in enumerate(st["moe_expert_load"])}

        moves = engine.call_ranks("rebalance_experts")
        assert len(set(moves)) == 1, moves                        # every rank the same placement
        before, after, moved = moves[0]
        assert moved and before == pytest.approx(st["moe_lb"]) and after < before - 0.5, moves
        assert_same_outputs(generate(llm, SKEW_FIXED, max_tokens=6), ref_fixed)
        assert_same_outputs(generate(llm, SKEW_PROMPTS[:2], max_tokens=40), ref_skew[:2])
        st = engine.stats()
        assert st["eplb_rebalances"] == 1 and st["moe_lb"] < 1.5, st
        assert min(st["moe_rank_load"]) > 0                      # rank 1 now computes some of the hot experts
        text = generate_latest(metrics.registry).decode()
        assert metric_values(text, "openinfer:moe_lb") == {"tiny": st["moe_lb"]}
        assert metric_values(text, "openinfer:eplb_rebalances_total") == {"tiny": 1.0}
        assert_ranks_idle(llm)
    finally:
        llm.shutdown()


def test_rebalance_on_request_while_serving(skewed_path, skewed_reference):
    """A server's engine thread (AsyncLLMEngine) steps the skewed requests; from another thread,
    `call_ranks("rebalance_experts")` runs between two of its steps while they are in flight: experts move on
    both ranks and every request still gives one process's tokens."""
    from openinfer.serving.async_engine import AsyncLLMEngine

    _, ref_skew = skewed_reference
    llm = LLM(str(skewed_path), **V4_OPTS, **EP2, enable_eplb=True, num_redundant_experts=1,
              eplb_rebalance_interval_steps=10**6)
    served = AsyncLLMEngine(llm.engine)
    served.start()

    async def serve():
        tokens: dict[int, list[int]] = {i: [] for i in range(len(SKEW_PROMPTS))}
        finished: set[int] = set()
        first_token = asyncio.Event()

        async def one(i: int) -> None:
            async for out in served.generate(SKEW_PROMPTS[i], params(40), request_id=f"serve-{i}"):
                tokens[i] += out.outputs[0].token_ids
                first_token.set()
                if out.finished:
                    finished.add(i)

        tasks = [asyncio.create_task(one(i)) for i in range(len(SKEW_PROMPTS))]
        await first_token.wait()
        moves = await asyncio.to_thread(llm.engine.call_ranks, "rebalance_experts")
        in_flight = len(SKEW_PROMPTS) - len(finished)
        await asyncio.gather(*tasks)
        return tokens, moves, in_flight

    try:
        tokens, moves, in_flight = asyncio.run(serve())
        assert in_flight > 0                                      # the rebalance came while requests ran
        assert len(set(moves)) == 1 and moves[0][2], moves        # experts moved, the same on every rank
        assert moves[0][1] < moves[0][0] - 0.5, moves
        assert [tokens[i] for i in range(len(SKEW_PROMPTS))] == [o.outputs[0].token_ids for o in ref_skew]
        assert llm.engine.stats()["eplb_rebalances"] == 1
    finally:
        served.shutdown()
        llm.shutdown()
    assert served.error is None, served.error


# ---- 7. lifecycle -----------------------------------------------------------------------------------------------
def test_a_dead_worker_is_named_and_the_others_stop(v4_path):
    llm = LLM(str(v4_path), **V4_OPTS, **EP2)
    engine, procs = llm.engine, list(llm.engine._procs)
    try:
        engine.add_request(prompts_of(10, seed=2)[0], params(30))
        engine.step()
        procs[1].kill()
        procs[1].join(timeout=10)
        with pytest.raises(WorkerError, match="rank 1"):
            while True:
                engine.step()
        assert not any(p.is_alive() for p in procs)
        assert_gone([p.pid for p in procs])
    finally:
        llm.shutdown()


def test_a_worker_error_at_start_reaches_the_user(v4_path):
    """Every rank fails building its engine (the KV pool is too small for max_model_len, found only where the
    pool is sized): the WorkerError carries the rank's own message, and no worker is left."""
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(WorkerError) as err:
        LLM(str(v4_path), **{**V4_OPTS, "max_model_len": 4096}, **EP2)
    text = str(err.value)
    assert "raised during 'start'" in text and "does not fit the KV pool" in text, text
    assert_gone({p.pid for p in psutil.Process().children(recursive=True)} - children)


def test_a_worker_error_in_a_step_names_that_rank_and_its_message(v4_path):
    """Rank 1 raises in a step; rank 0, left in the step's collective, fails too (its connection reset), maybe
    first: the WorkerError names rank 1 with its message, then rank 0's; no worker is left."""
    llm = LLM(str(v4_path), **V4_OPTS, **EP2)
    pids = worker_pids(llm)
    try:
        make_rank_raise(llm.engine, 1, "step", "rank one broke its step")
        with pytest.raises(WorkerError) as err:
            generate(llm, prompts_of(9, seed=1), max_tokens=4)
        text = str(err.value)
        assert text.startswith("worker rank 1 raised during 'step'"), text
        assert "rank one broke its step" in text and "(rank 0 failed too: " in text, text
        assert_gone(pids)
    finally:
        llm.shutdown()


def test_a_worker_error_in_a_call_reaches_the_user(v4_path):
    """`call_ranks` of something every rank refuses (EPLB on an engine without expert parallelism): the ranks'
    own message, and no worker is left."""
    llm = LLM(str(v4_path), **V4_OPTS, data_parallel_size=2)
    pids = worker_pids(llm)
    try:
        with pytest.raises(WorkerError) as err:
            llm.engine.call_ranks("rebalance_experts")
        text = str(err.value)
        assert "raised during 'rebalance_experts'" in text, text
        assert "ValueError: rebalance_experts needs enable_expert_parallel" in text, text
        assert_gone(pids)
    finally:
        llm.shutdown()


def test_a_worker_error_at_shutdown_reaches_the_user(v4_path):
    """Rank 1 fails stopping its engine: shutdown() raises its message once every worker has stopped."""
    llm = LLM(str(v4_path), **V4_OPTS, **EP2)
    pids = worker_pids(llm)
    generate(llm, prompts_of(9, seed=1), max_tokens=2)
    make_rank_raise(llm.engine, 1, "shutdown", "rank one could not stop")
    with pytest.raises(WorkerError) as err:
        llm.shutdown()
    text = str(err.value)
    assert text.startswith("worker rank 1 raised during 'shutdown'") and "rank one could not stop" in text, text
    assert_gone(pids, timeout=5)
    llm.shutdown()                                           # stopped: nothing more to say


def test_create_and_shutdown_twice_leaves_no_workers(v4_path):
    for _ in range(2):
        llm = LLM(str(v4_path), **V4_OPTS, **EP2)
        pids = worker_pids(llm)
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
        generate(llm, prompts_of(9, seed=1), max_tokens=4)
        llm.shutdown()
        assert_gone(pids, timeout=5)
        assert not set(pids) & {p.pid for p in multiprocessing.active_children()}
        llm.shutdown()                                       # idempotent


def test_bad_layouts_fail_before_any_worker_starts(v4_path, smollm_dir):
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match="no routed experts"):
        LLM(str(smollm_dir), device="cpu", **EP2)
    with pytest.raises(ValueError, match="DeepSeek-V4 does not combine tensor_parallel_size"):
        LLM(str(v4_path), **V4_OPTS, tensor_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="enable_eplb needs enable_expert_parallel"):
        LLM(str(v4_path), **V4_OPTS, data_parallel_size=2, enable_eplb=True)
    with pytest.raises(ValueError, match="data_parallel_size"):
        LLM(str(v4_path), **V4_OPTS, data_parallel_size=0)
    with pytest.raises(ValueError, match="enable_expert_parallel needs more than one rank"):
        LLM(str(v4_path), **V4_OPTS, enable_expert_parallel=True)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children


# ---- 8. the server ----------------------------------------------------------------------------------------------
def test_server_with_dp_ep_serves_v4_and_leaves_no_workers(v4_path, tmp_path):
    import openai

    port = _free_port()
    log = open(tmp_path / "server.log", "wb")     # a file, not a pipe nobody drains
    proc = subprocess.Popen([sys.executable, "-m", "openinfer", "serve", "--model", str(v4_path), "--device", "cpu",
                             "--dtype", "float32", "--port", str(port), "--block-size", "32", "--max-num-seqs", "4",
                             "--kv-cache-memory-bytes", str(32 << 20), "--data-parallel-size", "2",
                             "--enable-expert-parallel"],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, 180, proc)
        assert proc.poll() is None, (tmp_path / "server.log").read_text(errors="replace")[-3000:]
        workers = [c for c in psutil.Process(proc.pid).children(recursive=True)
                   if "openinfer" in " ".join(c.cmdline()) or "multiprocessing" in " ".join(c.cmdline())]
        descendants = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert len(workers) >= 2, [c.cmdline() for c in psutil.Process(proc.pid).children(recursive=True)]
        client = openai.OpenAI(base_url=base + "/v1", api_key="x")
        r = client.chat.completions.create(model="DeepSeek-V4-Pro", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=6, temperature=0,
                                           extra_body={"thinking": {"type": "disabled"}})
        assert r.model == "DeepSeek-V4-Pro"
        assert r.choices[0].message.content
        assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 6
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        metrics = httpx.get(base + "/metrics", timeout=10).text
        lb = metric_values(metrics, "openinfer:moe_lb")
        assert len(lb) == 1 and 1.0 <= next(iter(lb.values())) <= 2.0, lb    # live after the request's steps
        assert len(metric_values(metrics, "openinfer:moe_rank_load", "ep_rank")) == 2
        assert sum(metric_values(metrics, "openinfer:moe_expert_load", "expert").values()) > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert_gone(descendants)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


# ---- 9. tensor parallelism through the front end, and a request one rank refuses -------------------------------
def test_dp2_tp2_llama_through_the_front_end_equals_one_process(tmp_path, smollm_dir):
    """Four worker processes (2 DP groups x 2 TP ranks): each group's TP ranks run the same schedule from
    the same commands; chunked prefill, a prefix hit and an abort included."""
    from tests.test_models_tiny import make_tiny

    path, _ = make_tiny(tmp_path, smollm_dir, "llama3-rope-bias")
    opts = dict(device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    prompts = [[(7 * i + 3 * j) % 4000 + 10 for j in range(n)] for i, n in enumerate((13, 3, 19, 9))]
    prompts.append(prompts[2][:16] + [77, 78])               # shares four blocks with prompt 2
    one = LLM(str(path), **opts)
    expected = generate(one, prompts)
    one.shutdown()
    llm = LLM(str(path), data_parallel_size=2, tensor_parallel_size=2, **opts)
    try:
        assert_same_outputs(generate(llm, prompts[:4]), expected[:4])
        assert_same_outputs(generate(llm, prompts[4:]), expected[4:])
        assert llm.engine.stats()["prefix_cache_hit_tokens"] >= 16
        engine = llm.engine
        ids = [engine.add_request(p, params(12)) for p in prompts[:2]]
        engine.step()
        engine.abort_request(ids[0])
        while engine.has_unfinished_requests():
            engine.step()
        per_rank = engine.call_ranks("stats")
        assert len(per_rank) == 4
        assert all(s["kv_blocks_free"] == s["kv_blocks_total"] and s["num_running"] == 0 for s in per_rank)
    finally:
        llm.shutdown()


def test_a_request_a_rank_refuses_fails_alone(ep_sync, reference):
    """A request that gets past the front end but fails on its rank (here: a request id that rank already
    holds, sent straight to it) comes back aborted with the reason; the engine keeps serving."""
    ref_llm, _ = reference
    engine = ep_sync.engine
    prompt = prompts_of(30, seed=3)[0]
    rid = engine.add_request(prompt, params(8))
    group = engine.requests[rid]
    rank = engine._groups[group][0]
    engine._send(rank, ("add", dict(prompt_token_ids=prompt, params=params(8), prompt=None, request_id=rid,
                                    arrival_time=time.time())))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    refused = [o for o in outs if o.request_id == rid and o.outputs[0].finish_reason == "abort"]
    assert refused and "already in use" in str(refused[0].outputs[0].stop_reason)
    assert_same_outputs(generate(ep_sync, [prompt], 8), generate(ref_llm, [prompt], 8))
    assert_ranks_idle(ep_sync)


def test_an_engine_built_in_a_thread_outlives_the_thread(ep_sync):
    """Workers watch their parent process, not the thread that started them (ep_sync was built in a thread that
    has ended)."""
    time.sleep(1.5)                        # past the watchdog's period, even when this test runs alone
    assert all(p.is_alive() for p in ep_sync.engine._procs)
    assert generate(ep_sync, prompts_of(9, seed=5), 4)[0].outputs[0].token_ids
    assert_ranks_idle(ep_sync)


_KILLED_FRONT_END = """
import sys
from openinfer import LLM
llm = LLM(sys.argv[1], device="cpu", dtype="float32", block_size=32, num_kv_blocks=64,
          data_parallel_size=2, enable_expert_parallel=True)
print(" ".join(str(p.pid) for p in llm.engine._procs), flush=True)
sys.stdin.read()
"""


def test_workers_die_with_a_killed_front_end(v4_path):
    """SIGKILL on the front end (no finalizer runs): its workers exit by themselves."""
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_FRONT_END, str(v4_path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
    finally:
        proc.kill()
        proc.wait()
    assert_gone(pids, timeout=10.0)
