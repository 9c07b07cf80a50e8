"""The engine core in its own process (executor/engine_core.py): the same tokens as the in-process engine, bad
requests refused alone, calls answered, a dead core reported (with its traceback) and never a hang, nothing left
running after shutdown."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

from openinfer import LLM, SamplingParams
from openinfer.config import EngineConfig
from openinfer.executor.engine_core import EngineCoreClient, EngineCoreError
from openinfer.sampling_params import RequestOutputKind

GREEDY = dict(temperature=0, max_tokens=12, ignore_eos=True)


class Collector:
    """What the client's reader thread hands over, by request."""

    def __init__(self, client: EngineCoreClient):
        self.outputs: dict[str, list] = {}
        self.refused: dict[str, Exception] = {}
        self.death: list[BaseException] = []
        self.done = threading.Condition()
        client.on_outputs = self.on_outputs
        client.on_refused = self.on_refused
        client.on_death = self.on_death

    def on_outputs(self, outputs, stats) -> None:
        with self.done:
            for out in outputs:
                self.outputs.setdefault(out.request_id, []).append(out)
            self.done.notify_all()

    def on_refused(self, rid, error) -> None:
        with self.done:
            self.refused[rid] = error
            self.done.notify_all()

    def on_death(self, error) -> None:
        with self.done:
            self.death.append(error)
            self.done.notify_all()

    def wait(self, predicate, timeout: float = 60.0) -> None:
        with self.done:
            assert self.done.wait_for(predicate, timeout), "timed out"


@pytest.fixture(scope="module")
def core(tiny_llama_dir):
    client = EngineCoreClient(EngineConfig(model=str(tiny_llama_dir), device="cpu", num_kv_blocks=64, block_size=16))
    yield client
    client.shutdown()


def test_tokens_equal_the_in_process_engine(core, tiny_llama_dir):
    prompts = [core.tokenizer.encode(p) for p in ("The capital of France is", "def fib(n):", "Once upon a time")]
    params = SamplingParams(**GREEDY, output_kind=RequestOutputKind.DELTA)
    got = Collector(core)
    for i, ids in enumerate(prompts):
        core.add_request(ids, params, request_id=f"r{i}")
    got.wait(lambda: all(any(o.finished for o in got.outputs.get(f"r{i}", ())) for i in range(3)))
    llm = LLM(tiny_llama_dir, device="cpu", num_kv_blocks=64, block_size=16)
    ref = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(**GREEDY), use_tqdm=False)
    llm.shutdown()
    for i, r in enumerate(ref):
        deltas = got.outputs[f"r{i}"]
        assert [t for o in deltas for t in o.outputs[0].token_ids] == r.outputs[0].token_ids
        assert deltas[-1].prompt_token_ids == prompts[i]          # the client puts the prompt back
    assert not core.requests
    stats = core.call("stats")
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["num_running"] == 0


def test_a_refused_request_fails_alone_and_bad_input_sends_nothing(core):
    got = Collector(core)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        core.add_request([10**9], SamplingParams(max_tokens=2), request_id="bad")
    assert "bad" not in core.requests
    core.add_request([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True), request_id="ok")
    got.wait(lambda: any(o.finished for o in got.outputs.get("ok", ())))
    with pytest.raises(EngineCoreError, match="no_such_method"):
        core.call("no_such_method")
    assert core.call("has_unfinished_requests") is False         # a failed call is not fatal


