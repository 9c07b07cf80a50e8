"""The MoE exchanges of expert parallelism (distributed/all_to_all.py, expert_parallel.py) and the step agreement
(step_sync.py, shm_agreement.py), on CPU with gloo and real worker processes:
- all-to-all dispatch/combine equals one process at world size 2 (DP2 + EP2) and 4 (EP4), through chunked
  prefill, a prefix hit and async scheduling (tokens identical, logprobs within 1e-4 in fp32);
- two-batch overlap on gives the outputs of off, bit for bit in fp32 (and the gloo agreement those of the
  shared-memory one);
- ranks whose plans differ (work on one rank only, the others idle, an abort on one rank) — every step agrees
  afresh through shared memory, so there is no stale plan to fall back from;
- the dispatch layout on its own: exact (capacity = rows), no row lost or duplicated, padding where no row is;
- exact sizes (`all_to_all_exact`, eager steps): the same bits as the padded all-to-all and each rank receives
  only the rows routed to it, exchange by exchange at world size 2 and 4 (an idle rank, two halves, with and
  without overlap) and through the engine at world size 2 and 4 (chunked prefill, a prefix hit, preemption, an
  abort; the expert load counts EPLB reads equal the padded path's).
The engines are shared by the module (start-up dominates on two cores)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from openinfer import LLM, SamplingParams
from openinfer.distributed.all_to_all import (EXACT_MIN_EP, combine_layout, dispatch_index, dispatch_layout,
                                              exact_combine, exact_rows, pick_dispatch)
from openinfer.distributed.expert_parallel import (TBO_MIN_ROWS, ExpertRouting, MoeExchange, expert_parallel_moe,
                                                   split_rows)
from openinfer.executor.worker import end_process, rank_process_context
from tests.test_deepseek_v4 import prompts_of

MODEL = "deepseek-v4-tiny"
# chunked prefill (48-token steps: the first steps' rows reach TBO_MIN_ROWS, so they run in two halves),
# 16-token blocks (prefix hits on short prompts)
OPTS = dict(device="cpu", dtype="float32", block_size=16, max_num_batched_tokens=48, max_num_seqs=4,
            num_kv_blocks=48)
BASE = prompts_of(40, seed=5)[0]
PROMPTS = prompts_of(5, 37, 33, seed=3) + [BASE + [5, 6, 7]]
FOLLOW = [BASE + [9, 10, 11, 12]]           # hits the blocks BASE + .. left in the cache


def generate(llm, prompts, max_tokens=6):
    p = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0)
    return llm.generate(prompt_token_ids=prompts, sampling_params=p, use_tqdm=False)


def workload(llm):
    return generate(llm, PROMPTS) + generate(llm, FOLLOW)


def tokens_and_logprobs(outs):
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def assert_close(outs, refs, tol=1e-4):
    for (t, lp), (rt, rlp) in zip(tokens_and_logprobs(outs), tokens_and_logprobs(refs)):
        assert t == rt
        assert max(abs(a - b) for a, b in zip(lp, rlp)) < tol


@pytest.fixture(scope="module")
def reference():
    llm = LLM(MODEL, **OPTS)
    try:
        yield workload(llm)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def ep2_a2a():
    llm = LLM(MODEL, **OPTS, data_parallel_size=2, enable_expert_parallel=True, moe_dispatch="all_to_all")
    try:
        yield llm, workload(llm)
    finally:
        llm.shutdown()


def test_all_to_all_at_world_size_2_equals_one_process(ep2_a2a, reference):
    llm, outs = ep2_a2a
    assert_close(outs, reference)
    per_rank = llm.engine.stats()["per_rank"]
    # every step agreed through shared memory (all ranks on this host), and its host time is reported
    assert all(r["step_sync_rounds"] > 0 and r["step_sync_s"] >= 0 for r in per_rank)
    # each rank counted its own rows' expert load; summed after every step, so EPLB sees the same on all ranks
    loads = [r["moe_expert_load"] for r in per_rank]
    assert loads[0] == loads[1] and sum(loads[0]) > 0


def test_two_batch_overlap_is_bit_for_bit_the_one_batch_output(ep2_a2a):
    """Also the simple agreement channel (a gloo all-reduce) against the fast one (shared memory, the fixture's):
    the same plans, so the same bits."""
    _, outs = ep2_a2a
    llm = LLM(MODEL, **OPTS, data_parallel_size=2, enable_expert_parallel=True, moe_dispatch="all_to_all",
              two_batch_overlap=True, step_sync_channel="gloo")
    try:
        assert tokens_and_logprobs(workload(llm)) == tokens_and_logprobs(outs)
    finally:
        llm.shutdown()


def test_exact_all_to_all_at_world_size_2_equals_one_process_and_counts_the_same_load(ep2_a2a, reference):
    """Chunked prefill and a prefix hit (the module's workload), then preemption (longer generations in a small KV
    pool) and an abort, with every step eager: exact sizes on every MoE layer."""
    padded, _ = ep2_a2a
    llm = LLM(MODEL, **{**OPTS, "num_kv_blocks": 6}, data_parallel_size=2, enable_expert_parallel=True,
              moe_dispatch="all_to_all_exact")
    try:
        assert_close(workload(llm), reference)
        # each rank counted its own rows, summed after each step: the padded path's counts, on every rank
        loads = [r["moe_expert_load"] for r in llm.engine.stats()["per_rank"]]
        assert loads[0] == loads[1] == padded.engine.stats()["per_rank"][0]["moe_expert_load"]
        # the prompts again, generating longer: they hit the blocks the first run left, outgrow the pool and are
        # preempted and recomputed; their first tokens are the reference's
        longer = generate(llm, PROMPTS, max_tokens=24)
        per_rank = llm.engine.stats()["per_rank"]
        assert sum(r["num_preemptions"] for r in per_rank) > 0 and sum(r["prefix_cache_hit_tokens"]
                                                                        for r in per_rank) > 0, per_rank
        for (t, lp), (rt, rlp) in zip(tokens_and_logprobs(longer), tokens_and_logprobs(reference)):
            assert t[:len(rt)] == rt and max(abs(a - b) for a, b in zip(lp, rlp)) < 1e-4
        engine = llm.engine
        gone = engine.add_request(PROMPTS[3], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
        kept = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                             logprobs=0))
        done = {}
        for step in range(200):
            if step == 3:
                engine.abort_request(gone)
            done.update({o.request_id: o for o in engine.step() if o.finished})
            if not engine.has_unfinished_requests():
                break
        assert_close([done[kept]], [reference[1]])
        assert gone not in done or len(done[gone].outputs[0].token_ids) < 50
    finally:
        llm.shutdown()


@pytest.mark.parametrize("dispatch", ["all_to_all", "all_to_all_exact"])
def test_all_to_all_with_overlap_at_world_size_4_equals_one_process(reference, dispatch):
    llm = LLM(MODEL, **OPTS, data_parallel_size=4, enable_expert_parallel=True, moe_dispatch=dispatch,
              two_batch_overlap=True, async_scheduling=True)
    try:
        assert_close(workload(llm), reference)
        # ranks whose plans differ every step: work on one rank only (a lone request goes to one DP group),
        # the others idle, and an abort on that rank mid-run
        engine = llm.engine
        lone = generate(llm, [PROMPTS[1]], max_tokens=4)
        assert lone[0].outputs[0].token_ids == reference[1].outputs[0].token_ids[:4]
        gone = engine.add_request(PROMPTS[2], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
        for _ in range(3):
            engine.step()
        engine.abort_request(gone)
        while engine.has_unfinished_requests():
            engine.step()
        assert_close(generate(llm, [PROMPTS[0]]), [reference[0]])
    finally:
        llm.shutdown()


def test_dispatch_layout_sends_each_row_once_to_each_rank_it_needs():
    torch.manual_seed(0)
    n, k, ep, spr, width = 7, 3, 4, 2, 5
    phys = torch.randint(-1, ep * spr, (n, k))
    phys[3] = -1                                       # a padding row: goes nowhere
    rows = torch.arange(n * width, dtype=torch.uint8).view(n, width)
    send, index = dispatch_layout(torch.cat([rows, torch.zeros(n, 8 * k, dtype=torch.uint8)], 1), phys, spr, ep, n)
    assert send.shape == (ep * n, width + 8 * k) and index.shape == (ep, n)
    for d in range(ep):
        wanted = [i for i in range(n) if any(0 <= s // spr == d and s >= 0 for s in phys[i].tolist())]
        assert index[d, :len(wanted)].tolist() == wanted and (index[d, len(wanted):] == n).all()
    back = torch.ones(ep * n, 2)
    summed = combine_layout(back, index, n)
    assert summed[:, 0].tolist() == [float((index == i).sum()) for i in range(n)]
    with pytest.raises(ValueError, match="drop"):
        dispatch_layout(rows, phys, spr, ep, n - 1)


def test_exact_rows_are_the_padded_blocks_without_padding():
    torch.manual_seed(1)
    n, k, ep, spr = 9, 3, 4, 2
    phys = torch.randint(-1, ep * spr, (n, k))
    phys[[2, 5]] = -1                                   # padding rows: sent nowhere
    index, counts = dispatch_index(phys, spr, ep, n)
    rows = exact_rows(index, counts.tolist())
    assert rows.tolist() == [i for i in index.flatten().tolist() if i < n]
    assert 2 not in rows.tolist() and 5 not in rows.tolist()
    assert counts.tolist() == [int((index[d] < n).sum()) for d in range(ep)]
    back = torch.randn(ep * n, 4)                       # partial sums, padded layout
    assert torch.equal(exact_combine(back[index.flatten() < n], rows, n), combine_layout(back, index, n))
    assert exact_rows(index[:, :0], [0] * ep).numel() == 0


def exchange_worker(rank: int, world: int, port: int, device: str = "cpu") -> None:
    """One rank of the exchange check: random rows and routing (an idle rank, rows below and above TBO_MIN_ROWS),
    a real per-slot linear expert; every dispatch against the one-process sum (gloo on CPU, NCCL on "cuda": one
    GPU per rank, tests/test_gpu_parallel.py)."""
    torch.set_num_threads(1)
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        from openinfer.distributed.parallel_state import ParallelContext
        from openinfer.layers.attention import AttentionMetadata

        dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
        ctx = ParallelContext(world_size=world, rank=rank, dp_size=world, dp_rank=rank, ep_size=world,
                              ep_rank=rank, ep_group=dist.group.WORLD, cpu_group=dist.group.WORLD, backend=backend,
                              device=dev)
        E, k, H = 8, 3, 16
        spr = E // world
        W = torch.randn(E, H, H, generator=torch.Generator().manual_seed(7)).to(dev)    # the same on every rank
        routing = ExpertRouting(E, 1, spr, rank).to(dev)
        routing.set_replicas(torch.arange(E, device=dev)[:, None], torch.ones(E, dtype=torch.long, device=dev))

        def routed(xa, local, wa):
            out = torch.zeros_like(xa)
            for j in range(spr):
                hit = (local == j)
                out += (hit * wa).sum(1, keepdim=True) * (xa @ W[rank * spr + j])
            return out

        for R, valid in ((5, 0 if rank == 1 else 5 - rank), (TBO_MIN_ROWS + 3, TBO_MIN_ROWS + 3 - 2 * rank)):
            g = torch.Generator().manual_seed(100 * rank + R)
            x = torch.randn(valid, H, generator=g).to(dev)
            experts = torch.rand(valid, E, generator=g).argsort(1)[:, :k].to(dev)          # k distinct each
            weights = torch.rand(valid, k, generator=g).to(dev)
            want = torch.einsum("tk,tkh->th", weights, torch.einsum("th,tkhg->tkg", x, W[experts]))
            outs = {}
            for dispatch in ("all_gather", "all_to_all", "all_to_all_exact"):
                for mb in (1, 2):
                    routing.load.zero_()
                    meta = AttentionMetadata(block_size=1, slot_mapping=torch.zeros(0, device=dev),
                                             moe_rows_per_rank=R, moe_exchange=MoeExchange(dispatch, mb))
                    outs[dispatch, mb] = expert_parallel_moe(x, experts, weights, routing, routed, meta, ctx)
                    assert torch.allclose(outs[dispatch, mb], want, atol=1e-4 if device == "cpu" else 1e-2), (
                        rank, R, dispatch, mb)
                    if dispatch != "all_gather":             # each rank counts its own rows
                        assert torch.equal(routing.load, torch.bincount(experts.flatten(), minlength=E))
            assert torch.equal(outs["all_to_all_exact", 1], outs["all_to_all", 1])
            assert torch.equal(outs["all_to_all_exact", 2], outs["all_to_all", 2])
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_exact_exchange_equals_padded_and_one_process(world):
    run_ranks(exchange_worker, world)


def run_ranks(target, world: int, *args) -> None:
    """`target(rank, world, port, *args)` in `world` processes; fails unless every one exits cleanly, leaves none."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = rank_process_context()             # the engine's fork server: torch is imported once, not per rank
    procs = [ctx.Process(target=target, args=(r, world, port, *args)) for r in range(world)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=300)
        assert [p.exitcode for p in procs] == [0] * world     # a rank's failed check: its traceback is on stderr
    finally:
        for p in procs:
            end_process(p)


def test_settings_are_checked_and_split_is_fixed():
    assert pick_dispatch("auto", 2, 8, "gloo") == "all_gather"
    assert pick_dispatch("auto", 4, 8, "gloo", captured=True) == "all_to_all"
    assert pick_dispatch("auto", 8, 8, "nccl", captured=True) == "all_gather"
    assert pick_dispatch("all_to_all", 2, 8, "nccl") == "all_to_all"
    # exact sizes need a host read: eager steps only; auto takes them from EXACT_MIN_EP on
    assert pick_dispatch("all_to_all_exact", 2, 8, "nccl") == "all_to_all_exact"
    assert pick_dispatch("all_to_all_exact", 2, 8, "nccl", captured=True) == "all_to_all"
    assert pick_dispatch("auto", EXACT_MIN_EP, 8, "nccl") == "all_to_all_exact"
    assert pick_dispatch("auto", EXACT_MIN_EP - 1, 8, "nccl") == "all_gather"
    assert split_rows(TBO_MIN_ROWS + 1) == [(0, TBO_MIN_ROWS // 2 + 1), (TBO_MIN_ROWS // 2 + 1, TBO_MIN_ROWS // 2)]
    assert split_rows(TBO_MIN_ROWS - 1) == [(0, TBO_MIN_ROWS - 1)]
    from openinfer.config import EngineConfig
    for bad in (dict(moe_dispatch="deepep"), dict(step_sync_channel="nccl"), dict(two_batch_overlap=True),
                dict(moe_dispatch="all_to_all"), dict(step_sync_channel="gloo")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineConfig(device="cpu", **bad)
    with pytest.raises(ValueError, match="shm"):
        EngineConfig(device="cpu", data_parallel_size=2, enable_expert_parallel=True, step_sync_channel="shm",
                     num_local_ranks=1, worker_listen_address="127.0.0.1:29600", distributed_init_method="tcp://a:1",
                     worker_authkey="k")
