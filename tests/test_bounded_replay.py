"""Sliding-window state on prefix hits (kv_cache/bounded_replay.py): the hit rule, bounded and exact replay, the
host-memory SWA state tier, on a tiny random Gemma-3 (window 8, blocks of 4) with a directory store, against
HF transformers (fp32, CPU).

The oracle for bounded replay is HF's own forward over two copies of the sequence: copy A (positions 0..L1,
ordinary masks) stands for the exact block KV the store holds, copy B (positions s..end) is what the engine
recomputes. B's full-attention layers read A's keys before L1 (block KV reused, never rewritten) and B's own
after; B's windowed layers read only B's keys, from s on (the spec's keys max(s, i-W+1)..i). Exact replay and
a window-state hit are checked against a plain HF forward (no cache).
"""

from __future__ import annotations

import pytest
import torch

from openinfer import LLM
from openinfer.kv_cache.bounded_replay import ReplayPlan, plan_replay, replay_slot_mappings, window_blocks
from openinfer.sampling_params import SamplingParams
from tests.conftest import assert_pool_idle
from tests.test_gemma3 import make_tiny_gemma3

BS, W = 4, 8


def test_window_blocks_cover_the_keys_the_first_query_after_the_hit_reads():
    # L1 = 24: the query at 24 reads keys 17..24, i.e. cached positions 17..23 -> blocks 4 and 5
    assert window_blocks(6, BS, W) == range(4, 6)
    assert window_blocks(6, BS, 9) == range(4, 6)     # keys 16..23
    assert window_blocks(6, BS, 10) == range(3, 6)    # keys 15..23
    assert window_blocks(1, BS, W) == range(0, 1)


def test_plan_replay_rules():
    present = [True] * 4 + [False, False]
    assert plan_replay([True] * 6, BS, W, "bounded") is None
    assert plan_replay([False] * 3 + [True] * 3, BS, W, "bounded") is None   # the window's rows are there
    assert plan_replay(present, BS, W, "bounded") == ReplayPlan(16, 24, 16, frozenset())
    # a present block inside the window is read, never rewritten, and the replay starts at the first missing
    assert plan_replay([False] * 4 + [True, False], BS, W, "bounded") == ReplayPlan(20, 24, 16, frozenset())
    assert plan_replay([False] * 5 + [True], BS, W, "bounded") == ReplayPlan(16, 24, 16, frozenset({5}))
    # exact: from the first missing block anywhere, full windows
    assert plan_replay([True, False, True, True, False, True], BS, W, "exact") == \
        ReplayPlan(4, 24, 0, frozenset({2, 3, 5}))
    with pytest.raises(ValueError, match="swa_replay"):
        plan_replay(present, BS, W, "approximate")


def test_replayed_rows_write_to_the_scratch_slot_where_kv_is_kept():
    import numpy as np

    plan = ReplayPlan(16, 24, 16, frozenset({5}))
    pos = np.arange(16, 28)
    slots = pos + 1000
    full, window = replay_slot_mappings(pos, slots, plan, BS, scratch_slot=-7)
    assert full.tolist() == [-7] * 8 + [1024, 1025, 1026, 1027]
    assert window.tolist() == [1016, 1017, 1018, 1019] + [-7] * 4 + [1024, 1025, 1026, 1027]


# ---- the engine against HF ----------------------------------------------------------------------------------

PREFIX = [100 + (i * 7919) % 40000 for i in range(24)]      # 6 blocks
SUFFIX_1 = [200 + (i * 104729) % 40000 for i in range(6)]
SUFFIX_2 = [300 + (i * 1299709) % 40000 for i in range(6)]
NEW = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm_dir):
    path, hf = make_tiny_gemma3(tmp_path_factory.mktemp("swa"), smollm_dir)
    hf.set_attn_implementation("eager")
    return path, hf


def _masked_forward(hf, ids: list[int], positions: list[int], allowed_full, allowed_window) -> torch.Tensor:
    def additive(allowed):
        return torch.where(allowed, 0.0, float("-inf"))[None, None]
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions]),
                  attention_mask={"full_attention": additive(allowed_full),
                                  "sliding_attention": additive(allowed_window)}).logits[0]


def oracle_bounded(hf, tokens: list[int], start: int, hit: int, window: int) -> torch.Tensor:
    """Logits of positions start .. len-1 under bounded replay of [start, hit) (see the module docstring)."""
    ids, pos = tokens[:hit] + tokens[start:], list(range(hit)) + list(range(start, len(tokens)))
    q_pos, k_pos = torch.tensor(pos)[:, None], torch.tensor(pos)[None, :]
    q_a, k_a = (torch.arange(len(ids)) < hit)[:, None], (torch.arange(len(ids)) < hit)[None, :]
    causal = k_pos <= q_pos
    in_window = causal & (k_pos > q_pos - window)
    full = causal & torch.where(q_a, k_a, torch.where(k_pos < hit, k_a, ~k_a))
    windowed = in_window & (q_a & k_a | ~q_a & ~k_a & (k_pos >= start))
    logits = _masked_forward(hf, ids, pos, full, windowed)
    return logits[hit:]


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


