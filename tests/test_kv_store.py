"""The prefix-KV store (kv_cache/kv_store.py, tiers.py): a prefix computed by one process is a hit in another
process sharing the directory, and after a restart; bad entries and broken tiers cost recompute, never output.
(The Llama cases run the tiny random Llama: what is held here does not depend on what the weights say.)"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest
import torch
from prometheus_client import generate_latest

from openinfer import LLM, SamplingParams
from openinfer.kv_cache.kv_cache_manager import hash_block
from openinfer.kv_cache.kv_store import TieredKVStore
from openinfer.kv_cache.tiers import HEADER_BYTES, DirectoryTier, HostMemoryTier, pack_entry, unpack_entry
from openinfer.sampling_params import TTL_CLASSES, resolve_ttl
from openinfer.serving.metrics import EngineMetrics
from tests.conftest import assert_pool_idle

BS = 16                                             # small blocks keep the prompts short
PROMPT = [1000 + (i * 37) % 5000 for i in range(50)]    # 3 full blocks and 2 tokens
GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
NS = b"n" * 32


def _engine(model_dir, **kw) -> LLM:
    return LLM(str(model_dir), device="cpu", dtype="float32", block_size=BS, num_kv_blocks=24, max_num_seqs=4, **kw)


def _gen(llm, sp=GREEDY):
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=sp, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), out.num_cached_tokens


def _block_keys(n: int) -> list[bytes]:
    keys, parent = [], None
    for i in range(n):
        parent = hash_block(parent, PROMPT[i * BS:(i + 1) * BS])
        keys.append(parent)
    return keys


def _entry_path(llm, key: bytes):
    tier = next(t for t in llm.engine.kv_store.tiers if t.name == "dir")
    return tier._path(key)


def _forget_gpu_prefixes(llm):
    llm.engine.kv_store.flush()
    assert llm.engine.kv_manager.reset_prefix_cache()


_CHILD = """
import json, sys
from openinfer import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cpu", dtype="float32", block_size={bs}, num_kv_blocks=24, max_num_seqs=4,
          kv_store_dir=sys.argv[2])
out = llm.generate(prompt_token_ids=[{prompt}], sampling_params=SamplingParams(temperature=0, max_tokens=3,
                   ignore_eos=True), use_tqdm=False)[0]
print("RESULT", json.dumps([list(out.outputs[0].token_ids), out.num_cached_tokens]))
"""


def test_another_process_and_a_restart_hit_the_first_ones_prefixes(tiny_llama_dir, tmp_path):
    store = str(tmp_path / "kv")
    a = _engine(tiny_llama_dir, kv_store_dir=store)
    reference, cached = _gen(a)
    assert cached == 0
    a.engine.kv_store.flush()
    assert a.engine.stats()["kv_store_tiers"]["dir"]["bytes_written"] > 0

    child = subprocess.run([sys.executable, "-c", _CHILD.format(bs=BS, prompt=PROMPT), str(tiny_llama_dir), store],
                           capture_output=True, text=True, timeout=120, cwd=os.getcwd())
    assert child.returncode == 0, child.stderr[-2000:]
    line = next(x for x in child.stdout.splitlines() if x.startswith("RESULT "))
    assert json.loads(line[len("RESULT "):]) == [reference, 3 * BS]

    a.shutdown()
    b = _engine(tiny_llama_dir, kv_store_dir=store)          # the same process, restarted
    assert _gen(b) == (reference, 3 * BS)
    st = b.engine.stats()
    assert st["kv_store_tiers"]["dir"]["hits"] == 3 and st["prefix_cache_store_hit_tokens"] == 3 * BS
    metrics = EngineMetrics("m", b.engine)
    assert 'openinfer:kv_store_hits_total{model_name="m",tier="dir"} 3.0' in generate_latest(metrics.registry).decode()
    assert_pool_idle(b.engine)
    b.shutdown()


def test_a_slow_store_read_delays_only_its_own_request(tiny_llama_dir, tmp_path):
    """An arriving request's store read runs off the scheduler's thread (prefetch): while a slow tier answers
    (a busy shared filesystem: 1.5 s per block read, injected around the real directory tier), the other
    requests' steps go on; the slow request then hits as usual and gives the cold tokens."""
    first = _engine(tiny_llama_dir, kv_store_dir=str(tmp_path), kv_host_cache_bytes=0)
    cold, _ = _gen(first)
    first.shutdown()
    llm = _engine(tiny_llama_dir, kv_store_dir=str(tmp_path), kv_host_cache_bytes=0)
    engine = llm.engine
    tier = engine.kv_store.tiers[0]
    real_get = tier.get

    readers = []

    def slow_get(key):
        readers.append(threading.current_thread())
        time.sleep(1.5)
        return real_get(key)
    tier.get = slow_get
    slow = engine.add_request(PROMPT, GREEDY)
    other = engine.add_request([2000 + i for i in range(12)], GREEDY)     # no full block: nothing to read
    t0, done = time.perf_counter(), {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: (o, time.perf_counter() - t0) for o in engine.step() if o.finished})
    assert len(readers) == 3 and threading.main_thread() not in readers    # the scheduler never read the store
    assert done[other][1] < done[slow][1] and done[slow][1] >= 1.5
    assert done[slow][0].num_cached_tokens == 48 and list(done[slow][0].outputs[0].token_ids) == cold
    assert_pool_idle(engine)


