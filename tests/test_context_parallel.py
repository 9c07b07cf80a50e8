"""Context parallelism (distributed/context_parallel.py): the zigzag split covers every token once and balances
causal attention work (asserted from the assignment); a step's rows gathered from every rank come back in the
step's order; the ring exchange equals the all-gather; bad layouts fail before any worker starts; and through real
worker processes (gloo), CP prefill equals one process (logits within 1e-4, fp32) for a Llama (CP4, every prompt
row scored, and a prompt shorter than the CP size), DeepSeek-V4 (DP2 x CP2 + EP: world 4) and DeepSeek-V4.1 (CP2 +
EP), over prompts whose lengths do not divide evenly, chunked prefill and prefix hits — DeepSeek's windows,
compressor groups, indexer and Engram n-grams crossing the pieces' boundaries. One one-process engine and one CP
engine per model, a few short requests each."""

from __future__ import annotations

import multiprocessing as mp
import socket

import numpy as np
import psutil
import pytest
import torch

from openinfer import LLM
from openinfer.config import EngineConfig
from openinfer.distributed.context_parallel import (ContextParallelStep, attention_work, contiguous_pieces,
                                                    zigzag_pieces)
from openinfer.distributed.parallel_state import ParallelContext
from openinfer.models.llama.family import FAMILY as LLAMA
from openinfer.models.olmo2.family import FAMILY as OLMO
from openinfer.sampling_params import SamplingParams
from tests.conftest import write_tiny_llama
from tests.test_deepseek_v4 import prompts_of
from tests.test_parallel import V4_OPTS, assert_ranks_idle, assert_same_outputs, params


# ---- the assignment --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cp", [2, 4])
def test_zigzag_covers_every_token_once_and_balances_causal_work(cp):
    """Each rank a front and a back piece; every token of the chunk on exactly one rank; tokens per rank within two;
    the busiest rank's key visits within 2·(cached + n) of the mean (one token more in each of its two pieces),
    where the contiguous split's last rank does (2cp − 1)/cp of the mean."""
    for n in (3, 7, 13, 37, 101, 1000, 4099):
        for cached in (0, 9, 500):
            split = zigzag_pieces(n, cp)
            tokens = sorted(t for pieces in split for a, b in pieces for t in range(a, b))
            assert tokens == list(range(n))
            assert all(len(pieces) == 2 for pieces in split)
            sizes = [sum(b - a for a, b in pieces) for pieces in split]
            assert max(sizes) - min(sizes) <= 2
            work = [attention_work(pieces, cached) for pieces in split]
            assert sum(work) == attention_work([(0, n)], cached)
            assert max(work) - sum(work) / cp <= 2 * (cached + n)
            if n % (2 * cp) == 0:
                assert len(set(work)) == 1                       # equal pieces: exactly balanced
    n = 4096
    contiguous = [attention_work(p) for p in contiguous_pieces(n, cp)]
    balanced = [attention_work(p) for p in zigzag_pieces(n, cp)]
    assert max(contiguous) / np.mean(contiguous) == pytest.approx((2 * cp - 1) / cp, rel=1e-3)
    assert max(balanced) / np.mean(balanced) == 1.0


def test_a_steps_rows_gathered_from_every_rank_come_back_in_step_order():
    """Decode rows stay on every rank; each rank's prefill rows (its pieces of each chunk, padded to the widest
    rank) concatenated rank-major and reordered by `order` are the step's rows again; each local chunk piece
    names its rows."""
    cp, num_decode, chunks = 4, 3, [13, 2, 30]
    plans = [ContextParallelStep.plan(ParallelContext(cp_size=cp, cp_rank=r), num_decode, chunks, "cpu")
             for r in range(cp)]
    step = np.arange(num_decode + sum(chunks))
    padded = []
    for plan in plans:
        rows = plan.local_rows
        assert list(rows[:num_decode]) == list(range(num_decode))
        mine = rows[num_decode:]
        padded.append(np.concatenate([mine, np.full(plan.max_prefill_rows - len(mine), -1)]))
        starts = np.cumsum([num_decode, *chunks])
        for c, pieces in enumerate(plan.pieces):
            for qs, a, b in pieces:
                assert list(rows[qs:qs + b - a]) == list(range(starts[c] + a, starts[c] + b))
    gathered = np.concatenate(padded)[plans[0].order.numpy()]
    assert list(gathered) == list(step[num_decode:])
    assert all(list(p.order) == list(plans[0].order) for p in plans)


