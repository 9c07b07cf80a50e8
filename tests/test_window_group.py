"""The window group (kv_cache/window_group.py): sliding-window layers hold only their window's blocks.

1. The KV manager alone (window 8, blocks of 4): a long request's window blocks stay under the bound at every
   step while its full table holds every block; admission that one pool cannot take changes neither; a prefix
   hit takes the cached window blocks of its last window, and replays (exact, without a store) once they are
   evicted; every pool ends idle.
2. A tiny random Gemma-3 (window 8, blocks of 4) against HF transformers fp32: a request ~10x the window, in
   small chunks, equals HF's logits while the bound holds at every step; a second request sharing its prefix
   hits the window blocks (no replay) or, with a window group too small to keep them, replays exactly — the
   cold engine's tokens either way.
"""

from __future__ import annotations

import pytest
import torch

from openinfer import LLM, SamplingParams
from openinfer.kv_cache.bounded_replay import SlidingWindowLayout
from openinfer.kv_cache.kv_cache_manager import KVCacheManager
from openinfer.outputs import RequestMetrics
from openinfer.request import Request
from tests.conftest import assert_pool_idle
from tests.test_gemma3 import make_tiny_gemma3

BS, W = 4, 8


def _bound(chunk: int) -> int:
    """Window blocks a request may hold in a step of `chunk` tokens: the window of its last block boundary, one
    more at a block edge, and the chunk's."""
    return -(-(W - 1) // BS) + 1 + -(-chunk // BS)


def _kv(num_blocks=64, num_window_blocks=64, **kw) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, True, swa=SlidingWindowLayout(W, (0,)), num_window_blocks=num_window_blocks,
                          **kw)


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(), RequestMetrics(0.0))


def _run(kv: KVCacheManager, req: Request, new_tokens: int, chunk: int = 5) -> list[int]:
    """Admit, prefill in chunks, decode `new_tokens`; the window blocks held after each allocation."""
    held = []
    hits, cached = kv.get_computed_blocks(req)
    n = min(chunk, req.num_tokens - cached)
    assert kv.allocate_slots(req, n, hits)
    req.num_computed_tokens = cached
    while True:
        held.append(kv.window.num_held(req.request_id))
        assert len(kv.block_ids(req.request_id)) == len(kv.window_block_ids(req.request_id))
        req.num_computed_tokens += n
        if req.num_computed_tokens == req.num_tokens:
            if req.num_output_tokens == new_tokens:
                return held
            req.output_token_ids.append(7 + req.num_tokens)
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        assert kv.allocate_slots(req, n)


def test_window_blocks_stay_bounded_and_the_full_table_grows():
    kv = _kv()
    req = _req("a", list(range(1000, 1061)))
    held = _run(kv, req, new_tokens=20)
    assert max(held) <= _bound(5) and max(held) < 80 // BS      # 81 tokens: the full table holds 21 blocks
    assert len(kv.block_ids("a")) == 21 and kv.num_free_blocks == 64 - 21
    ids = kv.window_block_ids("a")
    assert ids[:16] == [kv.window.null_id] * 16                 # released entries point at the scratch page
    kv.free(req)
    assert kv.num_free_blocks == 64 and kv.window.pool.num_free_blocks == 64


def test_admission_that_either_pool_refuses_changes_neither():
    for full, window in ((2, 64), (64, 2)):
        kv = _kv(full, window)
        b = _req("b", list(range(50, 62)))
        assert not kv.allocate_slots(b, 12)
        assert kv.num_free_blocks == full and kv.window.pool.num_free_blocks == window
        assert kv.block_ids("b") == [] and kv.window_block_ids("b") == []
        kv.free(b)
        assert kv.num_free_blocks == full and kv.window.pool.num_free_blocks == window


def test_a_hit_takes_the_cached_window_blocks_and_replays_once_they_are_evicted():
    kv = _kv(num_window_blocks=12)
    prefix = list(range(2000, 2040))                          # 10 blocks
    first = _req("first", prefix + [1, 2, 3])
    _run(kv, first, new_tokens=0)
    last_window = kv.window_block_ids("first")[8:10]          # the window of the block boundary at 40
    kv.free(first)
    second = _req("second", prefix + [4, 5, 6])
    hits, cached = kv.get_computed_blocks(second)
    assert cached == 40 and kv.replay_plan("second") is None
    assert kv.allocate_slots(second, 3, hits)
    assert kv.window_block_ids("second")[8:10] == last_window    # the same blocks, no copy, no recompute
    kv.free(second)
    # another request takes the whole window group: the cached windows are evicted
    other = _req("other", list(range(5000, 5048)))
    assert kv.allocate_slots(other, 48)
    kv.free(other)
    third = _req("third", prefix + [7, 8, 9])
    hits, cached = kv.get_computed_blocks(third)
    plan = kv.replay_plan("third")
    assert len(hits) == 10 and plan is not None and (plan.start, plan.end, plan.window_floor) == (0, 40, 0)
    assert cached == 0 and kv.allocate_slots(third, 43, hits)
    kv.free(third)
    assert kv.num_free_blocks == 64 and kv.window.pool.num_free_blocks == 12