def test_corrupt_and_truncated_entries_are_misses_and_change_nothing(tiny_llama_dir, tmp_path):
    llm = _engine(tiny_llama_dir, kv_store_dir=str(tmp_path), kv_host_cache_bytes=0)
    reference, cached = _gen(llm, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, cache_ttl="agent"))
    assert cached == 0
    _forget_gpu_prefixes(llm)
    keys = _block_keys(3)
    with open(_entry_path(llm, keys[0]), "rb") as f:     # the request's traffic class set the expiry
        _, expiry = unpack_header_expiry(f.read(HEADER_BYTES))
    assert abs(expiry - time.time() - TTL_CLASSES["agent"]) < 60

    path = _entry_path(llm, keys[1])
    data = bytearray(path.read_bytes())
    data[-7] ^= 0xFF                                     # one flipped payload byte: the checksum catches it
    path.write_bytes(bytes(data))
    assert _gen(llm) == (reference, BS)                  # block 0 from the store, blocks 1.. recomputed
    assert llm.engine.stats()["kv_store_tiers"]["dir"]["corrupt"] == 1
    _forget_gpu_prefixes(llm)
    assert _entry_path(llm, keys[1]).exists()            # block 1 was computed again, so saved again

    path = _entry_path(llm, keys[0])
    path.write_bytes(path.read_bytes()[:HEADER_BYTES + 100])   # truncated
    assert _gen(llm) == (reference, 0)
    assert llm.engine.stats()["kv_store_tiers"]["dir"]["corrupt"] == 2
    assert llm.engine.stats()["kv_store_tiers"]["dir"]["faults"] == 0
    llm.shutdown()


def unpack_header_expiry(header: bytes):
    from openinfer.kv_cache.tiers import _HEADER

    fields = _HEADER.unpack(header)
    return fields[3], fields[4]