def test_an_abort_frees_the_request_in_the_core(core):
    got = Collector(core)
    steps = core.call("stats")["num_steps"]
    core.add_request([5] * 20, SamplingParams(max_tokens=2000, ignore_eos=True, output_kind=RequestOutputKind.DELTA),
                     request_id="long")
    got.wait(lambda: "long" in got.outputs)
    core.abort_request("long")
    deadline = time.time() + 30
    while core.call("has_unfinished_requests") and time.time() < deadline:
        time.sleep(0.05)
    stats = core.call("stats")
    assert stats["num_running"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["num_steps"] - steps < 2000                     # stopped by the abort, not by max_tokens


def test_a_dead_core_is_reported_with_no_hang_and_nothing_left(tiny_llama_dir):
    client = EngineCoreClient(EngineConfig(model=str(tiny_llama_dir), device="cpu", num_kv_blocks=16, block_size=16))
    got = Collector(client)
    pid = client._proc.pid
    os.kill(pid, signal.SIGKILL)
    got.wait(lambda: got.death)
    assert isinstance(got.death[0], EngineCoreError) and "died" in str(got.death[0])
    with pytest.raises(EngineCoreError, match="died"):
        client.add_request([1, 2], SamplingParams(max_tokens=1), request_id="after")
    client.shutdown()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_core_that_fails_to_start_says_why(tmp_path, tiny_llama_dir):
    with pytest.raises(EngineCoreError, match="max_model_len 100000 does not fit the KV pool"):
        EngineCoreClient(EngineConfig(model=str(tiny_llama_dir), device="cpu", num_kv_blocks=2, block_size=16,
                                      max_model_len=100000))


def test_shutdown_leaves_no_process(tiny_llama_dir):
    client = EngineCoreClient(EngineConfig(model=str(tiny_llama_dir), device="cpu", num_kv_blocks=16, block_size=16))
    pid = client._proc.pid
    assert psutil.pid_exists(pid)
    client.shutdown()
    client.shutdown()                                            # idempotent
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_warm_up_leaves_no_trace(tiny_llama_dir):
    """What the core runs at start on a GPU (LLMEngine.warm_up): afterwards the pool is free, the prefix cache
    empty and every counter at zero, and a request gives the tokens it gives on a fresh engine."""
    from openinfer.engine.llm_engine import LLMEngine

    config = EngineConfig(model=str(tiny_llama_dir), device="cpu", num_kv_blocks=64, block_size=16,
                          max_num_batched_tokens=64, max_num_seqs=4)
    engine = LLMEngine(config)
    assert engine.warm_up() > 0
    st = engine.stats()
    assert st["jit_compiles"] is None and st["graph_captures"] == 0        # CPU: no Triton, no graphs
    assert st["kv_blocks_free"] == st["kv_blocks_total"] and not engine.has_unfinished_requests()
    assert (st["num_steps"], st["prompt_tokens_computed"], st["prefix_cache_queried_tokens"]) == (0, 0, 0)
    assert engine.kv_manager.pool.num_cached_blocks == 0
    prompt = engine.tokenizer.encode("The capital of France is")
    engine.add_request(prompt, SamplingParams(**GREEDY), request_id="a")
    out = None
    while engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.finished), out)
    fresh = LLM(tiny_llama_dir, device="cpu", num_kv_blocks=64, block_size=16, max_num_batched_tokens=64)
    ref = fresh.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(**GREEDY), use_tqdm=False)[0]
    fresh.shutdown()
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_a_consumer_that_falls_behind_gets_the_waiting_deltas_as_one(core, tiny_llama_dir):
    """AsyncLLMEngine over the core: a stream read slower than the engine steps gets the deltas that waited joined
    into one (fewer chunks to frame and send), with exactly the tokens and text of reading every step."""
    import asyncio

    from openinfer.serving.async_engine import AsyncLLMEngine

    prompt = core.tokenizer.encode("Write a story about the sea.")
    params = dict(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    llm = LLM(tiny_llama_dir, device="cpu", num_kv_blocks=64, block_size=16)
    ref = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(**params), use_tqdm=False)[0]
    llm.shutdown()
    engine = AsyncLLMEngine(core)
    engine.start()

    async def read():
        items = []
        async for out in engine.generate(prompt, SamplingParams(**params), "slow"):
            items.append(out)
            while "slow" in core.requests:       # fall behind: let the core finish while this stream waits
                await asyncio.sleep(0.01)
        return items

    try:
        slow = asyncio.run(read())
    finally:
        engine.shutdown()
    assert len(slow) == 2                        # the first delta, then the 23 steps that waited as one
    assert [t for o in slow for t in o.outputs[0].token_ids] == ref.outputs[0].token_ids
    assert "".join(o.outputs[0].text for o in slow) == ref.outputs[0].text
    assert [lp for o in slow for lp in o.outputs[0].logprobs] == ref.outputs[0].logprobs
    assert slow[-1].finished and slow[-1].outputs[0].finish_reason == "length"


