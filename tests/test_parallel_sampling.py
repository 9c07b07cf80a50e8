"""Parallel sampling (`SamplingParams.n` > 1) in the engine, on the tiny random Llama: n sequences from one prompt
computed once (the others find its full blocks in the prefix cache and compute only the tail), seeded choices
reproducible one by one, outputs folded into one RequestOutput per request (final, delta and cumulative), aborts
and bad values leaving the engine as it was, and the multi-process front end."""

from __future__ import annotations

import dataclasses
import re

import pytest

from openinfer import LLM, SamplingParams
from openinfer.sampling_params import MAX_N, RequestOutputKind
from tests.conftest import assert_pool_idle

BS = 16


@pytest.fixture(scope="module")
def llm16(tiny_llama_dir):
    """16-token blocks, so short prompts have full blocks to share."""
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", block_size=BS, max_num_seqs=8)
    yield llm
    llm.shutdown()


def _prompt(llm, tag: str) -> list[int]:
    """A prompt of 37 tokens (2 full blocks and a 5-token tail) no other test has put in the prefix cache."""
    ids = llm.tokenizer.encode(f"[{tag}] Once upon a time, in a village by the sea, there lived an old "
                               f"fisherman who every morning")
    ids = (ids * 3)[:37]
    assert len(ids) == 37
    return ids


def _tail(prompt_len: int) -> int:
    """Tokens a sibling computes: a hit leaves at least one token, so it stops at the last full block before it."""
    return prompt_len - (prompt_len - 1) // BS * BS


def test_n_sequences_share_one_prefill_and_are_seeded_choice_by_choice(llm16):
    eng = llm16.engine
    ids = _prompt(llm16, "share")
    before = eng.stats()["prompt_tokens_computed"]
    out = llm16.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
        n=3, temperature=1.0, seed=11, max_tokens=12, logprobs=1), use_tqdm=False)[0]
    computed = eng.stats()["prompt_tokens_computed"] - before
    assert computed == len(ids) + 2 * _tail(len(ids)) == 47          # once, plus two 5-token tails (not 3 x 37)
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    texts = [c.text for c in out.outputs]
    assert len(set(texts)) == 3, texts                                # three different continuations
    for c in out.outputs:
        assert c.finish_reason == "length" and len(c.token_ids) == 12 == len(c.logprobs)
        assert c.cumulative_logprob == pytest.approx(sum(lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)))
    # choice i samples with seed + i: each is what a single request with that seed gives, and reruns agree
    singles = llm16.generate(prompt_token_ids=[ids] * 3, sampling_params=[
        SamplingParams(temperature=1.0, seed=11 + i, max_tokens=12) for i in range(3)], use_tqdm=False)
    assert [s.outputs[0].token_ids for s in singles] == [c.token_ids for c in out.outputs]
    again = llm16.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
        n=3, temperature=1.0, seed=11, max_tokens=12), use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert again.num_cached_tokens == 32                              # (its prompt was cached by then)
    assert_pool_idle(eng)


