"""CPU (gloo): what expert parallelism costs the host per step, and the MoE exchanges' bytes and times per EP size.

1. Host overhead per decode step, DeepSeek-V4-tiny through the engine: one process vs DP2 + EP2 with the step
   agreement over gloo and over shared memory (`step_sync_channel`); per step the front end's wall time, each
   rank's time in `engine.step()` and in the agreement (`step_sync_s / step_sync_rounds`).
2. The agreement alone (4 ints, MAX) per EP size: a gloo all-reduce vs shared memory, in a loop of ranks that
   arrive together (ranks that do nothing else: the channel's own cost).
3. The exchange alone per EP size and rows per rank, a simple model (hidden H, top-k of E experts, uniform random
   routing, an identity "expert"): the all-gather + reduce-scatter path vs the padded all-to-all vs the exact-size
   all-to-all (eager steps), bytes each rank sends per MoE layer (computed from the layouts; the exact path's
   from the rows it sends, counts included) and the measured time per layer; and the exact path's count exchange
   alone (a tiny all-to-all and its host read).
4. Analytic bytes per row at wide EP (`--analytic-ep`), V4-Flash's shape (hidden 4,096 bf16, top-6 of 256 experts,
   uniform random routing): all-gather and padded all-to-all send every row to every other rank; the exact path
   to the other ranks holding one of its experts.

    python benchmarks/cpu_ep_exchange.py [--steps 64] [--out benchmarks/results/cpu_ep_exchange.json]
    python benchmarks/cpu_ep_exchange.py --skip-engine --rows 16,128,512 --out benchmarks/results/cpu_ep_exact.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def engine_overhead(steps: int) -> list[dict]:
    from openinfer import LLM, SamplingParams

    torch.set_num_threads(1)       # each rank runs one thread on CPU (worker.py: cores // ranks); so does this one
    rows = []
    opts = dict(device="cpu", dtype="float32", block_size=16, max_num_seqs=8, enable_prefix_caching=False)
    layouts = [("one process", {}),
               ("DP2+EP2, agreement over gloo", dict(data_parallel_size=2, enable_expert_parallel=True,
                                                     step_sync_channel="gloo")),
               ("DP2+EP2, agreement in shared memory", dict(data_parallel_size=2, enable_expert_parallel=True,
                                                            step_sync_channel="shm"))]
    for name, kw in layouts:
        llm = LLM("deepseek-v4-tiny", **opts, **kw)
        engine = llm.engine
        p = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
        for i in range(4):                       # one request per DP rank and more: every rank decodes
            engine.add_request([1 + i, 2, 3, 4], p)
        for _ in range(4):                       # prefill, warm-up
            engine.step()

        def per_rank():
            st = engine.stats()
            return st.get("per_rank", [st])

        before = per_rank()
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = (time.perf_counter() - t) / steps
        after = per_rank()
        ranks = []
        for b, a in zip(before, after):
            r = {}
            if "worker_step_s" in a:
                r["engine_step_ms"] = 1e3 * (a["worker_step_s"] - b["worker_step_s"]) / steps
            if "step_sync_s" in a:
                r["agreement_ms"] = 1e3 * (a["step_sync_s"] - b["step_sync_s"]) / max(
                    1, a["step_sync_rounds"] - b["step_sync_rounds"])
            ranks.append(r)
        rows.append({"layout": name, "front_end_step_ms": 1e3 * wall, "per_rank": ranks})
        llm.shutdown()
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _rank(rank: int, world: int, port: int, jobs: list, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from openinfer.distributed.collectives import ep_all_to_all
    from openinfer.distributed.expert_parallel import ExpertRouting, expert_parallel_moe, MoeExchange
    from openinfer.distributed.parallel_state import ParallelContext
    from openinfer.distributed.shm_agreement import ShmMaxAgreement
    from openinfer.layers.attention import AttentionMetadata

    ctx = ParallelContext(world_size=world, rank=rank, dp_size=world, dp_rank=rank, ep_size=world, ep_rank=rank,
                          ep_group=dist.group.WORLD, cpu_group=dist.group.WORLD)
    results = []
    # the agreement alone
    shm = ShmMaxAgreement(rank, world, 4, dist.group.WORLD)
    buf = torch.zeros(4, dtype=torch.long)
    for name, fn in (("gloo", lambda: dist.all_reduce(buf, op=dist.ReduceOp.MAX)),
                     ("shm", lambda: shm.all_reduce_max((1, 7, 0, 3)))):
        for _ in range(20):
            fn()
        dist.barrier()
        times = []
        for _ in range(500):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        times.sort()
        results.append({"what": "agreement", "channel": name, "ep": world, "us_p50": 1e6 * times[len(times) // 2],
                        "us_p90": 1e6 * times[9 * len(times) // 10], "us_mean": 1e6 * sum(times) / len(times)})
    # the exact path's count exchange alone: ep ints each way, then the host read
    counts = torch.arange(world, dtype=torch.long)
    for _ in range(20):
        ep_all_to_all(counts, ctx).tolist()
    dist.barrier()
    times = []
    for _ in range(500):
        t = time.perf_counter()
        ep_all_to_all(counts, ctx).tolist()
        times.append(time.perf_counter() - t)
    times.sort()
    results.append({"what": "exact_counts", "ep": world, "us_p50": 1e6 * times[len(times) // 2],
                    "us_p90": 1e6 * times[9 * len(times) // 10], "us_mean": 1e6 * sum(times) / len(times)})
    # the exchange alone
    for H, k, E, R in jobs:
        spr = E // world
        routing = ExpertRouting(E, 1, spr, rank)
        routing.set_replicas(torch.arange(E)[:, None], torch.ones(E, dtype=torch.long))
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(R, H, generator=g).to(torch.bfloat16)
        experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(R)])
        weights = torch.rand(R, k, generator=g)

        def routed(xa, local, wa):
            return xa * (local >= 0).any(1, keepdim=True).to(xa.dtype)     # an identity "expert"

        outs = {}
        row_bytes = H * 2 + 8 * k
        # the rows a rank sends to other ranks when only real rows travel: each row once to each other rank it needs
        need = torch.zeros(R, world, dtype=torch.bool)
        need.scatter_(1, experts // spr, True)
        need[:, rank] = False
        sparse = int(need.sum()) * (row_bytes + H * 2)
        for dispatch in ("all_gather", "all_to_all", "all_to_all_exact"):
            meta = AttentionMetadata(block_size=1, slot_mapping=torch.zeros(0), moe_rows_per_rank=R,
                                     moe_exchange=MoeExchange(dispatch, 1))
            for _ in range(3):
                outs[dispatch] = expert_parallel_moe(x, experts, weights, routing, routed, meta, ctx)
            dist.barrier()
            reps = max(5, int(2e6 // (R * H * world)))
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                expert_parallel_moe(x, experts, weights, routing, routed, meta, ctx)
                times.append(time.perf_counter() - t)
            ms = 1e3 * sorted(times)[len(times) // 2]        # median: robust to a rank descheduled on shared cores
            if dispatch == "all_to_all_exact":               # real rows there and back, and the counts
                sent = sparse + (world - 1) * 8
            else:                                            # padded to R rows per peer, there and back
                sent = (world - 1) * R * row_bytes + (world - 1) * R * H * 2
            results.append({"what": "exchange", "dispatch": dispatch, "ep": world, "hidden": H, "top_k": k,
                            "experts": E, "rows_per_rank": R, "ms_per_layer_p50": ms, "bytes_sent_per_rank": sent,
                            "sparse_bytes_per_rank": sparse})
        assert torch.allclose(outs["all_gather"].float(), outs["all_to_all"].float(), rtol=1e-2)
        assert torch.equal(outs["all_to_all_exact"], outs["all_to_all"])
    shm.close()
    if rank == 0:
        out.put(results)
    dist.barrier()
    dist.destroy_process_group()


def exchange_sweep(sizes, jobs) -> list[dict]:
    from openinfer.executor.multiproc import free_local_port

    rows = []
    ctx = tmp.get_context("spawn")
    for world in sizes:
        q = ctx.Queue()
        port = free_local_port()
        procs = [ctx.Process(target=_rank, args=(r, world, port, jobs, q)) for r in range(world)]
        for p in procs:
            p.start()
        got = q.get(timeout=1800)
        for p in procs:
            p.join()
        for r in got:
            print(json.dumps(r), flush=True)
        rows += got
    return rows


def analytic_bytes(ep_sizes, hidden: int = 4096, top_k: int = 6, experts: int = 256) -> list[dict]:
    """Bytes one row costs its rank per MoE layer (sent there and back, bf16 hidden plus the packed routing), by
    path, for uniform random top-k routing over `experts` split evenly over the ranks: a given other rank holds
    none of the row's k experts with probability C(E - E/ep, k) / C(E, k)."""
    rows = []
    there, back = hidden * 2 + 8 * top_k, hidden * 2
    for ep in ep_sizes:
        miss = math.comb(experts - experts // ep, top_k) / math.comb(experts, top_k)
        others = (ep - 1) * (1 - miss)                   # expected other ranks a row reaches
        padded = (ep - 1) * (there + back)
        rows.append({"ep": ep, "hidden": hidden, "top_k": top_k, "experts": experts,
                     "other_ranks_per_row": others, "padded_bytes_per_row": padded,
                     "all_gather_bytes_per_row": padded, "exact_bytes_per_row": others * (there + back),
                     "exact_over_padded": others / (ep - 1)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--ep-sizes", default="2,4")
    ap.add_argument("--rows", default="1,16,128")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--out", default="benchmarks/results/cpu_ep_exchange.json")
    ap.add_argument("--skip-engine", action="store_true", help="leave out the engine's host overhead (part 1)")
    ap.add_argument("--analytic-ep", default="2,4,8,16,64")
    args = ap.parse_args()
    jobs = [(args.hidden, 6, 64, int(r)) for r in args.rows.split(",")]
    result = {
        "benchmark": "cpu_ep_exchange",
        "device": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "date": datetime.date.today().isoformat(),
        "commit": os.environ.get("OPENINFER_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "torch": torch.__version__,
        "load_average_at_start": os.getloadavg(),
        "engine_overhead": None if args.skip_engine else engine_overhead(args.steps),
        "analytic_bytes": analytic_bytes([int(s) for s in args.analytic_ep.split(",")]),
        "exchange": exchange_sweep([int(s) for s in args.ep_sizes.split(",")], jobs),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
