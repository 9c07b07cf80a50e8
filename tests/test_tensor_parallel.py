"""Tensor parallelism for the Llama family, for real: two gloo processes (TP ranks) each build an LLMEngine on
the same tiny checkpoint, run the same requests in the same order (chunked prefill, concurrent requests, a
seeded sampled one), and must reproduce the one-process engine: greedy tokens identical, logprobs within
1e-4, and the two ranks' sampled tokens identical (no token broadcast between TP ranks)."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import socket
import traceback
from pathlib import Path

import pytest
import torch

from openinfer.config import EngineConfig
from openinfer.engine.llm_engine import LLMEngine
from openinfer.models.llama.model import LlamaConfig
from openinfer.sampling_params import SamplingParams
from tests.test_models_tiny import VARIANTS, make_tiny

TP_VARIANTS = ("llama3-rope-bias", "qwen3")   # plain llama: the other files cover it
MAX_TOKENS = 12


def _engine_config(path: str, tp: int) -> EngineConfig:
    return EngineConfig(model=path, device="cpu", block_size=4, max_num_batched_tokens=8,
                        tensor_parallel_size=tp, seed=0)


def _requests() -> list[tuple[list[int], SamplingParams]]:
    """Prompts longer than max_num_batched_tokens=8 (chunked prefill) and shorter, run concurrently."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (13, 3, 19, 9)]
    greedy = dict(temperature=0, max_tokens=MAX_TOKENS, logprobs=1, ignore_eos=True)
    reqs = [(p, SamplingParams(**greedy)) for p in prompts]
    reqs[0] = (prompts[0], SamplingParams(**greedy, prompt_logprobs=1))
    reqs.append((prompts[2], SamplingParams(temperature=0.8, seed=1234, max_tokens=MAX_TOKENS, logprobs=1,
                                            ignore_eos=True)))
    return reqs


def _run(engine: LLMEngine) -> list[dict]:
    ids = [engine.add_request(p, sp) for p, sp in _requests()]
    finished = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o
    results = []
    for rid in ids:
        o = finished[rid]
        c = o.outputs[0]
        plp = None
        if o.prompt_logprobs is not None:
            plp = [None if pos is None else pos[t].logprob for t, pos in zip(o.prompt_token_ids, o.prompt_logprobs)]
        results.append(dict(tokens=list(c.token_ids), logprobs=[pos[t].logprob for t, pos in zip(c.token_ids,
                                                                                                 c.logprobs)],
                            prompt_logprobs=plp))
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    return results


def _tp_worker(rank: int, tp: int, init_method: str, paths: list[str], queue) -> None:
    """One TP rank: join the group, then serve every model in turn (one process group, several engines)."""
    try:
        torch.set_num_threads(1)
        from openinfer.distributed.parallel_state import destroy_parallel, init_parallel

        ctx = init_parallel(1, tp, False, rank, torch.device("cpu"), init_method=init_method, timeout_s=60.0)
        try:
            for path in paths:
                engine = LLMEngine(_engine_config(path, tp), parallel=ctx)
                kv_heads = engine.runner.caches["kv"][0].shape[3]   # [blocks, block_size, 2, kv heads, head_dim]
                queue.put((rank, path, dict(results=_run(engine), kv_heads=kv_heads)))
                engine.shutdown()
            # random shards (load_format="dummy"): replicated parameters must still agree across ranks
            cfg = _engine_config(paths[0], tp)
            cfg.load_format = "dummy"
            engine = LLMEngine(cfg, parallel=ctx)
            engine.add_request(list(range(1, 12)), SamplingParams(temperature=0.8, seed=7, max_tokens=4,
                                                                   ignore_eos=True))
            tokens = []
            while engine.has_unfinished_requests():
                tokens += [o.outputs[0].token_ids for o in engine.step() if o.finished]
            queue.put((rank, "dummy", dict(tokens=tokens)))
            engine.shutdown()
        finally:
            destroy_parallel()
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_tp(paths: list[str], tp: int = 2, timeout_s: float = 120.0) -> dict[tuple[int, str], dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_tp_worker, args=(r, tp, init_method, paths, queue), daemon=True)
             for r in range(tp)]
    for p in procs:
        p.start()
    got: dict[tuple[int, str], dict] = {}
    try:
        while len(got) < tp * (len(paths) + 1):
            rank, path, payload = queue.get(timeout=timeout_s)
            if path is None:
                pytest.fail(f"TP rank {rank} failed:\n{payload}")
            got[(rank, path)] = payload
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0, f"TP worker exited with {p.exitcode}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return got


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory, smollm_dir):
    root = tmp_path_factory.mktemp("tp")
    return {v: str(make_tiny(root, smollm_dir, v)[0]) for v in TP_VARIANTS}


