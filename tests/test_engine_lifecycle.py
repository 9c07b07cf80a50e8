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
            llm = LLM("deepseek-v4-tiny", device="cpu", num_kv_blocks=16, max_num_seqs=4)
            sp = SamplingParams(max_tokens=3, structured_outputs={"choice": ["yes", "no"]})
            llm.generate(prompt_token_ids=[[5, 6, 7] * 10], sampling_params=sp, use_tqdm=False)
            model = weakref.ref(llm.engine.runner.model)
            engine = weakref.ref(llm.engine)
            llm.shutdown()
            assert model() is None and engine() is None
            for t in [t for t in threading.enumerate() if t.name.startswith("grammar-compile")]:
                t.join(timeout=5)                            # the pool was told to stop; its threads end
                assert not t.is_alive()
            with pytest.raises(RuntimeError, match="shut down"):
                llm.generate(prompt_token_ids=[[5, 6, 7]], use_tqdm=False)
            llm.shutdown()                                   # idempotent
    finally:
        gc.enable()