def _ring_worker(rank: int, port: int, queue) -> None:
    import torch.distributed as dist

    from openinfer.distributed.context_parallel import cp_all_gather, ring_all_gather

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        group = dist.new_group([0, 1])
        ctx = ParallelContext(world_size=2, rank=rank, cp_size=2, cp_rank=rank, cp_group=group)
        x = torch.arange(12, dtype=torch.float32).view(3, 4) + 100 * rank
        queue.put((rank, torch.equal(ring_all_gather(x, ctx), cp_all_gather(x, ctx))))
        dist.destroy_process_group()
    except BaseException as e:
        queue.put((rank, repr(e)))


def test_ring_exchange_equals_the_all_gather():
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_ring_worker, args=(r, port, queue), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert got == {0: True, 1: True}


# ---- layouts refused before any worker starts -------------------------------------------------------------------
def test_bad_layouts_fail_by_name_before_any_worker_starts():
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match="context_parallel_size must be an integer >= 1"):
        EngineConfig(device="cpu", context_parallel_size=0)
    with pytest.raises(ValueError, match="does not combine with tensor_parallel_size"):
        LLM("deepseek-v4-tiny", device="cpu", context_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="v41_prefill_mode='exact' only"):
        LLM("deepseek-v41-tiny", device="cpu", context_parallel_size=2, v41_prefill_mode="yoco")
    # what the front end checks before it starts a worker (models/registry.py: check_layout)
    cp2 = EngineConfig(device="cpu", context_parallel_size=2)
    hf = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=64)
    with pytest.raises(ValueError, match="OLMo-2 models do not run context parallelism"):
        OLMO.check_layout(OLMO.parse_config({**hf, "model_type": "olmo2"}), {**hf, "model_type": "olmo2"}, cp2)
    mistral = {**hf, "model_type": "mistral", "sliding_window": 8}
    with pytest.raises(ValueError, match="sliding-window layers .* not wired for context parallelism"):
        LLAMA.check_layout(LLAMA.parse_config(mistral), mistral, cp2)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children


# ---- CP equals one process --------------------------------------------------------------------------------------
LLAMA_OPTS = dict(device="cpu", block_size=4, max_num_batched_tokens=32, max_num_seqs=4)


