"""Tensor parallelism for DeepSeek-V4 on CPU (2 gloo ranks, real worker processes started by the front end):
query heads, output groups, the experts' intermediate dimension and the vocabulary split over the ranks
reproduce one process — greedy tokens identical, each token's logprob within 1e-4 — through chunked
prefill and batched decode, on the bf16 checkpoint (fp32 compute) and on the published FP8/MXFP4 format
(weights and scales cut at the same block boundaries). Layouts that cannot split fail before any worker
starts, naming the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import psutil
import pytest

from openinfer import LLM
from tests.test_deepseek_v4 import V4_TOKENIZER_DIR, make_v4, prompts_of
from tests.test_parallel import assert_ranks_idle, assert_same_outputs, generate
from tests.test_quantization import TINY_PUBLISHED, write_published

# small batches: prompts longer than 16 tokens prefill in chunks, while other requests decode
OPTS = dict(device="cpu", dtype="float32", block_size=32, max_num_batched_tokens=16, max_num_seqs=8,
            num_kv_blocks=64)
LENGTHS = (5, 40, 57, 13, 24)
# the published tiny V4 whose TP=2 shards fall on whole 32 x 32 FP8 blocks and MXFP4 groups: the shared
# expert's and routed experts' intermediate slice per rank is 32 (TINY_PUBLISHED's 32 / 2 = 16 cuts them)
TP_PUBLISHED = {**TINY_PUBLISHED, "moe_intermediate_size": 64}


def workload(llm: LLM):
    return generate(llm, prompts_of(*LENGTHS, seed=5), max_tokens=10)


def compare(path: Path, **opts) -> None:
    ref_llm = LLM(str(path), **OPTS, **opts)
    try:
        ref = workload(ref_llm)
    finally:
        ref_llm.shutdown()
    llm = LLM(str(path), **OPTS, **opts, tensor_parallel_size=2)
    try:
        assert len(llm.engine._procs) == 2
        outs = workload(llm)
        assert_same_outputs(outs, ref)
        assert_ranks_idle(llm)
    finally:
        llm.shutdown()


def test_v4_tp2_equals_one_process_bf16_checkpoint(tmp_path):
    make_v4(tmp_path / "v4")
    compare(tmp_path / "v4")


def test_v4_tp2_equals_one_process_published_fp8_mxfp4(tmp_path):
    src = write_published(tmp_path / "published", TP_PUBLISHED)
    headers = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    assert "layers.0.attn.wo_b.scale" in headers and "layers.2.ffn.experts.0.w2.scale" in headers
    # weight-only (W8A16 / W4A16): every weight and scale shard is still used as stored, but no FP8 activation
    # rounding turns the last-bit difference of a K split summed over ranks into a whole FP8 step (which moved a
    # logprob by 1.4e-3 once the CPU GEMMs accumulated per block in K order, as DeepSeek's kernels do)
    compare(src, quantize_activations=False)


def config_dir(root: Path, name: str, config: dict) -> Path:
    """A model directory with only config.json and the tokenizer: the layout check reads nothing else."""
    d = root / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(V4_TOKENIZER_DIR / f, d / f)
    return d


def test_v4_layouts_that_do_not_split_fail_before_any_worker_starts(tmp_path):
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    cut = config_dir(tmp_path, "cut", TINY_PUBLISHED)     # 16 intermediate rows per rank, 32-row FP8 blocks
    with pytest.raises(ValueError, match=r"moe_intermediate_size \* n_shared_experts / tp .* is 16, not a "
                                         r"multiple of the FP8 block \(32\)"):
        LLM(str(cut), **OPTS, tensor_parallel_size=2)
    # FP8 blocks of 16 fit, MXFP4's 32-value scale groups along the experts' K (w2) do not
    mx = config_dir(tmp_path, "mx", {**TINY_PUBLISHED, "quantization_config": {
        **TINY_PUBLISHED["quantization_config"], "weight_block_size": [16, 16]}})
    with pytest.raises(ValueError, match=r"moe_intermediate_size / tp .* is 16, not a multiple of the MXFP4 "
                                         r"scale group \(32\)"):
        LLM(str(mx), **OPTS, tensor_parallel_size=2)
    plain = config_dir(tmp_path, "plain", {k: v for k, v in TINY_PUBLISHED.items()
                                           if k not in ("quantization_config", "expert_dtype")})
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 must divide o_groups \(2\)"):
        LLM(str(plain), **OPTS, tensor_parallel_size=4)
    with pytest.raises(ValueError, match="use data_parallel_size with enable_expert_parallel, or "
                                         "tensor_parallel_size without it"):
        LLM(str(plain), **OPTS, tensor_parallel_size=2, enable_expert_parallel=True)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children


def test_v4_tp_shards_of_our_own_stacked_layout():
    """A checkpoint in our parameter names (stacked experts [E, 2I, H]: w1 rows then w3 rows) loads into each
    TP rank as that rank's gate slice and up slice, down_proj columns, heads, groups and vocabulary rows."""
    import torch

    from openinfer.distributed.parallel_state import ParallelContext
    from openinfer.models.deepseek_v4.family import DEEPSEEK_V4_TINY_CONFIG
    from openinfer.models.deepseek_v4.loader import init_random as init_deepseek_v4_random, load_weights
    from openinfer.models.deepseek_v4.config import DeepseekV4Config
    from openinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM

    cfg = DeepseekV4Config.from_hf(DEEPSEEK_V4_TINY_CONFIG)
    full = DeepseekV4ForCausalLM(cfg)
    init_deepseek_v4_random(full, seed=0)
    state = {k: v for k, v in full.state_dict().items() if not k.endswith("inv_freq")}
    I, H = cfg.moe_intermediate_size // 2, cfg.num_attention_heads // 2
    for r in range(2):
        shard = DeepseekV4ForCausalLM(cfg, parallel=ParallelContext(tp_size=2, tp_rank=r))
        load_weights(shard, state.items())
        got = dict(shard.named_parameters())
        gu = state["layers.2.mlp.experts.gate_up_proj"]
        assert torch.equal(got["layers.2.mlp.experts.gate_up_proj"],
                           torch.cat((gu[:, r * I:(r + 1) * I], gu[:, cfg.moe_intermediate_size + r * I:
                                                                     cfg.moe_intermediate_size + (r + 1) * I]), 1))
        sg = state["layers.2.mlp.shared_experts.gate_up_proj.weight"]     # [gate | up], each cut the same way
        assert torch.equal(got["layers.2.mlp.shared_experts.gate_up_proj.weight"],
                           torch.cat((sg[r * I:(r + 1) * I], sg[cfg.moe_intermediate_size + r * I:
                                                                cfg.moe_intermediate_size + (r + 1) * I])))
        assert torch.equal(got["layers.2.mlp.experts.down_proj"],
                           state["layers.2.mlp.experts.down_proj"][:, :, r * I:(r + 1) * I])
        assert torch.equal(got["layers.1.self_attn.sinks"], state["layers.1.self_attn.sinks"][r * H:(r + 1) * H])
        rows = cfg.o_lora_rank * cfg.o_groups // 2
        assert torch.equal(got["layers.1.self_attn.o_a_proj.weight"],
                           state["layers.1.self_attn.o_a_proj.weight"][r * rows:(r + 1) * rows])
        assert torch.equal(got["layers.1.self_attn.o_b_proj.weight"],
                           state["layers.1.self_attn.o_b_proj.weight"][:, r * rows:(r + 1) * rows])
        v = cfg.vocab_size // 2
        assert torch.equal(got["embed_tokens.weight"], state["embed_tokens.weight"][r * v:(r + 1) * v])
        assert torch.equal(got["mtp.0.layer.self_attn.q_b_proj.weight"],
                           state["mtp.0.layer.self_attn.q_b_proj.weight"][r * H * cfg.head_dim:(r + 1) * H * cfg.head_dim])
        assert torch.equal(got["layers.1.self_attn.kv_proj.weight"], state["layers.1.self_attn.kv_proj.weight"])
    with pytest.raises(ValueError, match="dimension 0 should be tensor_parallel_size"):
        load_weights(shard, [("embed_tokens.weight", state["embed_tokens.weight"][:-2])])