def _run(llm, prompt, record: list | None = None, **sp):
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, **sp)
    if record is not None:
        execute = llm.engine.runner.execute

        def recording_execute(sched, *rest):   # observe the real runner's sampled logits; nothing is replaced
            out = execute(sched, *rest)
            record.extend(out.logits[i].clone() for i in out.sample_index.values())
            return out
        llm.engine.runner.execute = recording_execute
    try:
        return llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
    finally:
        if record is not None:
            llm.engine.runner.execute = execute


def _forget_pool(llm):
    llm.engine.kv_store.flush()
    assert llm.engine.kv_manager.reset_prefix_cache()


@pytest.mark.parametrize("mode, budget", [("bounded", 2048), ("exact", 2048), ("bounded", 1)])
def test_a_store_hit_without_window_state_replays(tiny, tmp_path, mode, budget):
    """budget 1: every replayed token is a one-token chunk (it must still run as a prefill chunk)."""
    path, hf = tiny
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=BS, num_kv_blocks=64,
              kv_store_dir=str(tmp_path / "store"), swa_state_bytes=0, swa_replay=mode,
              max_num_batched_tokens=budget)
    engine = llm.engine
    _run(llm, PREFIX + SUFFIX_1)
    _forget_pool(llm)
    prompt = PREFIX + SUFFIX_2
    logits: list[torch.Tensor] = []
    out = _run(llm, prompt, logits, prompt_logprobs=0, prompt_logprobs_start=len(PREFIX) + 1)
    tokens = prompt + list(out.outputs[0].token_ids)
    start = 16 if mode == "bounded" else 0            # the window's blocks (4, 5) / everything
    assert out.num_cached_tokens == start
    stats = engine.stats()
    assert stats["swa_replays"] == 1 and stats["swa_replayed_tokens"] == 24 - start
    assert stats["prefix_cache_store_hit_tokens"] >= 24
    from prometheus_client import generate_latest

    from openinfer.serving.metrics import EngineMetrics
    metrics = EngineMetrics("tiny", engine)
    text = generate_latest(metrics.registry).decode()
    assert f'openinfer:swa_replayed_tokens_total{{model_name="tiny"}} {24 - start}.0' in text
    assert 'openinfer:kv_store_hits_total{model_name="tiny",tier="dir"}' in text
    # ref[p]: the logits at position p (predicting token p + 1)
    if mode == "bounded":
        ref = torch.cat([torch.zeros(16, 49152), oracle_bounded(hf, tokens[:-1], start=16, hit=24, window=W)])
    else:
        ref = hf_logits(hf, tokens[:-1])
    torch.testing.assert_close(torch.stack(logits), ref[len(prompt) - 1:], atol=1e-4, rtol=0)
    # prompt logprobs of the suffix, after the cached prefix (None before it)
    plp = out.prompt_logprobs
    assert plp[:len(PREFIX) + 1] == [None] * (len(PREFIX) + 1) and all(p is not None for p in plp[len(PREFIX) + 1:])
    n = len(SUFFIX_2) - 1                       # positions 25 .. 29, predicted by rows 24 .. 28
    ref_lp = ref[24:24 + n].log_softmax(-1)[torch.arange(n), torch.tensor(prompt[25:])]
    got = torch.tensor([plp[25 + i][prompt[25 + i]].logprob for i in range(n)])
    torch.testing.assert_close(got, ref_lp, atol=1e-4, rtol=0)
    if mode == "bounded":   # the approximation is real: bounded differs from exact (a test that can fail)
        exact = hf_logits(hf, tokens[:-1])[len(prompt) - 1:]
        assert (torch.stack(logits) - exact).abs().max() > 1e-3
    assert_pool_idle(engine)


def test_replay_reuses_block_kv_untouched(tiny, tmp_path):
    """The full-attention rows of the replayed blocks are the store's bytes after the replay (never rewritten)."""
    path, _ = tiny
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=BS, num_kv_blocks=64,
              kv_store_dir=str(tmp_path / "store"), swa_state_bytes=0)
    _run(llm, PREFIX + SUFFIX_1)
    _forget_pool(llm)
    engine, runner = llm.engine, llm.engine.runner
    keys = (PREFIX + SUFFIX_2)
    req_blocks = []
    schedule = engine.scheduler.schedule

    def capture():
        out = schedule()
        for s in out.scheduled:
            if s.replay is not None:
                req_blocks.append(list(s.block_ids))
        return out
    engine.scheduler.schedule = capture
    _run(llm, keys)
    engine.scheduler.schedule = schedule
    assert req_blocks, "no replay was scheduled"
    manager = engine.kv_manager
    hashes = []
    from openinfer.kv_cache.kv_cache_manager import hash_block
    parent = None
    for i in range(6):
        parent = hash_block(parent, PREFIX[i * BS:(i + 1) * BS])
        hashes.append(parent)
    for i in (4, 5):    # the replayed blocks
        stored = engine.kv_store.get(hashes[i])
        rows = torch.cat([r.reshape(-1).view(torch.uint8) for r in runner.store.block_rows(req_blocks[0][i])])
        assert bytes(rows.numpy()) == stored
    assert manager.prefix_stats.swa_replays == 1


