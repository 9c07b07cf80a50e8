"""Async scheduling (one step in flight, stops found one step late) gives exactly the synchronous results.

On the CPU the host and the device are the same, so nothing overlaps here, but every piece of the logic
runs: pending tokens fed from the previous step's samples, late stops with the extra token discarded,
preemption and aborts with a step in flight, block accounting."""

from __future__ import annotations

import pytest

from openinfer import LLM, SamplingParams
from tests.conftest import assert_pool_idle

PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):", "1, 2, 3,", "Hello",
           "The weather today is", "Q: What is 2+2?\nA:", "import os"]


def _params(stop: str, stop_id: int):
    return [SamplingParams(temperature=0, max_tokens=1),
            SamplingParams(temperature=0, max_tokens=2),
            SamplingParams(temperature=0, max_tokens=24, stop=[stop, "\n"]),
            SamplingParams(temperature=0, max_tokens=30, min_tokens=6, stop_token_ids=[stop_id]),
            SamplingParams(temperature=0.8, seed=11, max_tokens=20),
            SamplingParams(temperature=0, max_tokens=40),                          # may stop on EOS
            SamplingParams(temperature=0.7, seed=5, max_tokens=16, logprobs=2),
            SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3)]  # reads its history


def _run(llm, stops):
    outs = llm.generate(PROMPTS, _params(*stops), use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
            for o in outs]


@pytest.fixture(scope="module")
def sync_llm(tiny_llama_dir):
    """The engine runs the tiny random Llama: what is held here does not depend on what the weights say."""
    return LLM(str(tiny_llama_dir), device="cpu", async_scheduling=False, block_size=16)


@pytest.fixture(scope="module")
def stops(sync_llm):
    """A stop string that the greedy text of PROMPTS[2] meets past its middle (three printable characters,
    whichever tokens hold them), and a stop token that PROMPTS[3]'s greedy tokens meet first past min_tokens: the
    model's text is noise, so its stops are read from it."""
    text, ids = (o.outputs[0] for o in sync_llm.generate(
        PROMPTS[2:4], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False))
    text, ids = text.text, ids.token_ids
    at = next(k for k in range(len(text) // 2, len(text) - 3)
              if text[k:k + 3].isprintable() and text[k:k + 3].isascii() and "\n" not in text[:k + 3])
    return text[at:at + 3], next(t for t in ids[6:] if t not in ids[:6])


@pytest.fixture(scope="module")
def sync_results(sync_llm, stops):
    results = _run(sync_llm, stops)
    assert results[2][2:] == ("stop", stops[0]) and results[3][2:] == ("stop", stops[1])   # both stops are met
    return results


def test_async_equals_sync(tiny_llama_dir, stops, sync_results):
    llm = LLM(str(tiny_llama_dir), device="cpu", async_scheduling=True, block_size=16)
    assert llm.config.use_async_scheduling
    assert _run(llm, stops) == sync_results
    assert_pool_idle(llm.engine)


def test_async_with_preemption_and_small_chunks(tiny_llama_dir, stops, sync_results):
    llm = LLM(str(tiny_llama_dir), device="cpu", async_scheduling=True, block_size=16, num_kv_blocks=6,
              max_num_batched_tokens=24, enable_prefix_caching=False)
    assert _run(llm, stops) == sync_results
    assert llm.engine.scheduler.num_preemptions > 0
    assert_pool_idle(llm.engine)


def test_async_chat_stops_on_eos_one_step_late(smollm_dir):
    """On SmolLM2: a real model's chat ends on its EOS token."""
    sp = SamplingParams(temperature=0, max_tokens=200)
    conv = [{"role": "user", "content": "Say hello."}]
    a = LLM(str(smollm_dir), device="cpu", async_scheduling=True).chat(conv, sp, use_tqdm=False)[0].outputs[0]
    b = LLM(str(smollm_dir), device="cpu", async_scheduling=False).chat(conv, sp, use_tqdm=False)[0].outputs[0]
    assert a.finish_reason == "stop" and a.token_ids == b.token_ids and a.text == b.text


def test_async_abort_with_a_step_in_flight(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", async_scheduling=True, block_size=16)
    eng = llm.engine
    ids = [eng.add_request(llm.tokenizer.encode(p), SamplingParams(max_tokens=40, ignore_eos=True)) for p in PROMPTS]
    for _ in range(3):
        eng.step()
    assert eng._in_flight is not None
    for rid in ids[::2]:
        eng.abort_request(rid)
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            done[o.request_id] = o
    assert set(done) == set(ids[1::2]) and all(len(o.outputs[0].token_ids) == 40 for o in done.values())
    assert_pool_idle(eng)


def test_async_never_schedules_past_max_model_len(tiny_llama_dir):
    """The token still on the device may end the request (max_model_len / max_tokens): it is not extended."""
    llm = LLM(str(tiny_llama_dir), device="cpu", async_scheduling=True, block_size=16, max_model_len=40)
    eng = llm.engine
    seen = []
    schedule = eng.scheduler.schedule

    def recording_schedule():
        out = schedule()
        seen.extend(s.start + s.num_new_tokens for s in out.scheduled)
        return out

    eng.scheduler.schedule = recording_schedule
    outs = llm.generate(prompt_token_ids=[[5] * 30, [7] * 39, [9] * 40],
                        sampling_params=SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [10, 1, 1]
    assert max(seen) <= 40
    assert_pool_idle(eng)


def test_a_decode_step_is_queued_before_the_previous_one_is_read_back(tiny_llama_dir):
    """What lets the host's per-request work overlap the GPU's: in steady decoding each step() first queues its own
    forward (runner.execute) and only then reads back and processes the step before it, never the one it just
    queued (issue 34)."""
    llm = LLM(str(tiny_llama_dir), device="cpu", async_scheduling=True, block_size=16)
    eng = llm.engine
    calls = []
    execute, process = eng.runner.execute, eng.output_processor.process

    def logged_execute(*a, **k):
        out = execute(*a, **k)
        calls.append(("execute", out))
        return out

    def logged_process(runner_out, *a, **k):
        calls.append(("process", runner_out))
        return process(runner_out, *a, **k)

    eng.runner.execute, eng.output_processor.process = logged_execute, logged_process
    for i in range(4):
        eng.add_request([5 + i, 6, 7, 8, 9], SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=12,
                                                            ignore_eos=True))
    eng.step()                       # the prompts
    for _ in range(8):
        calls.clear()
        eng.step()
        assert [c[0] for c in calls] == ["execute", "process"]
        queued, read_back = calls[0][1], calls[1][1]
        assert read_back is not queued and eng._in_flight is queued
    while eng.has_unfinished_requests():
        eng.step()