def test_prompt_logprobs_once_and_each_sequence_keeps_its_grammar(llm16):
    ids = _prompt(llm16, "plp")
    one = llm16.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
        max_tokens=1, temperature=0, prompt_logprobs=2), use_tqdm=False)[0]
    out = llm16.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
        n=4, max_tokens=16, temperature=1.0, seed=5, prompt_logprobs=2,
        structured_outputs={"regex": r"[a-z]{2,6}( [a-z]{2,6}){2}"}), use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    for a, b in zip(out.prompt_logprobs[1:], one.prompt_logprobs[1:]):
        assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    assert len(out.outputs) == 4
    for c in out.outputs:
        assert re.fullmatch(r"[a-z]{2,6}( [a-z]{2,6}){2}", c.text) and c.finish_reason == "stop", c.text
    assert_pool_idle(llm16.engine)


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_streamed_outputs_fold_into_one_request(llm16, kind):
    """Through LLMEngine.step: one output per request and step, carrying the sequences that moved (DELTA) or all
    of them so far (CUMULATIVE); `finished` only once all are done; the same tokens as the final-only run."""
    eng = llm16.engine
    ids = _prompt(llm16, f"fold-{kind.name}")
    params = SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=6, output_kind=kind)
    final = llm16.generate(prompt_token_ids=[ids], sampling_params=dataclasses.replace(params), use_tqdm=False)[0]
    rid = eng.add_request(ids, params)
    got: dict[int, list[int]] = {}
    outs = []
    while eng.has_unfinished_requests():
        step = [o for o in eng.step() if o.request_id == rid]
        assert len(step) <= 1
        outs += step
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    for o in outs:
        for c in o.outputs:
            got[c.index] = got.get(c.index, []) + c.token_ids if kind is RequestOutputKind.DELTA else c.token_ids
    assert [got[i] for i in range(3)] == [c.token_ids for c in final.outputs]
    assert [c.finish_reason for c in outs[-1].outputs][-1] == "length"
    assert_pool_idle(eng)


def test_abort_stops_every_sequence_and_frees_their_blocks(llm16):
    eng = llm16.engine
    ids = _prompt(llm16, "abort")
    # right away, the siblings still waiting for the first one's prompt
    rid = eng.add_request(ids, SamplingParams(n=4, max_tokens=40, output_kind=RequestOutputKind.FINAL_ONLY))
    assert len(eng.requests) == 4
    out = eng.abort_request(rid)
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort"] * 4
    assert not eng.requests and eng.abort_request(rid) is None
    assert_pool_idle(eng)
    # mid-generation, by the id of one of its sequences
    rid = eng.add_request(ids, SamplingParams(n=3, max_tokens=40, ignore_eos=True))
    for _ in range(4):
        eng.step()
    assert sum(1 for r in eng.requests.values() if r.num_output_tokens) == 3     # all three are decoding
    out = eng.abort_request(f"{rid}#1")
    assert out.request_id == rid and out.finished and len(out.outputs) == 3
    assert all(c.finish_reason == "abort" and 0 < len(c.token_ids) < 40 for c in out.outputs)
    assert eng.step() == [] and not eng.requests
    assert_pool_idle(eng)


@pytest.mark.parametrize("n", [0, -1, MAX_N + 1, True, 2.0])
def test_bad_n_is_a_value_error_and_queues_nothing(llm16, n):
    with pytest.raises(ValueError, match=r"SamplingParams\.n must be an integer from 1 to 128"):
        SamplingParams(n=n)
    assert not llm16.engine.requests


def test_a_taken_sequence_id_is_refused_before_anything_is_queued(llm16):
    eng = llm16.engine
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=2), request_id="r#1")
    with pytest.raises(ValueError, match="'r#1'"):
        eng.add_request([1, 2, 3], SamplingParams(n=2, max_tokens=2), request_id="r")
    assert list(eng.requests) == ["r#1"]
    eng.abort_request("r#1")
    assert_pool_idle(eng)


def test_without_prefix_caching_each_sequence_computes_the_prompt(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", block_size=BS, max_num_seqs=8,
              enable_prefix_caching=False)
    try:
        ids = _prompt(llm, "nocache")
        out = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
            n=2, temperature=1.0, seed=11, max_tokens=5), use_tqdm=False)[0]
        assert llm.engine.stats()["prompt_tokens_computed"] == 2 * len(ids)
        ref = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
            temperature=1.0, seed=12, max_tokens=5), use_tqdm=False)[0]
        assert out.outputs[1].token_ids == ref.outputs[0].token_ids
        assert_pool_idle(llm.engine)
    finally:
        llm.shutdown()