def test_an_unwritable_store_faults_but_the_engine_serves_on(tiny_llama_dir, tmp_path, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the store's directory should be")   # mkdir fails, even as root
    llm = _engine(tiny_llama_dir, kv_store_dir=str(blocker / "kv"), kv_host_cache_bytes=0)
    with caplog.at_level("WARNING", logger="openinfer.kv_store"):
        first = _gen(llm)
        _forget_gpu_prefixes(llm)
        llm.engine.kv_store._down_until["dir"] = 0.0     # past the back-off: the tier is tried (and fails) again
        assert _gen(llm) == first and first[1] == 0
        llm.engine.kv_store.flush()
    assert llm.engine.stats()["kv_store_tiers"]["dir"]["faults"] >= 2
    assert sum("dir tier fault" in r.getMessage() for r in caplog.records) == 1     # logged once
    llm.shutdown()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_a_read_only_store_directory_faults_but_the_engine_serves_on(tiny_llama_dir, tmp_path):
    store = tmp_path / "ro"
    store.mkdir()
    store.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        llm = _engine(tiny_llama_dir, kv_store_dir=str(store), kv_host_cache_bytes=0)
        assert _gen(llm)[1] == 0
        llm.engine.kv_store.flush()
        assert llm.engine.stats()["kv_store_tiers"]["dir"]["faults"] >= 1
        llm.shutdown()
    finally:
        store.chmod(0o700)


def test_deepseek_state_travels_with_its_blocks_through_the_store(tmp_path):
    """DeepSeek-V4/V4.1 keep per-request state (window rings, compressor rows, Engram look-back): a restarted
    engine's hit through the store restores the state kept at the hit's last block, so a second turn decodes as a
    cold engine does — also from a boundary the first turn crossed while decoding. On V4.1 (every state kind travels
    as the same snapshot bytes; V4's are checked against plain decoding in tests/test_spec_rollback.py)."""
    model = "deepseek-v41-tiny"
    store = str(tmp_path / "kv")
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(2, 129000, (83,), generator=g).tolist()
    opts = dict(device="cpu", block_size=32, max_num_batched_tokens=64, max_num_seqs=4)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=0)
    a = LLM(model, kv_store_dir=store, **opts)
    first = a.generate(prompt_token_ids=[prompt], sampling_params=sp, use_tqdm=False)[0].outputs[0].token_ids
    a.shutdown()                                          # the queued writes finish first

    turn2 = prompt + list(first)[:-1] + [5, 6, 7]         # 115 tokens: blocks to 96 (crossed while decoding)
    b = LLM(model, kv_store_dir=store, **opts)
    warm = b.generate(prompt_token_ids=[turn2], sampling_params=sp, use_tqdm=False)[0]
    assert warm.num_cached_tokens == 96
    st = b.engine.stats()
    assert st["prefix_cache_store_hit_tokens"] == 96 and st["kv_store_tiers"]["dir"]["hits"] == 3 + 1  # 3 blocks, 1 state
    assert_pool_idle(b.engine)
    b.shutdown()
    cold = LLM(model, enable_prefix_caching=False, **opts)
    ref = cold.generate(prompt_token_ids=[turn2], sampling_params=sp, use_tqdm=False)[0].outputs[0]
    cold.shutdown()
    assert warm.outputs[0].token_ids == ref.token_ids
    for a_, b_, t in zip(warm.outputs[0].logprobs, ref.logprobs, ref.token_ids):
        assert abs(a_[t].logprob - b_[t].logprob) < 1e-4


def test_store_options_are_validated():
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM("smollm2-135m-instruct", device="cpu", kv_store_dir="/tmp/x", enable_prefix_caching=False)
    with pytest.raises(ValueError, match="redis://"):
        LLM("smollm2-135m-instruct", device="cpu", kv_store_url="http://localhost:6379")
    with pytest.raises(ValueError, match="cache_ttl"):
        SamplingParams(cache_ttl="forever")
    assert resolve_ttl("chat", 1.0) == 7 * 86400 and resolve_ttl(None, 5.0) == 5.0