def _llama_workload(llm: LLM):
    """Three uneven prompts together, every prompt row scored (prompt logprobs: each row's hidden state, whichever
    rank computed it), one cut into chunks; then two sharing a 23-token prefix (the second hits 20 cached); then a
    prompt shorter than the CP size."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 49000, (n,), generator=g).tolist() for n in (13, 45, 7)]
    scored = SamplingParams(max_tokens=5, logprobs=0, prompt_logprobs=0, temperature=0, ignore_eos=True)
    base = torch.randint(2, 49000, (23,), generator=g).tolist()
    batch = llm.generate(prompt_token_ids=prompts, sampling_params=scored, use_tqdm=False)
    first = llm.generate(prompt_token_ids=[base + [5, 6, 7]], sampling_params=params(5), use_tqdm=False)
    second = llm.generate(prompt_token_ids=[base + [9, 10, 11, 12, 13]], sampling_params=params(5), use_tqdm=False)
    # alone, 3 tokens over 4 ranks: a rank without a row in the step still joins its exchanges
    short = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=params(3), use_tqdm=False)
    return batch + first + second + short


def _compare(outs, refs, cached_last: int, cached_at: int = -1) -> None:
    assert_same_outputs(outs, refs)
    for o, r in zip(outs, refs):
        if r.prompt_logprobs is not None:
            for a, b, t in zip(o.prompt_logprobs[1:], r.prompt_logprobs[1:], r.prompt_token_ids[1:]):
                assert abs(a[t].logprob - b[t].logprob) < 1e-4
    assert outs[cached_at].num_cached_tokens == refs[cached_at].num_cached_tokens == cached_last


@pytest.fixture(scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # as each worker runs (2 cores): more threads than cores crawl on a busy host
    yield
    torch.set_num_threads(threads)


def test_llama_cp4_equals_one_process_with_uneven_prompts_chunks_and_a_prefix_hit(tmp_path, smollm_dir, one_thread):
    path = str(write_tiny_llama(tmp_path / "llama", smollm_dir))
    one = LLM(path, **LLAMA_OPTS)
    ref = _llama_workload(one)
    one.shutdown()
    llm = LLM(path, **LLAMA_OPTS, context_parallel_size=4)
    try:
        _compare(_llama_workload(llm), ref, cached_last=20, cached_at=-2)
        assert_ranks_idle(llm)
    finally:
        llm.shutdown()


def _ds_workload(llm: LLM, lengths=(53, 9)):
    """Uneven prompts together (one in chunks), then two sharing a 70-token prefix, 73 and 75 tokens (the first in
    chunks of 48 and 25, the second hits 64 and computes 11)."""
    base = prompts_of(70, seed=11)[0]
    batch = llm.generate(prompt_token_ids=prompts_of(*lengths, seed=3), sampling_params=params(3),
                         use_tqdm=False) if lengths else []
    return batch + [llm.generate(prompt_token_ids=[base + tail], sampling_params=params(3), use_tqdm=False)[0]
                    for tail in ([5, 6, 7], [9, 10, 11, 12, 13])]


def test_deepseek_v4_dp2_cp2_ep_equals_one_process(one_thread):
    """World 4: two DP groups of two CP ranks, experts over all four; prefix hits and chunks."""
    opts = dict(V4_OPTS, max_num_batched_tokens=48)
    one = LLM("deepseek-v4-tiny", **opts)
    ref = _ds_workload(one)
    one.shutdown()
    llm = LLM("deepseek-v4-tiny", **opts, data_parallel_size=2, context_parallel_size=2, enable_expert_parallel=True)
    try:
        _compare(_ds_workload(llm), ref, cached_last=64)
        assert_ranks_idle(llm)
    finally:
        llm.shutdown()


def test_deepseek_v41_cp2_ep_equals_one_process(one_thread):
    """Windows, compressor groups, the indexer and Engram's n-grams crossing the pieces' boundaries; image prompts
    (docs/vision.md: every CP rank encodes the step's images, each places its own rows' embeddings, Engram's n-grams
    see the whole step's image rows), a span cut by a chunk boundary, and a prefix hit on a cached image."""
    from tests.test_vision_multiproc import image_workload

    opts = dict(device="cpu", kv_cache_dtype="float32", quantize_activations=False, block_size=32,
                max_num_batched_tokens=48, max_num_seqs=4, num_kv_blocks=48)
    one = LLM("deepseek-v41-tiny", **opts)
    ref = _ds_workload(one, ())
    ref_images = image_workload(one.engine)
    one.shutdown()
    llm = LLM("deepseek-v41-tiny", **opts, context_parallel_size=2, enable_expert_parallel=True)
    try:
        _compare(_ds_workload(llm, ()), ref, cached_last=64)
        outs = image_workload(llm.engine)
        assert_same_outputs(outs, ref_images)
        assert [o.num_cached_tokens for o in outs] == [r.num_cached_tokens for r in ref_images] == [0, 0, 32, 0]
        assert [s["images_encoded"] for s in llm.engine.stats()["per_rank"]] == [4, 4]
        assert_ranks_idle(llm)
    finally:
        llm.shutdown()