def test_tp2_matches_one_process(tiny_paths):
    assert set(TP_VARIANTS) <= set(VARIANTS)
    paths = [tiny_paths[v] for v in TP_VARIANTS]
    got = _run_tp(paths)
    for variant, path in zip(TP_VARIANTS, paths):
        single = _run(LLMEngine(_engine_config(path, 1)))
        r0, r1 = got[(0, path)], got[(1, path)]
        full_kv = LlamaConfig.from_hf(json.loads(Path(path, "config.json").read_text())).num_key_value_heads
        assert r0["kv_heads"] == r1["kv_heads"] == full_kv // 2, variant   # each rank caches its own KV heads
        # the TP ranks agree exactly: same logits everywhere, so the same samples, with no broadcast
        assert r0["results"] == r1["results"], variant
        sampled_matches = 0
        for i, (tp_out, ref) in enumerate(zip(r0["results"], single)):
            assert len(tp_out["tokens"]) == MAX_TOKENS
            if i == len(single) - 1:          # the seeded sampled request (temperature 0.8)
                sampled_matches += tp_out["tokens"] == ref["tokens"]
                continue
            assert tp_out["tokens"] == ref["tokens"], (variant, i)
            assert max(abs(a - b) for a, b in zip(tp_out["logprobs"], ref["logprobs"])) < 1e-4, (variant, i)
            if ref["prompt_logprobs"] is not None:
                diffs = [abs(a - b) for a, b in zip(tp_out["prompt_logprobs"], ref["prompt_logprobs"])
                         if a is not None]
                assert len(diffs) == len(ref["prompt_logprobs"]) - 1 and max(diffs) < 1e-4, (variant, i)
                assert all(math.isfinite(d) for d in diffs)
        # logits agree to ~1e-6, far below what would flip a seeded sample of this length
        assert sampled_matches == 1, variant
    dummy0, dummy1 = got[(0, "dummy")]["tokens"], got[(1, "dummy")]["tokens"]
    assert len(dummy0) == 1 and len(dummy0[0]) == 4 and dummy0 == dummy1


@pytest.mark.parametrize("field, overrides", [
    ("num_attention_heads", dict(num_attention_heads=6, num_key_value_heads=6)),
    ("num_key_value_heads", dict(num_key_value_heads=2)),
    ("intermediate_size", dict(intermediate_size=98)),
    ("vocab_size", dict(vocab_size=49153)),
])
def test_check_tensor_parallel_names_the_field(field, overrides):
    hf = dict(model_type="llama", vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4)
    LlamaConfig.from_hf(hf).check_tensor_parallel(4)      # divisible: fine
    bad = LlamaConfig.from_hf({**hf, **overrides})
    with pytest.raises(ValueError, match=field):
        bad.check_tensor_parallel(4)
    LlamaConfig.from_hf(hf).check_tensor_parallel(1)


def test_tp3_on_four_heads_is_refused():
    hf = dict(model_type="llama", vocab_size=48, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4)
    with pytest.raises(ValueError, match="num_attention_heads"):
        LlamaConfig.from_hf(hf).check_tensor_parallel(3)