# ---- tiers -------------------------------------------------------------------------------------------------
def test_concurrent_writers_of_one_block_never_leave_a_torn_entry(tmp_path):
    tier = DirectoryTier(tmp_path, NS)
    payloads = [bytes([i]) * (1 << 20) for i in range(4)]
    stop, seen, errors = threading.Event(), [], []

    def write(p):
        while not stop.is_set():
            DirectoryTier(tmp_path, NS).put(b"k" * 32, p, 60.0)

    def read():
        reader = DirectoryTier(tmp_path, NS)
        while not stop.is_set():
            got = reader.get(b"k" * 32)
            if got is not None:
                seen.append(got in payloads)
        errors.append(reader.stats.corrupt)

    threads = [threading.Thread(target=write, args=(p,)) for p in payloads] + [threading.Thread(target=read)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join()
    assert seen and all(seen) and errors == [0]
    assert tier.get(b"k" * 32) in payloads
    assert not [f for f in (tmp_path / NS.hex()[:32]).rglob(".*tmp")]        # no temporary file left behind


def test_host_tier_evicts_least_recently_used_between_watermarks():
    tier = HostMemoryTier(1000)                  # high watermark 950, low 850
    for i in range(9):
        tier.put(bytes([i]), b"x" * 100, 60.0)
    assert tier.get(bytes([0])) is not None      # block 0 is now the most recently used
    tier.put(bytes([9]), b"x" * 100, 60.0)       # 1000 > 950: evict down to 850 (blocks 1 and 2)
    assert [i for i in range(10) if tier.contains(bytes([i]))] == [0, *range(3, 10)]
    assert tier.used == 800 and tier.stats.evictions == 2
    tier.put(b"ttl", b"y" * 10, 0.01)
    time.sleep(0.02)
    assert tier.get(b"ttl") is None               # expired


def test_directory_tier_expiry_namespace_and_capacity(tmp_path):
    tier = DirectoryTier(tmp_path, NS, capacity_bytes=10 * (HEADER_BYTES + 100))
    tier.put(b"old", b"a" * 100, 0.01)
    time.sleep(0.02)
    assert tier.get(b"old") is None and not tier._path(b"old").exists()       # expired: a miss, removed
    assert unpack_entry(b"m" * 32, pack_entry(NS, b"abc", 60.0)) == (None, "corrupt")   # another namespace
    for i in range(12):
        tier.put(bytes([i]) * 4, b"b" * 100, 60.0)
        time.sleep(0.002)
    assert tier.used <= tier.capacity and tier.stats.evictions >= 2
    assert not tier.contains(bytes([0]) * 4) and tier.contains(bytes([11]) * 4)   # oldest went first


def test_a_full_write_queue_drops_writes_instead_of_waiting(tmp_path):
    class Slow(HostMemoryTier):
        name = "dir"

        def contains(self, key):
            return False

        def put(self, key, payload, ttl_s):
            time.sleep(0.05)
            super().put(key, payload, ttl_s)

    store = TieredKVStore([Slow(1 << 20)], payload_bytes=3, default_ttl_s=60.0, queue_bytes=6)  # 2 blocks
    t0 = time.perf_counter()
    for i in range(20):
        store.put(bytes([i]), lambda: b"abc")
    assert time.perf_counter() - t0 < 0.05 and store.dropped_writes >= 15
    store.close()


def test_a_failing_tier_is_a_counted_miss_and_the_next_tier_answers(tmp_path):
    class Broken(HostMemoryTier):
        name = "redis"

        def get(self, key):
            raise ConnectionError("down")

    good = DirectoryTier(tmp_path, NS)
    good.put(b"k", b"abc", 60.0)
    store = TieredKVStore([Broken(100), good], payload_bytes=3, default_ttl_s=60.0)
    assert store.get(b"k") == b"abc" and store.get(b"k") == b"abc"
    assert store.stats()["kv_store_tiers"]["redis"]["faults"] == 1      # then left out for backoff_s
    store.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_redis_tier_round_trip_and_corruption(tmp_path):
    pytest.importorskip("redis", reason="the redis client package is not installed")
    from openinfer.kv_cache.tiers import RedisTier

    port = _free_port()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--dir", str(tmp_path)],
                              stdout=subprocess.DEVNULL)
    try:
        tier = RedisTier(f"redis://127.0.0.1:{port}/0", NS)
        for _ in range(100):
            try:
                tier.client.ping()
                break
            except Exception:
                time.sleep(0.05)
        store = TieredKVStore([tier], payload_bytes=3, default_ttl_s=60.0)
        store.put(b"k", lambda: b"abc")
        store.flush()
        assert store.get(b"k") == b"abc" and tier.stats.hits == 1
        tier.client.set(tier.prefix + b"k".hex().encode(), b"garbage")
        assert store.get(b"k") is None and tier.stats.corrupt == 1
        server.terminate()
        server.wait()
        assert store.get(b"k") is None and tier.stats.faults == 1      # server down: a fault, not an error
        store.close()
    finally:
        server.kill()


def test_deferred_puts_are_visible_before_their_copy_is_done():
    """DeferredPutTier (the SWA state tier on CUDA): an entry whose device copy is still queued counts as present,
    `settle` stores only finished copies, and `get` of a pending one waits for that copy and returns it."""
    from openinfer.kv_cache.tiers import DeferredPutTier

    tier = DeferredPutTier(HostMemoryTier(1 << 20))
    done = {"a": False, "b": True}
    reads = []

    def reader(k):
        def read():
            reads.append(k)
            return k.encode() * 4
        return read

    for k in ("a", "b"):
        tier.put_later(k.encode(), lambda k=k: done[k], reader(k), 60.0)
    assert tier.contains(b"a") and tier.contains(b"b") and not tier.tier.contains(b"a")
    tier.settle()                                     # only b's copy is done
    assert reads == ["b"] and tier.tier.contains(b"b") and not tier.tier.contains(b"a")
    assert tier.get(b"a") == b"aaaa" and reads == ["b", "a"]     # waited for a's copy
    tier.put_later(b"c", lambda: False, reader("c"), 60.0)
    tier.settle(wait=True)
    assert tier.get(b"c") == b"cccc" and tier.stats.hits == 2