def test_window_state_from_host_memory_makes_the_hit_exact(tiny, tmp_path):
    """Multi-turn: the first request's window state is kept when it ends; the next turn hits the store for
    its blocks and host memory for the window: no replay, HF's logits."""
    path, hf = tiny
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=BS, num_kv_blocks=64,
              kv_store_dir=str(tmp_path / "store"))
    first = PREFIX + SUFFIX_1                                 # 30 tokens, 4 more generated: 33 computed
    turn = first + list(_run(llm, first).outputs[0].token_ids)
    _forget_pool(llm)
    prompt = turn + SUFFIX_2
    logits: list[torch.Tensor] = []
    out = _run(llm, prompt, logits)
    assert out.num_cached_tokens == 32
    stats = llm.engine.stats()
    assert stats["swa_state_hits"] == 1 and stats["swa_replays"] == 0
    assert stats["swa_state_tier"]["hits"] == 1
    from prometheus_client import generate_latest

    from openinfer.serving.metrics import EngineMetrics
    metrics = EngineMetrics("tiny", llm.engine)
    assert 'openinfer:kv_store_hits_total{model_name="tiny",tier="swa_state"} 1.0' in \
        generate_latest(metrics.registry).decode()
    tokens = prompt + list(out.outputs[0].token_ids)
    torch.testing.assert_close(torch.stack(logits), hf_logits(hf, tokens[:-1])[len(prompt) - 1:], atol=1e-4, rtol=0)
    assert_pool_idle(llm.engine)


def test_a_store_entry_holds_only_the_full_attention_layers(tiny, tmp_path):
    path, _ = tiny
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=BS, num_kv_blocks=64,
              kv_store_dir=str(tmp_path / "store"))
    runner = llm.engine.runner
    assert runner.swa_layout.window_layers == (0, 1, 2, 3, 4)
    assert runner.store.block_bytes() * 6 == runner.pool.bytes_per_block()     # 1 of 6 layers attends to everything


def test_swa_options_are_validated():
    from openinfer.config import EngineConfig

    with pytest.raises(ValueError, match="swa_replay"):
        EngineConfig(swa_replay="approx")
    with pytest.raises(ValueError, match="swa_state_bytes"):
        EngineConfig(swa_state_bytes=-1)
    with pytest.raises(ValueError, match="prompt_logprobs_start"):
        SamplingParams(prompt_logprobs_start=3)


@pytest.mark.parametrize("mode", ["exact", "bounded"])
def test_replay_under_chunking_preemption_and_shared_prefixes(tiny, tmp_path, mode):
    """Stress the hit rule's bookkeeping: six requests over three shared prefixes, all blocks from the store (the
    pool emptied), small chunks, a pool small enough to preempt, requests replaying the same blocks at once. Exact
    replay must give the no-cache engine's tokens and logprobs; bounded replay finishes every request; the pool
    ends idle either way."""
    path, _ = tiny
    rng = torch.Generator().manual_seed(3)
    prefixes = [torch.randint(100, 40000, (n,), generator=rng).tolist() for n in (21, 30, 17)]
    prompts = [prefixes[i % 3] + torch.randint(100, 40000, (3 + i,), generator=rng).tolist() for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)

    def run(llm):
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                                 o.outputs[0].token_ids)])
                for o in outs]

    reference = run(LLM(str(path), device="cpu", dtype="float32", block_size=BS, enable_prefix_caching=False))
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=BS, num_kv_blocks=14, max_num_batched_tokens=8,
              kv_store_dir=str(tmp_path / "store"), swa_state_bytes=0, swa_replay=mode)
    llm.generate(prompt_token_ids=prefixes, sampling_params=SamplingParams(max_tokens=1), use_tqdm=False)
    _forget_pool(llm)
    got = run(llm)
    stats = llm.engine.stats()
    assert stats["swa_replays"] >= 3 and llm.engine.scheduler.num_preemptions > 0
    assert all(len(tokens) == 6 for tokens, _ in got)
    for (tokens, lps), (ref_tokens, ref_lps) in zip(got, reference if mode == "exact" else []):
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-4
    assert_pool_idle(llm.engine)