def test_an_output_of_a_request_let_go_here_is_dropped_and_the_reader_lives_on(core):
    """The race of an abort: the client lets a request go while its last step runs in the core, and the finished
    output arrives for a request it no longer holds; nobody gets it (it has no prompt to put back), and the reader
    thread goes on serving."""
    got = Collector(core)
    core.add_request([5] * 8, SamplingParams(max_tokens=3, ignore_eos=True, output_kind=RequestOutputKind.DELTA),
                     request_id="let-go")
    core._prompts.pop("let-go")                  # as abort_request does, with the abort not yet taken by the core
    deadline = time.time() + 30
    while core.call("has_unfinished_requests") and time.time() < deadline:
        time.sleep(0.05)
    core.add_request([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True), request_id="after-let-go")
    got.wait(lambda: any(o.finished for o in got.outputs.get("after-let-go", ())))
    assert "let-go" not in got.outputs and core.error is None


def test_several_clients_each_get_their_own_requests_and_stop_only_them(tiny_llama_dir):
    """A core that takes clients (`--api-server-count`): two connected clients get their own numbers, only their
    own requests' outputs and the core's stats every step; an abort of another client's
    request does nothing; a call works from any client; an id already live is refused; a client that goes away has
    its requests aborted (their blocks free) while the others go on. (Tokens: the same prompt gives the same
    greedy tokens to either client; the first test holds the core's tokens equal to the engine alone.)"""
    config = EngineConfig(model=str(tiny_llama_dir), device="cpu", num_kv_blocks=64, block_size=16)
    owner = EngineCoreClient(config, accept_clients=True)
    a = b = None
    try:
        a = EngineCoreClient.connect(config, owner.model_source, owner.address)
        b = EngineCoreClient.connect(config, owner.model_source, owner.address)
        assert (owner.client_index, a.client_index, b.client_index) == (0, 1, 2)
        got_a, got_b = Collector(a), Collector(b)
        steps_b = []
        b.on_outputs = lambda outs, st: (steps_b.append(st), got_b.on_outputs(outs, st))
        prompt = a.tokenizer.encode("The capital of France is")
        delta = dict(GREEDY, output_kind=RequestOutputKind.DELTA)
        a.add_request(prompt, SamplingParams(**delta), request_id="a-1")
        a.add_request([5] * 20, SamplingParams(max_tokens=2000, ignore_eos=True, output_kind=RequestOutputKind.DELTA),
                      request_id="a-long")
        b._send(("abort", "a-long"))           # what b's abort of that id would send (b never added it): ignored
        got_a.wait(lambda: any(o.finished for o in got_a.outputs.get("a-1", ())))
        assert "a-long" not in got_a.outputs or not any(o.finished for o in got_a.outputs["a-long"])
        assert got_b.outputs == {} and len(steps_b) > 0                 # b: the core's stats, none of a's outputs
        assert steps_b[-1]["num_running"] >= 1
        b.add_request(prompt, SamplingParams(**delta), request_id="a-long")  # a's id, still live: refused
        got_b.wait(lambda: "a-long" in got_b.refused)
        assert "already in use" in str(got_b.refused["a-long"])
        assert b.call("has_unfinished_requests") is True                 # a call from any client
        b.add_request(prompt, SamplingParams(**delta), request_id="b-1")
        a.shutdown()                                                      # a goes away: a-long is aborted
        got_b.wait(lambda: any(o.finished for o in got_b.outputs.get("b-1", ())))
        tokens = [[t for o in got.outputs[rid] for t in o.outputs[0].token_ids] for got, rid in ((got_a, "a-1"),
                                                                                              (got_b, "b-1"))]
        assert tokens[0] == tokens[1] and len(tokens[0]) == GREEDY["max_tokens"]   # (== LLM's: the first test)
        deadline = time.time() + 30
        while owner.call("has_unfinished_requests") and time.time() < deadline:
            time.sleep(0.05)
        st = owner.call("stats")
        assert st["num_running"] == st["num_waiting"] == 0 and st["kv_blocks_free"] == st["kv_blocks_total"]
        assert b.error is None and owner.error is None
    finally:
        for client in (a, b, owner):
            if client is not None:
                client.shutdown()
