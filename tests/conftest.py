"""Shared fixtures: the real default model (fetched/converted once into the openinfer cache) and its HF reference."""

from __future__ import annotations

import contextlib
import functools
import os

import pytest
import torch

from openinfer.config import default_cache_dir
from openinfer.loader.model_source import fetch_registered, resolve_model_dir

# `make test` runs the suite in pytest-xdist workers, one per core: each worker's torch gets its share of the cores
# (more threads than cores crawl: OpenMP threads spin while they wait for each other), and so does every process a
# test starts (servers, engine ranks, CLI runs: their torch reads OMP_NUM_THREADS), unless the environment set it.
# A subprocess with a thread per core beside the other busy worker ran 1.6x as long on 2 cores, far more on a
# loaded machine.
torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))


@pytest.fixture(scope="session")
def smollm_dir():
    return resolve_model_dir("smollm2-135m-instruct", default_cache_dir())


# A tiny Llama shape (2 layers, width 64) under SmolLM2's vocabulary: tests/test_models_tiny.py holds the engine's
# logits equal to transformers' on it.
TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False)


def write_tiny_llama(path, smollm_dir, **overrides):
    """TINY (with `overrides`) as random weights written straight to safetensors (no transformers import), with
    SmolLM2's tokenizer and chat template beside them."""
    from openinfer.models.llama.family import FAMILY as LLAMA

    LLAMA.write_random_checkpoint({**TINY, "rope_theta": 10000.0, **overrides}, path, std=0.1,
                                  tokenizer_dir=smollm_dir)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm_dir):
    """A tiny random Llama for the engine-behaviour tests whose property does not depend on what the weights say
    (scheduling, preemption, aborts, prefix caching, async scheduling, processes): ~30x cheaper a token than
    SmolLM2-135M on the CPU. Its text is noise: tests that need real text (EOS, fidelity) stay on SmolLM2."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm_dir, max_position_embeddings=4096)


@pytest.fixture(scope="session")
def smollm_gguf():
    return fetch_registered("smollm2-135m-instruct", default_cache_dir())


@contextlib.contextmanager
def gguf_parsed_once():
    """While transformers loads a GGUF file, two pure computations it repeats are memoized (what it loads is the
    same): it asks gguf-py for its tensor-name map once per module (~400 times for SmolLM2), and gguf-py builds the
    same table afresh each time (24 ms: ~10 s of a 28 s load on the CI machine); and it parses the file's header
    twice (once for the config, once for the weights: ~5 s each, the 49k-token vocabulary's
    strings read one numpy memmap slice at a time) — a file's reader is read-only, so both get the same one."""
    import gguf

    build_map, build_reader = gguf.get_tensor_name_map, gguf.GGUFReader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(build_map)
    gguf.GGUFReader = functools.lru_cache(maxsize=None)(build_reader)
    try:
        yield
    finally:
        gguf.get_tensor_name_map, gguf.GGUFReader = build_map, build_reader


@pytest.fixture(scope="session")
def hf_smollm(smollm_gguf):
    """HF transformers' own GGUF loading of the same file, fp32: the reference (`gguf_parsed_once`: checked to
    load the same tensors and config as a plain load)."""
    from transformers import AutoModelForCausalLM

    with gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(str(smollm_gguf.parent), gguf_file=smollm_gguf.name,
                                                     dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def llm(smollm_dir):
    from openinfer import LLM

    return LLM(str(smollm_dir), device="cpu", dtype="float32", max_num_seqs=16)


def assert_pool_idle(engine):
    """No request holds a block: every block is free (cached ones included), in every pool."""
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    window = engine.kv_manager.window
    assert window is None or window.pool.num_free_blocks == window.pool.num_blocks


def record_drafter_extends(drafter) -> dict[int, list[int]]:
    """Wrap a feature drafter's `extend` to record, per drafter slot, the positions written, in call order."""
    extended: dict[int, list[int]] = {}
    extend = drafter.extend

    def logging_extend(slots, positions, features, **kw):
        for s, p in zip(slots.tolist(), positions.tolist()):
            extended.setdefault(s, []).append(p)
        return extend(slots, positions, features, **kw)

    drafter.extend = logging_extend
    return extended


def record_step_logits(llm) -> dict[str, list]:
    """Wrap the engine runner's `execute` to record, per request, the logits of its sampled row at every step
    (float32, on the CPU)."""
    logits: dict[str, list] = {}
    execute = llm.engine.runner.execute

    def recording(sched, *rest):
        out = execute(sched, *rest)
        for rid, i in out.sample_index.items():
            logits.setdefault(rid, []).append(out.logits[i].float().cpu())
        return out

    llm.engine.runner.execute = recording
    return logits