def test_exact_replay_starts_at_the_last_complete_window():
    """Early window blocks go first (released, then evicted): exact replay starts where the window before it is
    complete, not at the first block that lacks its rows."""
    kv = _kv()
    prefix = list(range(3000, 3040))
    first = _req("first", prefix + [1])
    _run(kv, first, new_tokens=0, chunk=41)
    kv.free(first)
    for i in (0, 1, 2, 9):     # drop blocks 0-2 and 9 from the window group's cache
        block = kv.window.pool.lookup(first.block_hashes[i])
        del kv.window.pool._cached[block.block_hash]
        block.block_hash = None
    second = _req("second", prefix + [2])
    hits, cached = kv.get_computed_blocks(second)
    plan = kv.replay_plan("second")
    assert len(hits) == 10 and cached == plan.start == 36 and plan.kept_blocks == frozenset()


# ---- the engine against HF -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm_dir):
    return make_tiny_gemma3(tmp_path_factory.mktemp("window"), smollm_dir)


def test_a_long_request_equals_hf_with_its_window_blocks_bounded(tiny):
    path, hf = tiny
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=BS, max_num_batched_tokens=16,
              num_kv_blocks=64)
    engine, kv = llm.engine, llm.engine.kv_manager
    held, logits = [], []
    execute = engine.runner.execute

    def recording_execute(sched, *rest):   # observe the real runner; nothing is replaced
        for s in sched.scheduled:
            held.append(kv.window.num_held(s.request.request_id))
            assert len(s.window_block_ids) == len(s.block_ids) == len(kv.block_ids(s.request.request_id))
        out = execute(sched, *rest)
        logits.extend(out.logits[i].clone() for i in out.sample_index.values())
        return out
    engine.runner.execute = recording_execute
    prompt = torch.randint(0, 49152, (60,), generator=torch.Generator().manual_seed(5)).tolist()
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0, max_tokens=20,
                                                                                  ignore_eos=True),
                       use_tqdm=False)[0]
    tokens = prompt + list(out.outputs[0].token_ids)
    with torch.no_grad():
        ref = hf(torch.tensor([tokens[:-1]])).logits[0]
    torch.testing.assert_close(torch.stack(logits), ref[len(prompt) - 1:], atol=1e-4, rtol=0)
    assert max(held) <= _bound(16) < 80 // BS
    assert_pool_idle(engine)


def shared_prefix_prompts(seed: int = 6) -> tuple[list[list[int]], list[int]]:
    """Two prompts sharing a 40-token prefix (5 tokens of their own each), and a 30-token filler."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 49152, (40,), generator=g).tolist()
    prompts = [prefix + torch.randint(0, 49152, (5,), generator=g).tolist() for _ in range(2)]
    return prompts, torch.randint(0, 49152, (30,), generator=g).tolist()


def greedy_run(llm, prompt: list[int]) -> tuple[list[int], list[float]]:
    """6 greedy tokens and their logprobs."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    o = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0].outputs[0]
    return list(o.token_ids), [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)]


@pytest.mark.parametrize("window_blocks", [None, 8])
def test_a_shared_prefix_hits_the_window_blocks_or_replays_exactly(tiny, window_blocks):
    """None: the window group keeps the first request's last window (a hit, no replay); 8 blocks: a filler
    request evicts it, and the hit replays exactly (no store)."""
    path, _ = tiny
    prompts, filler = shared_prefix_prompts()
    run = greedy_run
    cold = LLM(str(path), device="cpu", dtype="float32", block_size=BS, enable_prefix_caching=False)
    expected = run(cold, prompts[1])
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=BS, num_kv_blocks=64, max_num_batched_tokens=16,
              num_window_kv_blocks=window_blocks)
    run(llm, prompts[0])
    if window_blocks is not None:
        run(llm, filler)
    tokens, lps = run(llm, prompts[1])
    stats = llm.engine.stats()
    if window_blocks is None:
        assert stats["prefix_cache_hit_tokens"] == 40 and stats["swa_replays"] == 0
    else:
        assert stats["prefix_cache_hit_tokens"] < 40 and stats["swa_replays"] == 1
    assert tokens == expected[0] and max(abs(a - b) for a, b in zip(lps, expected[1])) < 1e-4
    assert_pool_idle(llm.engine)
