"""Scheduler and KV blocks: preemption instead of failure, no leaked blocks, LRU eviction of cached blocks. (The
engine runs the tiny random Llama: what is held here does not depend on what the weights say.)"""

from __future__ import annotations

import pytest

from openinfer import LLM, SamplingParams
from openinfer.kv_cache.kv_cache_manager import KVCacheManager
from openinfer.outputs import RequestMetrics
from openinfer.request import Request
from tests.conftest import assert_pool_idle

PROMPTS = [f"Story {i}: the {w} walked into the forest and" for i, w in
           enumerate(["fox", "old man", "little girl", "knight", "robot", "bear"])]


def _run(llm, prompts, **sp):
    return llm.generate(prompts, SamplingParams(temperature=0, ignore_eos=True, **sp), use_tqdm=False)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", max_num_seqs=16)
    yield llm
    llm.shutdown()


def test_tiny_pool_preempts_and_matches_large_pool(llm, tiny_llama_dir):
    expected = [o.outputs[0].token_ids for o in _run(llm, PROMPTS, max_tokens=32)]
    tiny = LLM(str(tiny_llama_dir), device="cpu", block_size=16, num_kv_blocks=12, enable_prefix_caching=False)
    outs = _run(tiny, PROMPTS, max_tokens=32)
    assert tiny.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_pool_idle(tiny.engine)


def test_abort_running_and_waiting_frees_every_block(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", block_size=16, max_num_seqs=2)
    eng = llm.engine
    ids = [eng.add_request(llm.tokenizer.encode(p), SamplingParams(max_tokens=30, ignore_eos=True)) for p in PROMPTS]
    for _ in range(4):
        eng.step()
    assert eng.kv_manager.num_free_blocks < eng.kv_manager.num_blocks
    running = [r.request_id for r in eng.scheduler.running]
    waiting = [r.request_id for r in eng.scheduler.waiting]
    assert running and waiting
    out = eng.abort_request(running[0])
    assert out.finished and out.outputs[0].finish_reason == "abort"
    eng.abort_request(waiting[0])
    eng.abort_request("no-such-request")        # ignored
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            done[o.request_id] = o
    assert set(done) == set(ids) - {running[0], waiting[0]}
    assert all(len(o.outputs[0].token_ids) == 30 for o in done.values())
    assert_pool_idle(eng)


def test_completions_free_every_block(llm):
    _run(llm, PROMPTS, max_tokens=5)
    assert_pool_idle(llm.engine)


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(), RequestMetrics(0.0))


def test_prefix_hit_reuses_blocks_and_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = _req("a", list(range(12)))
    assert kv.allocate_slots(a, 12)
    kv.free(a)
    b = _req("b", list(range(12)))             # same 12 tokens: 3 full blocks cached
    hits, n = kv.get_computed_blocks(b)
    assert n == 8                                 # not 12: the last token must run to produce logits
    c = _req("c", list(range(8)) + [99, 98, 97])
    hits_c, n_c = kv.get_computed_blocks(c)
    assert n_c == 8 and [x.block_id for x in hits_c] == [x.block_id for x in hits]


def test_lru_eviction_under_pressure():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    old = _req("old", list(range(100, 108)))      # 2 blocks, freed first -> evicted first
    new = _req("new", list(range(200, 208)))
    for r in (old, new):
        assert kv.allocate_slots(r, 8)
        kv.free(r)
    assert kv.pool.num_cached_blocks == 4 and kv.num_free_blocks == 6
    big = _req("big", list(range(300, 316)))      # needs 4 blocks: 2 never-used + the 2 oldest cached
    assert kv.allocate_slots(big, 16)
    assert kv.pool.num_evictions == 2
    assert kv.get_computed_blocks(_req("o2", list(range(100, 108)) + [1]))[1] == 0   # evicted
    assert kv.get_computed_blocks(_req("n2", list(range(200, 208)) + [1]))[1] == 8   # still cached
    kv.free(big)
    assert kv.num_free_blocks == 6


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_prefix_caching=True)
    a = _req("a", list(range(8)))
    assert kv.allocate_slots(a, 8)
    b = _req("b", list(range(50, 62)))
    assert not kv.allocate_slots(b, 12)
    assert kv.num_free_blocks == 1 and kv.block_ids("b") == []
    kv.free(a)
    assert kv.num_free_blocks == 3


def test_cached_hits_count_against_free_blocks():
    """A hit on a cached-but-free block takes it out of the free queue; allocation must account for it."""
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_prefix_caching=True)
    a = _req("a", list(range(8)))
    assert kv.allocate_slots(a, 8)
    kv.free(a)                                     # 2 cached free blocks + 1 empty
    b = _req("b", list(range(8)) + list(range(20, 28)))   # hits 2 blocks, needs 2 more: only 1 left
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    assert not kv.allocate_slots(b, 8, hits)
    assert kv.num_free_blocks == 3


@pytest.mark.parametrize("budget", [1, 5])
def test_step_respects_token_and_seat_budgets(tiny_llama_dir, budget):
    llm = LLM(str(tiny_llama_dir), device="cpu", max_num_batched_tokens=budget, max_num_seqs=3, block_size=16)
    eng = llm.engine
    schedule, seen = eng.scheduler.schedule, []

    def recording_schedule():   # observe the real scheduler's decisions
        out = schedule()
        seen.append((out.num_batched_tokens, len(eng.scheduler.running)))
        return out

    eng.scheduler.schedule = recording_schedule
    outs = _run(llm, PROMPTS, max_tokens=3)
    assert all(len(o.outputs[0].token_ids) == 3 for o in outs)
    assert seen and all(t <= budget and r <= 3 for t, r in seen)
    assert max(t for t, _ in seen) == budget
    assert_pool_idle(eng)


def test_per_request_state_slots_bound_admission_and_are_returned():
    """A model declaring per-request state (e.g. a sliding-window ring) gets one slot per running request."""
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=False, num_state_slots=2)
    a, b, c = _req("a", [1, 2]), _req("b", [3, 4]), _req("c", [5, 6])
    assert kv.allocate_slots(a, 2) and kv.allocate_slots(b, 2)
    assert {kv.state_slot("a"), kv.state_slot("b")} == {0, 1}
    assert not kv.allocate_slots(c, 2)              # blocks are there, but no state slot
    assert kv.num_free_blocks == 14 and kv.state_slot("c") is None
    kv.free(a)
    assert kv.allocate_slots(c, 2) and kv.state_slot("c") in (0, 1)


def test_cache_specs_size_blocks_for_compressed_entries():
    import torch

    from openinfer.kv_cache.spec import PagedCacheSpec, RequestStateSpec

    full = PagedCacheSpec("kv", num_layers=2, entry_shape=(2, 4, 8), dtype=torch.float32)
    compressed = PagedCacheSpec("csa", num_layers=2, entry_shape=(16,), dtype=torch.bfloat16, tokens_per_entry=4)
    assert full.block_shape(128) == (128, 2, 4, 8) and compressed.block_shape(128) == (32, 16)
    assert compressed.bytes_per_block(128) == 2 * 32 * 16 * 2
    with pytest.raises(ValueError, match="multiple"):
        compressed.block_shape(6)
    assert RequestStateSpec("swa", 3, (128, 16), torch.float32).bytes_per_slot() == 3 * 128 * 16 * 4