def test_the_multiprocess_front_end_runs_n_sequences_on_one_rank(tmp_path, smollm_dir):
    """Two DP worker processes: a request with n > 1 goes whole to one group, whose engine shares its prompt; the
    front end gets one output per request (as the one-process engine gives it) and an abort stops every sequence."""
    from tests.test_models_tiny import make_tiny

    path, _ = make_tiny(tmp_path, smollm_dir, "llama3-rope-bias")
    opts = dict(device="cpu", dtype="float32", block_size=4, max_num_seqs=8)
    prompts = [[(7 * i + 3 * j) % 4000 + 10 for j in range(n)] for i, n in enumerate((13, 9))]
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    one = LLM(str(path), **opts)
    expected = one.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    one.shutdown()
    llm = LLM(str(path), data_parallel_size=2, **opts)
    try:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in expected]
        assert all(len({tuple(c.token_ids) for c in o.outputs}) == 3 for o in outs)
        # each prompt once, plus two 1-token tails (13 = 3 blocks + 1; 9 = 2 blocks + 1)
        assert llm.engine.stats()["prompt_tokens_computed"] == 13 + 9 + 2 * (1 + 1)
        engine = llm.engine
        rid = engine.add_request(prompts[0], SamplingParams(n=3, max_tokens=50, ignore_eos=True))
        engine.step()
        engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
        assert all(s["kv_blocks_free"] == s["kv_blocks_total"] and s["num_running"] == s["num_waiting"] == 0
                   for s in engine.call_ranks("stats"))
    finally:
        llm.shutdown()


def test_async_scheduling_and_preemption_keep_every_sequence_right(tiny_llama_dir, llm16):
    """A pool too small for four sequences at once (they preempt each other, dropping their share of the prompt's
    blocks and recomputing), under async scheduling: each greedy sequence is still the single request's."""
    ids = _prompt(llm16, "preempt")
    ref = llm16.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", block_size=BS, max_num_seqs=8, num_kv_blocks=12,
              async_scheduling=True)
    try:
        out = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
            n=4, temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
        assert llm.engine.stats()["num_preemptions"] > 0
        assert [c.token_ids for c in out.outputs] == [ref] * 4
        assert_pool_idle(llm.engine)
    finally:
        llm.shutdown()


def test_a_grammar_that_fails_fails_every_sequence_and_leaves_nothing(llm16):
    """Through LLMEngine directly (no pre-compile): the sequences share the grammar, so all of them end aborted
    with its error (or add_request refuses the request, if the failure is already known), and nothing is left."""
    import time

    eng = llm16.engine
    try:
        rid = eng.add_request([1, 2, 3], SamplingParams(n=3, max_tokens=4, structured_outputs={
            "regex": f"(unclosed{time.time_ns()}"}))
    except ValueError as e:
        assert "parenthesis" in str(e)
        rid = None
    done = []
    while eng.has_unfinished_requests():
        done += [o for o in eng.step() if o.finished]
    if rid is not None:
        assert [o.request_id for o in done] == [rid] and len(done[0].outputs) == 3
        assert all(c.finish_reason == "abort" and "parenthesis" in c.stop_reason for c in done[0].outputs)
    assert not eng.requests and not eng._parents and not eng._child_parent
    assert_pool_idle(eng)


def test_a_model_with_per_request_state_shares_its_prompt_through_snapshots(tmp_path):
    """DeepSeek-V4 (tiny, random): the siblings' prefix hit also restores the compressor / window state kept at
    the hit's last block, so they compute the 13-token tail only and sample what single requests would."""
    from tests.test_deepseek_v4 import make_v4, prompts_of

    make_v4(tmp_path)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=32, max_num_batched_tokens=16, max_num_seqs=4,
              num_kv_blocks=64)
    try:
        eng = llm.engine
        ids = prompts_of(77)[0]                        # 2 blocks of 32 + 13
        out = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
            n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
        assert eng.stats()["prompt_tokens_computed"] == 77 + 2 * 13
        singles = [llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
            temperature=1.0, seed=5 + i, max_tokens=8, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
            for i in range(3)]
        assert [c.token_ids for c in out.outputs] == singles
        assert_pool_idle(eng)
    finally:
        llm.shutdown()
