"""Engines free what they hold when shut down: the model, its caches and the grammar threads go at once,
not whenever Python's collector next runs (engine objects refer to each other)."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest

from openinfer import LLM, SamplingParams


def test_shutdown_frees_the_engine_at_once_in_a_loop():
    gc.disable()          # what a GPU user sees between collections: only shutdown() may free the engine
    try:
        for _ in range(3):
            # other engines alive in this process (another test file's fixtures, in the same pytest worker) keep
            # their own grammar threads: only this engine's must end
            others = set(threading.enumerate())
            llm = LLM("deepseek-v4-tiny", device="cpu", num_kv_blocks=16, max_num_seqs=4)
            sp = SamplingParams(max_tokens=3, structured_outputs={"choice": ["yes", "no"]})
            llm.generate(prompt_token_ids=[[5, 6, 7] * 10], sampling_params=sp, use_tqdm=False)
            model = weakref.ref(llm.engine.runner.model)
            engine = weakref.ref(llm.engine)
            llm.shutdown()
            assert model() is None and engine() is None
            mine = [t for t in threading.enumerate() if t.name.startswith("grammar-compile") and t not in others]
            for t in mine:
                t.join(timeout=5)                            # the pool was told to stop; its threads end
                assert not t.is_alive()
            with pytest.raises(RuntimeError, match="shut down"):
                llm.generate(prompt_token_ids=[[5, 6, 7]], use_tqdm=False)
            llm.shutdown()                                   # idempotent
    finally:
        gc.enable()


def test_building_models_in_a_fresh_process_imports_neither_dynamo_nor_sympy(smollm_dir):
    """Models are built on the meta device; the first meta-device arange / normal_ / empty_like in a process imports
    torch._dynamo or sympy (~3 s of every fresh process: a server, a CLI run, each rank of a multi-process engine).
    Building and running SmolLM2, DeepSeek-V4-tiny and V4.1-tiny in a new interpreter must not."""
    import subprocess
    import sys

    # two tokens: a prefill and a decode step (the default 16 ran 14 more decode steps of the same code)
    code = ("import sys\nfrom openinfer import LLM, SamplingParams\n"
            f"for m in ({str(smollm_dir)!r}, 'deepseek-v4-tiny', 'deepseek-v41-tiny'):\n"
            "    LLM(m, device='cpu', dtype='float32').generate(prompt_token_ids=[[1, 2, 3]], use_tqdm=False,\n"
            "                                                   sampling_params=SamplingParams(max_tokens=2))\n"
            "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout


def _resident_share(tensors) -> float:
    """The share of the pages under `tensors` that are resident (mincore(2) over each tensor's page range)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    page = mmap.PAGESIZE
    resident = total = 0
    for t in tensors:
        start = t.data_ptr() // page * page
        end = -(-(t.data_ptr() + t.numel() * t.element_size()) // page) * page
        vec = ctypes.create_string_buffer((end - start) // page)
        assert libc.mincore(start, end - start, vec) == 0, ctypes.get_errno()
        resident += sum(b & 1 for b in vec.raw)
        total += len(vec.raw)
    return resident / total


def test_touching_the_pool_makes_it_resident_and_keeps_its_contents(smollm_dir):
    """What `openinfer serve` does before serving (CachePool.touch_pages): the CPU pool, handed out lazily, becomes
    resident (every page of its tensors, by mincore: the process's RSS growth would also count, or miss, whatever
    else the process allocates or reuses meanwhile) and what the caches hold is unchanged."""
    from openinfer.config import EngineConfig
    from openinfer.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(smollm_dir), device="cpu", kv_cache_memory_bytes=256 << 20))
    pool = engine.runner.pool
    tensors = [t for ts in (*pool.caches.values(), *pool.snapshots.values()) for t in ts]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    assert nbytes > 200 << 20
    first, last = tensors[0].view(-1), tensors[-1].view(-1)
    first[:5], last[-3:] = 1.5, -2.0
    before = _resident_share(tensors)
    engine.touch_cache_pages()
    after = _resident_share(tensors)
    assert after > 0.999, (before, after)
    assert first[:5].eq(1.5).all() and last[-3:].eq(-2.0).all()
    assert all(int(t.count_nonzero()) == 0 for t in tensors[1:-1])
    assert int(first.count_nonzero()) == 5 and int(last.count_nonzero()) == 3
    engine.shutdown()
