"""DeepSeek-V4.1 with attention DP + expert parallelism (2 gloo ranks, real worker processes), as DeepSeek-V4 runs
it (tests/test_parallel.py): each rank loads only its expert slots (published MXFP4 and bf16 checkpoints alike);
greedy tokens and logprobs equal one process through chunked prefill and prefix hits; EPLB moves experts between
the ranks without changing outputs; layouts V4.1 cannot run fail before any worker starts. Forwards of the tiny
V4.1 are slow on CPU and engine start-ups cost two worker processes: one one-process engine and one DP2+EP2 engine
in all, a few short requests."""

from __future__ import annotations

import shutil
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file

from openinfer import LLM
from openinfer.config import EngineConfig, default_cache_dir
from openinfer.distributed.expert_parallel import initial_layout
from openinfer.distributed.parallel_state import ParallelContext
from openinfer.models.registry import generated_model_dir, load_model
from tests.test_parallel import EP2, assert_ranks_idle, assert_same_outputs, params
from tests.test_deepseek_v4 import prompts_of

NAME = "deepseek-v41-tiny"
# unquantized caches and activations (the ranks' batches differ from one process's: no FP8/FP4 rounding step may
# turn a last-bit difference into a visible one, as in V4.1's plain DP test); 32-token blocks (prefix hits on
# short prompts), 32-token chunks (chunked prefill)
OPTS = dict(device="cpu", kv_cache_dtype="float32", quantize_activations=False, block_size=32,
            max_num_batched_tokens=32, max_num_seqs=4, num_kv_blocks=48)
SKEWED_LAYERS = (0, 1, 2)        # their routers send every token to HOT_EXPERTS; layers 3..5 route as trained
HOT_EXPERTS = (2, 3, 4)          # all on EP rank 0 in the initial placement (rank 0 holds slots 0..4 of 10)


def tiny_dir() -> Path:
    return generated_model_dir(NAME, default_cache_dir())


def make_skewed_v41(path: Path) -> Path:
    """deepseek-v41-tiny whose first layers' router bias favours HOT_EXPERTS by far (their tokens all go to EP
    rank 0's slots until EPLB spreads them)."""
    shutil.copytree(tiny_dir(), path)
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    for i in SKEWED_LAYERS:
        bias = tensors[f"layers.{i}.ffn.gate.bias"]
        bias.zero_()
        bias[list(HOT_EXPERTS)] = 10.0
    save_file(tensors, str(f))
    return path


def generate(llm: LLM, prompts, max_tokens: int = 4):
    return llm.generate(prompt_token_ids=prompts, sampling_params=params(max_tokens), use_tqdm=False)


def workload(llm: LLM):
    """Three prompts together (one in three 32-token chunks), then two sharing a 66-token prefix one after the
    other (the second hits the first's two cached blocks)."""
    base = prompts_of(66, seed=11)[0]
    batch = generate(llm, prompts_of(9, 75, 30, seed=3))
    return batch + generate(llm, [base + [5, 6]]) + generate(llm, [base + [9, 10, 11]])


# ---- loading: this rank's slots only ---------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["bf16"])      # the published format: the engine test below
def test_each_rank_loads_only_its_expert_slots(fmt, tmp_path):
    """With EP2 and one redundant expert (10 slots, 5 per rank), rank r's backbone stacks hold exactly the one-process
    model's experts of its slots (MXFP4 bytes + scales, or bf16); the DSpark stage keeps all its experts."""
    src = tiny_dir()
    if fmt == "bf16":
        from tests.test_deepseek_v41 import save_dequantized

        src = save_dequantized(src, tmp_path / "bf16")
    config = EngineConfig(device="cpu", dtype="bfloat16")

    def build(ctx):
        return load_model(src, config, parallel=ctx)

    one = build(ParallelContext.single())
    n_layers, n_experts = one.config.n_layers, one.config.n_routed_experts
    for rank in range(2):
        ctx = ParallelContext(world_size=2, rank=rank, dp_size=2, dp_rank=rank, ep_size=2, ep_rank=rank,
                              num_redundant_experts=1)
        placement, _ = initial_layout(n_layers, n_experts, ctx)
        mine = placement.local_logical(rank)[0]
        assert len(mine) == 5
        model = build(ctx)
        ours, full = dict(model.named_parameters()), dict(one.named_parameters())
        for name, p in ours.items():
            if name.startswith("layers.") and ".ffn.experts." in name:
                assert torch.equal(p.view(torch.uint8), full[name][mine].view(torch.uint8)), name
            else:
                assert torch.equal(p.view(torch.uint8), full[name].view(torch.uint8)), name


# ---- DP2 + EP2 (+ EPLB) equals one process ----------------------------------------------------------------------
def test_dp_ep_equals_one_process_before_and_after_eplb_moves_experts(tmp_path):
    """The published-format tiny model (skewed in its first layers) on DP2 + EP2 with one redundant expert: greedy
    tokens and logprobs equal one process through chunked prefill and a prefix hit, both DP ranks serving; EPLB
    (run at once on every rank) then moves experts to the same placement everywhere, lowering moe_lb, and the same
    requests still give the same outputs. (Replaces V4.1's plain-DP test: attention DP is this test's too.)"""
    path = make_skewed_v41(tmp_path / "skewed")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # as each worker runs (2 cores): more threads than cores crawl on a busy host
    try:
        one = LLM(str(path), **OPTS)
        ref = workload(one)
        one.shutdown()
    finally:
        torch.set_num_threads(threads)
    llm = LLM(str(path), **OPTS, **EP2, enable_eplb=True, num_redundant_experts=1,
              eplb_rebalance_interval_steps=10**6)      # EPLB runs when the test says
    try:
        outs = workload(llm)
        assert_same_outputs(outs, ref)
        assert outs[-1].num_cached_tokens >= 64                  # the shared prefix's two blocks were reused
        assert all(s["prefix_cache_queried_tokens"] > 0 for s in llm.engine.stats()["per_rank"])  # both DP ranks
        moves = llm.engine.call_ranks("rebalance_experts")
        assert len(set(moves)) == 1, moves                        # every rank the same placement
        before, after, moved = moves[0]
        assert moved and after < before - 0.2, moves              # the skewed layers' hot experts spread out
        assert_same_outputs(workload(llm), ref)
        assert llm.engine.stats()["eplb_rebalances"] == 1
        assert_ranks_idle(llm)
    finally:
        llm.shutdown()


# ---- layouts V4.1 cannot run -------------------------------------------------------------------------------------
def test_bad_v41_layouts_fail_before_any_worker_starts():
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match="tensor_parallel_size > 1 is not wired"):
        LLM(NAME, device="cpu", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size > 1 is not wired"):
        LLM(NAME, device="cpu", tensor_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="ep_size 16 > 8 logical experts"):        # 8 routed experts
        LLM(NAME, device="cpu", data_parallel_size=16, enable_expert_parallel=True)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children
