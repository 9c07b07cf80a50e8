"""GPU tests (`pytest -m gpu`, on the device): kernels against the torch reference, CUDA-graph replay against
eager, and SmolLM2 CUDA bf16 against CPU fp32."""

from __future__ import annotations

import gc
import os
import random
import time

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from openinfer import LLM, SamplingParams  # noqa: E402
from openinfer.layers.attention import AttentionMetadata, TorchPagedAttention  # noqa: E402
from openinfer.layers.triton_attention import paged_decode_attention  # noqa: E402
from tests.conftest import record_drafter_extends, record_step_logits  # noqa: E402


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("splits", [None, 1, 4, 16])
@pytest.mark.parametrize("heads, kv_heads, head_dim, page", [(32, 8, 128, 128), (9, 3, 64, 128), (8, 8, 64, 16),
                                                             (64, 4, 128, 64)])
def test_paged_decode_kernel_matches_reference(heads, kv_heads, head_dim, page, splits):
    g = torch.Generator(device="cuda").manual_seed(random.randrange(1 << 30))   # fresh inputs each run
    lens = [1, 7, page, page + 1, 1000, 2 * page - 1]
    num_blocks = sum(-(-n // page) for n in lens) + 5
    cache = torch.randn(num_blocks, page, 2, kv_heads, head_dim, generator=g, device="cuda", dtype=torch.bfloat16)
    order = torch.randperm(num_blocks, generator=g, device="cuda")        # pages scattered over the pool
    width = max(-(-n // page) for n in lens)
    tables = torch.zeros(len(lens), width, dtype=torch.long, device="cuda")
    used = 0
    for i, n in enumerate(lens):
        k = -(-n // page)
        tables[i, :k] = order[used:used + k]
        used += k
    q = torch.randn(len(lens), heads, head_dim, generator=g, device="cuda", dtype=torch.bfloat16)
    ctx = torch.tensor(lens, device="cuda")
    out = torch.full_like(q, float("nan"))                                  # poisoned: every element must be written
    scale = head_dim ** -0.5
    paged_decode_attention(q, cache, tables, ctx, scale, out, num_splits=splits)
    meta = AttentionMetadata(block_size=page, slot_mapping=torch.empty(0, dtype=torch.long, device="cuda"),
                             num_decode_tokens=len(lens), decode_block_tables=tables, decode_context_lens=ctx,
                             max_decode_context_len=max(lens))
    ref = torch.empty(q.shape, dtype=torch.float32, device="cuda")
    TorchPagedAttention().decode_into(q.float(), cache.float(), meta, scale, ref)
    assert not out.isnan().any()
    assert _rel(out, ref) < 1e-2


def _smollm_dir():
    from openinfer.config import default_cache_dir
    from openinfer.loader.model_source import resolve_model_dir

    return str(resolve_model_dir("smollm2-135m-instruct", default_cache_dir()))


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,",
           "1, 2, 3, 4,", "The three primary colors are", "Q: What is the boiling point of water?\nA:",
           "import numpy as np\n\n# mean of a list\ndef mean(xs):\n    return", "Hi"]


@pytest.fixture(scope="module")
def smollm_dir():
    return _smollm_dir()


def test_cuda_graph_replay_equals_eager(smollm_dir):
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    graphs = LLM(smollm_dir, device="cuda", dtype="bfloat16", max_num_seqs=16, gpu_memory_utilization=0.3)
    assert graphs.engine.runner.decode_graphs.graphs
    a = [o.outputs[0].token_ids for o in graphs.generate(PROMPTS, sp, use_tqdm=False)]
    del graphs
    eager = LLM(smollm_dir, device="cuda", dtype="bfloat16", max_num_seqs=16, enforce_eager=True,
                gpu_memory_utilization=0.3)
    assert eager.engine.runner.decode_graphs is None
    b = [o.outputs[0].token_ids for o in eager.generate(PROMPTS, sp, use_tqdm=False)]
    assert a == b


def test_triton_attention_kernels_match_reference_every_case():
    """Every case of tests/paged_attention_cases.py (bf16 and fp32, FP8 caches, windows, prefix hits, GQA,
    pages of 4/16/128) on the real kernels, including the FP8 cache writes bit for bit."""
    from paged_attention_cases import check_all

    failures = check_all("cuda")
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("cached, new", [(8064, 64), (7680, 512), (0, 2048), (16000, 300)])
@pytest.mark.parametrize("fp8", [False, True])
def test_paged_prefill_kernel_llama_shape(cached, new, fp8):
    """Llama-3-8B's attention shape (32 heads, 8 KV heads, head_dim 128, pages of 128) over long cached
    prefixes, against the reference (bf16: relative error of a bf16 SDPA)."""
    from paged_attention_cases import random_step, run_case
    from openinfer.layers.triton_attention import TritonPagedAttention

    step = random_step(random.Random(cached + new), device="cuda", dtype=torch.bfloat16, heads=32, kv_heads=8,
                       head_dim=128, page=128, num_decodes=4, prefill=[(cached, new), (0, 100)], fp8=fp8)
    out, ref, *_ = run_case(TritonPagedAttention(), step, None, scale=128 ** -0.5)
    assert _rel(out, ref) < 1e-2


def test_triton_backend_equals_torch_backend_fp32(smollm_dir):
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(smollm_dir, device="cuda", dtype="float32", attention_backend=backend, enforce_eager=True,
                  gpu_memory_utilization=0.3)
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
        del llm
    agree = sum(a == b for a, b in zip(outs["torch"], outs["triton"]))
    assert agree >= len(PROMPTS) - 1, outs      # tf32 in the kernel's dots may flip one near-tie


def test_smollm2_cuda_bf16_agrees_with_cpu_fp32(smollm_dir):
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    gpu = LLM(smollm_dir, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3)
    g = [o.outputs[0].token_ids for o in gpu.generate(PROMPTS, sp, use_tqdm=False)]
    del gpu
    cpu = LLM(smollm_dir, device="cpu", dtype="float32")
    c = [o.outputs[0].token_ids for o in cpu.generate(PROMPTS, sp, use_tqdm=False)]
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(g, c)]
    report = f"bf16-vs-fp32 common greedy prefix per prompt: {prefix} (of {sp.max_tokens})"
    print(report)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bf16_vs_fp32_agreement.txt"), "w") as f:
            f.write(report + "\n")
    assert sum(p >= 4 for p in prefix) >= len(PROMPTS) - 2, report
    assert sum(prefix) >= len(PROMPTS) * sp.max_tokens // 2, report


def _fresh(*shape, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(random.randrange(1 << 30))
    return torch.randn(*shape, generator=g, device="cuda", dtype=dtype)


@pytest.mark.parametrize("rows, dim", [(1, 4096), (37, 576), (300, 4096)])
def test_fused_norms_match_reference(rows, dim):
    from openinfer.layers import triton_ops
    from openinfer.layers.basic import torch_add_rms_norm, torch_rms_norm

    x, res, w = _fresh(rows, dim), _fresh(rows, dim), _fresh(dim)
    assert _rel(triton_ops.rms_norm(x, w, 1e-5), torch_rms_norm(x, w, 1e-5)) < 1e-2
    ref_out, ref_res = torch_add_rms_norm(x, res, w, 1e-5)
    out, new_res = triton_ops.add_rms_norm(x, res.clone(), w, 1e-5)
    assert _rel(out, ref_out) < 1e-2 and torch.equal(new_res, ref_res)


@pytest.mark.parametrize("rows, inter", [(1, 14336), (19, 1536)])
def test_fused_silu_mul_matches_reference(rows, inter):
    from openinfer.layers import triton_ops
    from openinfer.layers.basic import torch_silu_mul

    x = _fresh(rows, 2 * inter)
    assert _rel(triton_ops.silu_mul(x), torch_silu_mul(x)) < 1e-2


def test_fused_rotary_and_kv_write_match_reference():
    from openinfer.layers import triton_ops
    from openinfer.layers.attention import write_kv
    from openinfer.layers.basic import RotaryEmbedding, torch_rotary

    T, H, KVH, D = 45, 32, 8, 128
    rope = RotaryEmbedding(D, 8192, 500000.0, None)
    rope.reset_tables(torch.device("cuda"))
    qkv = _fresh(T, (H + 2 * KVH) * D)
    q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
    q, k, v = q.view(T, H, D), k.view(T, KVH, D), v.view(T, KVH, D)
    pos = torch.randint(0, 8000, (T,), device="cuda")
    ref_q, ref_k = torch_rotary(pos, rope.cos, rope.sin, q, k)
    triton_ops.rotary(pos, rope.cos, rope.sin, q, k)              # in place on the qkv views
    assert _rel(q, ref_q) < 1e-2 and _rel(k, ref_k) < 1e-2
    cache_a = torch.full((8, 16, 2, KVH, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    cache_b = cache_a.clone()
    slots = torch.randperm(8 * 16, device="cuda")[:T]
    write_kv(cache_a, slots, k, v)
    triton_ops.write_kv(cache_b, slots, k, v)
    assert torch.equal(cache_a.nan_to_num(0), cache_b.nan_to_num(0))
    assert cache_b.view(-1, 2, KVH, D)[slots].isnan().sum() == 0


def test_rotate_and_write_in_one_launch_follows_the_three_launches():
    """`rotary_write_kv` (the Triton backend's fused RoPE + KV write) against `rotary` then `write_kv` on the
    Llama-3-8B shape in bf16: q and k rotated in place to within one bf16 step of the separate kernel's (the
    compiler contracts the fp32 products differently: not bit-equal, measured on the H200), the cache rows exactly
    the rotated k and v, and nothing else written."""
    from openinfer.layers import triton_ops
    from openinfer.layers.basic import RotaryEmbedding

    T, H, KVH, D = 45, 32, 8, 128
    rope = RotaryEmbedding(D, 8192, 500000.0, None)
    rope.reset_tables(torch.device("cuda"))
    pos = torch.randint(0, 8000, (T,), device="cuda")
    slots = torch.randperm(8 * 16, device="cuda")[:T]
    results = []
    for fused in (True, False):
        random.seed(3)                      # _fresh draws its generator's seed from `random`
        qkv = _fresh(T, (H + 2 * KVH) * D)
        q, k, v = (x.view(T, -1, D) for x in qkv.split([H * D, KVH * D, KVH * D], dim=-1))
        cache = torch.full((8, 16, 2, KVH, D), float("nan"), device="cuda", dtype=torch.bfloat16)
        if fused:
            triton_ops.rotary_write_kv(cache, slots, pos, rope.cos, rope.sin, q, k, v)
        else:
            triton_ops.rotary(pos, rope.cos, rope.sin, q, k)
            triton_ops.write_kv(cache, slots, k, v)
        results.append((qkv, cache, k, v))
    (qkv_a, cache_a, k_a, v_a), (qkv_b, _, _, _) = results
    torch.testing.assert_close(qkv_a.float(), qkv_b.float(), rtol=2.0**-7, atol=0)
    assert torch.equal(cache_a.view(-1, 2, KVH, D)[slots], torch.stack([k_a, v_a], 1))
    assert cache_a.isnan().sum() == (8 * 16 - T) * 2 * KVH * D


@pytest.fixture(scope="module")
def tiny_dummy_dir(tmp_path_factory):
    """A small Llama shape with random weights and a word-level tokenizer (no downloads, no checkpoint)."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    d = tmp_path_factory.mktemp("tiny-dummy")
    vocab = {f"w{i}": i for i in range(2000)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w1"}))
    (d / "config.json").write_text(json.dumps(dict(
        model_type="llama", vocab_size=2000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048, eos_token_id=1)))
    return str(d)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_triton_prefill_over_prefix_hits_follows_torch_backend(tiny_dummy_dir, kv_cache_dtype):
    """The whole engine, fp32: prompts sharing long prefixes (prefix-cache hits), chunked prefill (chunks of
    at most 96 tokens next to decodes), pages of 16 -- the Triton backend (paged prefill kernel, graphs)
    gives the torch backend's tokens and logprobs, with the bf16/fp32 cache and with the FP8 cache."""
    rng = random.Random(5)
    shared = [f"w{rng.randrange(2, 2000)}" for _ in range(300)]
    prompts = [" ".join(shared[:rng.randrange(40, 300)] + [f"w{rng.randrange(2, 2000)}" for _ in range(n)])
               for n in (1, 7, 30, 64, 130, 5, 90, 17)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(tiny_dummy_dir, device="cuda", dtype="float32", load_format="dummy", attention_backend=backend,
                  block_size=16, max_num_batched_tokens=96, max_num_seqs=4, kv_cache_dtype=kv_cache_dtype,
                  gpu_memory_utilization=0.2)
        outs[backend] = []
        for _ in range(2):      # the second round hits the prefix cache everywhere
            for o in llm.generate(prompts, sp, use_tqdm=False):
                c = o.outputs[0]
                outs[backend].append((c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]))
        llm.shutdown()
        del llm
    for (ta, la), (tb, lb) in zip(outs["torch"], outs["triton"]):
        assert ta == tb
        assert max(abs(x - y) for x, y in zip(la, lb)) < 1e-3


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_sliding_windows_on_triton_follow_torch_backend(tmp_path, arch):
    """Sliding-window layers (window 8: Gemma-3's five of six layers, Mistral's every layer, whose full group
    then holds no bytes) through the Triton kernels and CUDA graphs: chunked prefill across the window, prefix
    hits and decode give the torch backend's tokens and logprobs (fp32)."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=500, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, sliding_window=8, max_position_embeddings=1024)
    if arch == "gemma3":
        model = Gemma3ForCausalLM(Gemma3TextConfig(**shape, query_pre_attn_scalar=24, final_logit_softcapping=30.0))
    else:
        model = MistralForCausalLM(MistralConfig(**shape))
    model.eval()
    with torch.no_grad():   # larger-than-init weights so that differences would show
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(tmp_path)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(500)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w1"}))
    rng = random.Random(2)
    shared = [f"w{rng.randrange(2, 500)}" for _ in range(120)]
    prompts = [" ".join(shared[:rng.randrange(20, 120)] + [f"w{rng.randrange(2, 500)}" for _ in range(n)])
               for n in (1, 9, 33, 70)]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(tmp_path), device="cuda", dtype="float32", attention_backend=backend, block_size=16,
                  max_num_batched_tokens=48, max_num_seqs=3, gpu_memory_utilization=0.2)
        outs[backend] = [(c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
                         for _ in range(2) for c in (o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False))]
        llm.shutdown()
        del llm
    for (ta, la), (tb, lb) in zip(outs["torch"], outs["triton"]):
        assert ta == tb
        assert max(abs(x - y) for x, y in zip(la, lb)) < 1e-3


def test_async_scheduling_equals_sync_on_gpu(tiny_dummy_dir):
    """fp32, so that the different batch compositions of the two modes (async admits new requests one step
    later, and runs one extra step for requests stopped by EOS) cannot flip greedy near-ties the way bf16
    GEMMs of other shapes do; the CPU suite checks exact equality of the logic in fp32 too."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 2000, (int(n),), generator=g).tolist() for n in torch.randint(5, 300, (24,), generator=g)]
    params = [SamplingParams(temperature=0 if i % 3 else 0.9, seed=i, max_tokens=int(m), ignore_eos=i % 2 == 0)
              for i, m in enumerate(torch.randint(1, 60, (24,), generator=g))]
    results = {}
    for mode in (True, False):
        llm = LLM(tiny_dummy_dir, device="cuda", dtype="float32", load_format="dummy", async_scheduling=mode,
                  max_num_seqs=16, max_num_batched_tokens=512, block_size=16, gpu_memory_utilization=0.2)
        assert llm.config.use_async_scheduling == mode
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        results[mode] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
        kv = llm.engine.kv_manager
        assert not llm.engine.has_unfinished_requests() and kv.num_free_blocks == kv.num_blocks
        del llm, kv
        gc.collect()
        torch.cuda.empty_cache()
    assert results[True] == results[False]


# ---- DeepSeek-V4 ------------------------------------------------------------------------------------------
def test_v4_grouped_expert_gemm_matches_the_expert_loop():
    from openinfer.models.deepseek_v4.family import DEEPSEEK_V4_TINY_CONFIG
    from openinfer.models.deepseek_v4.config import DeepseekV4Config
    from openinfer.models.deepseek_v4.model import Experts

    cfg = DeepseekV4Config.from_hf({**DEEPSEEK_V4_TINY_CONFIG, "hidden_size": 256, "moe_intermediate_size": 128,
                                    "n_routed_experts": 64, "num_experts_per_tok": 6})
    g = torch.Generator(device="cuda").manual_seed(random.randrange(1 << 30))
    experts = Experts(cfg).cuda().to(torch.bfloat16)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.05, generator=g)
        experts.down_proj.normal_(0, 0.05, generator=g)
    for T in (1, 7, 300):
        x = torch.randn(T, 256, generator=g, device="cuda", dtype=torch.bfloat16)
        idx = torch.rand(T, 64, generator=g, device="cuda").argsort(-1)[:, :6]
        w = torch.rand(T, 6, generator=g, device="cuda")
        with torch.no_grad():
            fast = experts._grouped(x, idx, w)
            ref = experts.float()(x.float(), idx, w)     # fp32 takes the loop
            experts.to(torch.bfloat16)
        assert _rel(fast, ref) < 2e-2


def _prompt_logits(llm, prompt):
    rows = []
    model = llm.engine.runner.model
    hook = model.register_forward_hook(lambda m, i, o: rows.append(o.detach()))
    llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=1), use_tqdm=False)
    hook.remove()
    with torch.no_grad():   # the prompt may run in several chunks (it stops at a block boundary)
        return model.compute_logits(torch.cat(rows)[:len(prompt)]).float().cpu()


def test_v4_tiny_cuda_bf16_follows_cpu_fp32():
    """deepseek-v4-tiny (all layer kinds, both MoE kinds, mHC) on CUDA bf16 vs CPU fp32, the reference path:
    prompt logits at every position within bf16 tolerance, i.e. no further from fp32 than our CPU bf16
    forward is (the CUDA kernels add no error of their own; the CPU suite holds CPU bf16 to transformers'
    own bf16 error); greedy agreement reported."""
    prompt = [(i * 7919) % 120000 + 100 for i in range(150)]     # 37 CSA and 9 HCA entries
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    cpu = LLM("deepseek-v4-tiny", device="cpu", dtype="float32")
    ref = _prompt_logits(cpu, prompt)
    ref_tokens = cpu.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
    del cpu
    cpu_bf16 = _prompt_logits(LLM("deepseek-v4-tiny", device="cpu", dtype="bfloat16"), prompt)
    gc.collect()
    gpu = LLM("deepseek-v4-tiny", device="cuda", dtype="bfloat16")
    got = _prompt_logits(gpu, prompt)
    tokens = gpu.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
    rel, baseline = _rel(got, ref), _rel(cpu_bf16, ref)
    a, b = tokens.outputs[0].token_ids, ref_tokens.outputs[0].token_ids
    agree = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
    print(f"v4 tiny: CUDA bf16 vs CPU fp32 relative logit error {rel:.4f} (CPU bf16 vs fp32 {baseline:.4f}, "
          f"CUDA bf16 vs CPU bf16 {_rel(got, cpu_bf16):.4f}); greedy agreeing prefix {agree}/16")
    assert not got.isnan().any()
    assert rel < 1.5 * baseline


@pytest.mark.parametrize("n, T", [(4, 1), (4, 37), (2, 300)])
def test_hc_weights_kernel_matches_reference(n, T):
    from openinfer.layers.basic import torch_hc_weights
    from openinfer.layers.triton_ops import hc_weights

    g = torch.Generator(device="cuda").manual_seed(random.randrange(1 << 30))
    mixes = torch.randn(T, (2 + n) * n, generator=g, device="cuda") * 3
    base = torch.randn((2 + n) * n, generator=g, device="cuda")
    scale = torch.rand(3, generator=g, device="cuda") + 0.5
    got = hc_weights(mixes, base, scale, n, 20, 1e-6)
    ref = torch_hc_weights(mixes, base, scale, n, 20, 1e-6)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("staggered", [False, True])
def test_v4_cuda_graph_decode_equals_eager(staggered):
    """deepseek-v4-tiny bf16: decode steps replayed from CUDA graphs (captured per batch and context bucket,
    padded rows on the scratch page and scratch state slot) give the eager step's logits, over contexts that
    cross several buckets; tokens agree until the first bf16 near-tie. `staggered`: requests finish one by
    one, so the batch shrinks inside a bucket (rows that held a request must become padding rows, or they
    write into the remaining requests' state)."""
    lengths = (20, 130, 300, 60, 9, 210, 150) if staggered else (20, 130, 300)
    prompts = [[(i * 7919 + k) % 120000 + 100 for i in range(n)] for k, n in enumerate(lengths)]
    sp = ([SamplingParams(temperature=0, max_tokens=40 - 5 * k, ignore_eos=True) for k in range(len(prompts))]
          if staggered else SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    runs = {}
    for eager in (False, True):
        llm = LLM("deepseek-v4-tiny", device="cuda", dtype="bfloat16", enforce_eager=eager, max_num_seqs=8,
                  gpu_memory_utilization=0.3)
        logits = record_step_logits(llm)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
        assert (llm.engine.runner.decode_graphs is not None and bool(llm.engine.runner.decode_graphs.graphs)) != eager
        runs[eager] = ([o.outputs[0].token_ids for o in outs], [logits[o.request_id] for o in outs])
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    (tok_g, lg_g), (tok_e, lg_e) = runs[False], runs[True]
    for tg, te, a, b in zip(tok_g, tok_e, lg_g, lg_e):
        same = next((i for i, (x, y) in enumerate(zip(tg, te)) if x != y), len(te))
        for step in range(min(same + 1, len(a))):       # identical inputs up to the first divergence
            assert _rel(a[step], b[step]) < 2e-2, step


@pytest.mark.parametrize("model", ["deepseek-v4-tiny", "deepseek-v41-tiny", "smollm2-135m-instruct"])
def test_traffic_after_start_up_compiles_and_captures_nothing(model):
    """After start-up (decode graphs of every batch x context bucket captured, LLMEngine.warm_up run) online-like
    traffic — waves of requests with prompts of 3-900 tokens and outputs of 2-60, so steps mix prefill chunks and
    decodes at many batch sizes and contexts — triggers no Triton JIT compile and no CUDA graph capture."""
    name = _smollm_dir() if model.startswith("smollm") else model
    llm = LLM(name, device="cuda", dtype="bfloat16", max_num_seqs=16, max_model_len=2048,
              max_num_batched_tokens=512, gpu_memory_utilization=0.3)
    engine = llm.engine
    t0 = time.perf_counter()
    engine.warm_up()
    before = engine.stats()
    print(f"{model}: {before['graph_captures']} graphs captured in {before['graph_capture_s']:.1f}s, warm-up "
          f"{time.perf_counter() - t0:.1f}s, {before['jit_compiles']} Triton compiles by then")
    assert before["jit_compiles"] is not None and before["graph_captures"] > 0
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    for wave in range(6):
        n = rng.choice([1, 3, 7, 16])
        prompts = [[rng.randrange(100, vocab) for _ in range(rng.randrange(3, 900))] for _ in range(n)]
        sps = [SamplingParams(temperature=rng.choice([0.0, 0.8]), max_tokens=rng.randrange(2, 60), ignore_eos=True,
                              seed=i) for i in range(n)]
        llm.generate(prompt_token_ids=prompts, sampling_params=sps, use_tqdm=False)
    after = engine.stats()
    assert engine.runner.decode_graphs.replays > 0
    assert after["graph_captures"] == before["graph_captures"]
    from openinfer.engine.compile_watch import recent_triton_compiles

    new = after["jit_compiles"] - before["jit_compiles"]
    for line in recent_triton_compiles(new):
        print("compiled under traffic:", line)
    assert new == 0, recent_triton_compiles(new)
    llm.shutdown()


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_v4_decode_steps_never_make_the_host_wait_for_the_gpu(prefix_caching):
    """Under async scheduling a decode step queues its work and reads the previous step back through an event; no
    operation inside it may synchronize with the GPU (torch's sync debug mode raises on one: .item(), .tolist() of a
    CUDA tensor, a copy from pageable memory), or the host's per-request work stops overlapping the GPU's
    (issue 34). With prefix caching (block_size 16) requests cross block boundaries in the steps checked, so
    their state snapshots are copied as well."""
    llm = LLM("deepseek-v4-tiny", device="cuda", dtype="bfloat16", max_num_seqs=8, block_size=16,
              enable_prefix_caching=prefix_caching, gpu_memory_utilization=0.3)
    eng = llm.engine
    assert eng.async_scheduling
    for k, n in enumerate((20, 37, 64, 90, 5, 130, 47, 16)):
        eng.add_request([(i * 7919 + k) % 120000 + 100 for i in range(n)],
                        SamplingParams(temperature=0 if k % 2 else 0.8, seed=k, max_tokens=60, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.requests.values()):
        eng.step()
    eng.step()       # (the step that read the last prefill chunk back)
    pool, copied = eng.runner.pool, []
    copy_states = pool.copy_states
    pool.copy_states = lambda pairs, restore: (copied.extend(pairs), copy_states(pairs, restore))
    replays = eng.runner.decode_graphs.replays
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(24):
            eng.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        del pool.copy_states
    assert eng.runner.decode_graphs.replays == replays + 24
    assert bool(copied) == prefix_caching
    llm.shutdown()


# ---- batch-invariant mode (layers/triton_batch_invariant.py) ------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k, n", [(4096, 6144), (14336, 4096), (576, 1536)])
def test_batch_invariant_matmul_rows_do_not_depend_on_m(dtype, k, n):
    """Each row of the Triton GEMM has its bits alone (M = 1) at any M and row; close to the fp32 product."""
    from openinfer.layers.triton_batch_invariant import matmul

    g = torch.Generator(device="cuda").manual_seed(k + n)
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(dtype)
    x = torch.randn(300, k, device="cuda", generator=g).to(dtype)
    b = torch.randn(n, device="cuda", generator=g).to(dtype)
    alone = matmul(x[:1], w, b)[0]
    for m in (1, 2, 3, 7, 16, 17, 63, 64, 65, 128, 129, 255, 300):
        for pos in {0, m // 2, m - 1}:
            rows = x[:m].clone()
            rows[pos] = x[0]
            assert torch.equal(matmul(rows, w, b)[pos], alone), (m, pos)
    ref = x.float() @ w.float().T + b.float()
    assert _rel(matmul(x, w, b).float(), ref) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_batch_invariant_engine_on_gpu(tiny_dummy_dir, dtype):
    """CUDA graphs and async scheduling on: a greedy and a seeded request alone vs among 2, 7 and 16 others of
    mixed lengths, whole prompts or chunked (64-token budget): identical tokens and top-5 logprobs."""
    rng = random.Random(9)
    target = [rng.randrange(2, 2000) for _ in range(150)]
    fill = [[rng.randrange(2, 2000) for _ in range(rng.choice([3, 40, 200, 400]))] for _ in range(15)]
    fill_sp = [SamplingParams(max_tokens=rng.randrange(8, 64), temperature=rng.choice([0.0, 1.0]), seed=i,
                              ignore_eos=True) for i in range(15)]
    tparams = [SamplingParams(max_tokens=64, temperature=0, logprobs=5, ignore_eos=True),
               SamplingParams(max_tokens=64, temperature=0.8, top_p=0.95, seed=5, logprobs=5, ignore_eos=True)]

    def run(llm, others, params):
        prompts, sps = list(fill[:others]), list(fill_sp[:others])
        at = []
        for i, sp in enumerate(params):
            at.append(min(len(prompts), (i + 1) * len(prompts) // 2))
            prompts.insert(at[-1], target)
            sps.insert(at[-1], sp)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sps, use_tqdm=False)
        return [(o.outputs[0].token_ids, [sorted((t, lp.logprob) for t, lp in pos.items())
                                          for pos in o.outputs[0].logprobs])
                for o in outs if o.prompt_token_ids == target]

    alone = None
    for budget in (4096, 64):
        llm = LLM(tiny_dummy_dir, device="cuda", dtype=dtype, load_format="dummy", batch_invariant=True,
                  max_num_seqs=16, max_num_batched_tokens=budget, block_size=16, gpu_memory_utilization=0.2)
        assert llm.config.use_cuda_graphs and llm.config.use_async_scheduling
        if alone is None:
            alone = [run(llm, 0, [sp])[0] for sp in tparams]
        for others in (0, 5, 14):
            assert run(llm, others, tparams) == alone, (budget, others)
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def test_kv_store_on_cuda_hits_after_a_restart(tiny_dummy_dir, tmp_path):
    """The prefix-KV store's CUDA path (pinned copies after the forward, loads before it): a restarted engine
    hits the first one's blocks and gives its greedy tokens and logprobs (fp32)."""
    rng = random.Random(4)
    prompt = [rng.randrange(2, 2000) for _ in range(300)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    runs = []
    for _ in range(2):
        llm = LLM(tiny_dummy_dir, device="cuda", dtype="float32", load_format="dummy", block_size=16,
                  kv_store_dir=str(tmp_path), kv_cache_memory_bytes=256 << 20)
        o = llm.generate(prompt_token_ids=[prompt], sampling_params=sp, use_tqdm=False)[0]
        c = o.outputs[0]
        runs.append((c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)], o.num_cached_tokens))
        llm.shutdown()
        del llm
        gc.collect()
    assert runs[0][2] == 0 and runs[1][2] >= 256
    assert runs[0][0] == runs[1][0]
    assert max(abs(a - b) for a, b in zip(runs[0][1], runs[1][1])) < 1e-4


@pytest.mark.parametrize("mode", ["bounded", "exact", "state"])
def test_gemma3_window_replay_on_cuda_follows_the_hf_oracle(tmp_path, mode):
    """A prefix-KV store hit on Gemma-3 (window 8, blocks of 16) through the Triton kernels: bounded replay equals
    the HF oracle of its semantics, exact replay and a window-state hit equal HF with no cache (fp32; the oracle
    and the cases as in tests/test_bounded_replay.py)."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from tests.test_bounded_replay import oracle_bounded

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=500, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24,
                           sliding_window=8, max_position_embeddings=1024, final_logit_softcapping=30.0)
    hf = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(tmp_path / "m")
    hf.set_attn_implementation("eager")
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(500)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "m" / "tokenizer.json"))
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w1"}))
    rng = random.Random(5)
    prefix = [rng.randrange(2, 500) for _ in range(48)]
    first, second = [rng.randrange(2, 500) for _ in range(20)], [rng.randrange(2, 500) for _ in range(20)]
    llm = LLM(str(tmp_path / "m"), device="cuda", dtype="float32", attention_backend="triton", block_size=16,
              kv_store_dir=str(tmp_path / "store"), kv_cache_memory_bytes=64 << 20,
              swa_state_bytes=None if mode == "state" else 0, swa_replay="exact" if mode == "exact" else "bounded")
    greedy = SamplingParams(temperature=0, max_tokens=1)
    llm.generate(prompt_token_ids=[prefix if mode == "state" else prefix + first], sampling_params=greedy,
                 use_tqdm=False)
    llm.engine.kv_store.flush()
    assert llm.engine.kv_manager.reset_prefix_cache()
    prompt = prefix + second
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, prompt_logprobs_start=49)
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=sp, use_tqdm=False)[0]
    assert out.num_cached_tokens == {"bounded": 32, "exact": 0, "state": 48}[mode]
    got = torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob for i in range(49, len(prompt))])
    with torch.no_grad():
        if mode == "bounded":
            rows = oracle_bounded(hf, prompt, start=32, hit=48, window=8)[48 - 32:]
        else:
            rows = hf(torch.tensor([prompt])).logits[0, 48:]
    ref = rows[:-1].log_softmax(-1)[torch.arange(len(prompt) - 49), torch.tensor(prompt[49:])]
    assert (got - ref).abs().max() < 1e-3
    llm.shutdown()


# ---- speculative decoding ---------------------------------------------------------------------------------
class _ScriptedDrafter:
    """Drafts a plain run's own continuation, wrong from a depth cycling through 0..k (k: all right), so verify
    steps accept runs of every length and reject at every depth (as tests/test_spec_rollback.py, vocab 2000)."""

    def __init__(self, sequences: list[list[int]], k: int):
        self.sequences, self.k, self.calls = sequences, k, 0

    def propose(self, token_ids, max_drafts=None):
        token_ids = list(token_ids)
        seq = next((s for s in self.sequences if s[:len(token_ids)] == token_ids), None)
        if seq is None:        # async scheduling: a guessed sequence that went wrong (its step will be dropped)
            return [], []
        drafts = seq[len(token_ids):len(token_ids) + min(self.k, max_drafts or self.k)]
        wrong = self.calls % (self.k + 1)
        self.calls += 1
        if wrong < len(drafts):
            drafts[wrong] = 2 + (drafts[wrong] - 1) % 1998           # any other token of the vocabulary
        return drafts, [0.5] * len(drafts)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_verify_steps_replay_decode_graphs_and_keep_greedy(tiny_dummy_dir, async_scheduling):
    """A verify step on a model without per-request state runs its token + k drafts as decode rows (each row
    attends to the keys up to its own position) inside the decode CUDA graphs — more rows than max_num_seqs —
    and greedy tokens and logprobs equal plain decoding in graphs (fp32), with rejections at every depth. Under
    async scheduling steps are also queued on the guess that the verify step in flight keeps all its drafts (the
    first row's token then comes from the device): some such guesses are kept and some dropped."""
    k = 3
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, 2000, (int(n),), generator=g).tolist() for n in (5, 40, 130, 17, 66, 9)]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)

    def run(spec, sequences=None):
        llm = LLM(tiny_dummy_dir, device="cuda", dtype="float32", load_format="dummy", block_size=16, max_num_seqs=4,
                  speculative_config=spec, kv_cache_memory_bytes=256 << 20, async_scheduling=async_scheduling)
        assert llm.engine.async_scheduling == async_scheduling
        if spec is not None:
            s = llm.engine.speculator
            s.proposer = s.proposer_ahead = _ScriptedDrafter(sequences, k)
        results = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
        guesses.append((sum(o.metrics.num_guessed_steps for o in results),
                        sum(o.metrics.num_guessed_steps_dropped for o in results)))
        outs = [o.outputs[0] for o in results]
        runner, kv = llm.engine.runner, llm.engine.kv_manager
        assert kv.num_free_blocks == kv.num_blocks
        llm.shutdown()
        del llm
        gc.collect()
        return outs, runner

    guesses = []
    plain, plain_runner = run(None)
    assert plain_runner.decode_graphs.max_rows <= 4
    spec, runner = run({"method": "ngram", "num_speculative_tokens": k},
                       [p + o.token_ids for p, o in zip(prompts, plain)])
    for a, b in zip(spec, plain):
        assert a.token_ids == b.token_ids
        assert max(abs(x[t].logprob - y[t].logprob) for x, y, t in zip(a.logprobs, b.logprobs, b.token_ids)) < 1e-4
    drafted, accepted = sum(o.num_draft_tokens for o in spec), sum(o.num_accepted_tokens for o in spec)
    assert accepted > 40 and drafted - accepted > 20
    assert runner.decode_graphs.max_rows > 4 and runner.decode_graphs.replays >= 40 // (k + 1)
    guessed, dropped = guesses[-1]
    assert (guessed > dropped > 0) if async_scheduling else guessed == 0


def _tokens_agree(label, spec_outs, plain_outs) -> list[int]:
    """Per request, how many tokens two bf16 runs agree on before the first divergence (a near-tie flipped by a
    different batch shape); up to there the tokens' logprobs agree too."""
    firsts = []
    for a, b in zip(spec_outs, plain_outs):
        same = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(b.token_ids))
        for i in range(same):
            t = b.token_ids[i]
            assert abs(a.logprobs[i][t].logprob - b.logprobs[i][t].logprob) < 5e-2, (i, same)
        firsts.append(same)
    print(label, "tokens agreeing before the first divergence:", firsts)
    return firsts


@pytest.mark.parametrize("model", ["deepseek-v4-tiny", "deepseek-v41-tiny"])
def test_deepseek_verify_steps_and_mtp_drafts_replay_graphs(model):
    """DeepSeek-V4 / V4.1 (per-request state: window rings, compressor rows, V4's HCA running state, V4.1's Engram
    look-back), bf16: a verify step's token + k drafts run as decode rows carrying their offsets, inside the decode
    CUDA graphs (more rows than max_num_seqs). With a scripted drafter rejecting at every depth, tokens and their
    logprobs follow plain graphed decoding up to the first bf16 near-tie; every request agrees for a while.
    The model's own drafter likewise, its calls replayed from its graphs: V4's `mtp` (the chain, and the accepted
    rows as decode rows), V4.1's `dspark` (the block)."""
    k = 3
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 120000, (int(n),), generator=g).tolist() for n in (5, 40, 130, 17, 66, 9)]
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=1)

    def run(spec, sequences=None):
        llm = LLM(model, device="cuda", dtype="bfloat16", block_size=16, max_num_seqs=4, speculative_config=spec,
                  kv_cache_memory_bytes=256 << 20)
        if sequences is not None:
            s = llm.engine.speculator
            s.proposer = s.proposer_ahead = _ScriptedDrafter(sequences, k)
        outs = [o.outputs[0] for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)]
        runner, kv = llm.engine.runner, llm.engine.kv_manager
        assert kv.num_free_blocks == kv.num_blocks
        drafter = getattr(getattr(llm.engine.speculator, "features", None), "drafter", None)
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        return outs, runner, drafter

    def agree(spec_outs, plain_outs):
        return _tokens_agree(model, spec_outs, plain_outs)

    plain, plain_runner, _ = run(None)
    assert plain_runner.decode_graphs.replays > 0 and plain_runner.decode_graphs.max_rows <= 4
    spec, runner, _ = run({"method": "ngram", "num_speculative_tokens": k},
                          [p + o.token_ids for p, o in zip(prompts, plain)])
    assert min(agree(spec, plain)) >= 4
    assert sum(o.num_accepted_tokens for o in spec) > 20
    assert sum(o.num_draft_tokens - o.num_accepted_tokens for o in spec) > 10
    assert runner.decode_graphs.max_rows > 4 and runner.decode_graphs.replays >= 20
    method = {"deepseek-v4-tiny": "mtp", "deepseek-v41-tiny": "dspark"}[model]
    own, runner, drafter = run({"method": method, "num_speculative_tokens": 2})
    assert min(agree(own, plain)) >= 4
    assert drafter.graphs is not None and drafter.graphs.replays >= 10
    if method == "mtp":
        assert drafter.row_graphs.replays >= 10
    assert runner.decode_graphs.max_rows > 4
    print(method, "accepted", sum(o.num_accepted_tokens for o in own), "of", sum(o.num_draft_tokens for o in own))


@pytest.mark.parametrize("model", ["deepseek-v4-tiny", "deepseek-v41-tiny"])
def test_deepseek_speculation_under_async_scheduling_in_graphs(model):
    """Async scheduling with speculation on DeepSeek-V4 / V4.1 (the rings keep 2k + 1 rows of rollback room),
    bf16, steps in CUDA graphs. A scripted drafter rejecting at every depth, steps queued on guesses both kept and
    dropped: tokens and logprobs follow plain graphed decoding up to the first bf16 near-tie. The model's own
    drafter (`mtp` / `dspark`) under async extends its context with a step's features after the next step was
    queued — which replays a graph whose buffers held them: each accepted position's features equal the
    synchronous run's (they are copied out of the graph; read after the next replay they are another step's)."""
    k = 3
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 120000, (int(n),), generator=g).tolist() for n in (5, 40, 130, 17, 66, 9)]
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=1)

    def run(spec, async_scheduling=False, sequences=None):
        llm = LLM(model, device="cuda", dtype="bfloat16", block_size=16, max_num_seqs=4, speculative_config=spec,
                  kv_cache_memory_bytes=256 << 20, async_scheduling=async_scheduling or None)
        assert llm.engine.async_scheduling == (async_scheduling or spec is None)
        features = {}
        if sequences is not None:
            s = llm.engine.speculator
            s.proposer = s.proposer_ahead = _ScriptedDrafter(sequences, k)
        elif spec is not None:                  # record the features each accepted position reached the drafter with
            proposer = llm.engine.speculator.features
            after_step = proposer.after_step

            def recording_after_step(runner_out, requests, **kw):
                if runner_out.captured is not None:
                    rows = proposer.drafter.features_of(runner_out.captured).float().cpu()
                    for rid, (row, start, n, _) in runner_out.rows.items():
                        req = requests.get(rid)
                        kept = min(n, req.num_computed_tokens - start) if req is not None else 0
                        for j in range(max(kept, 0)):
                            features.setdefault((rid, start + j), rows[row + j])
                return after_step(runner_out, requests, **kw)
            proposer.after_step = recording_after_step
        results = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
        guessed = sum(o.metrics.num_guessed_steps for o in results)
        dropped = sum(o.metrics.num_guessed_steps_dropped for o in results)
        runner, kv = llm.engine.runner, llm.engine.kv_manager
        assert kv.num_free_blocks == kv.num_blocks
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        return results, runner, (guessed, dropped), features

    def agree(spec_results, plain_results):
        return _tokens_agree(model, [r.outputs[0] for r in spec_results], [r.outputs[0] for r in plain_results])

    plain, _, _, _ = run(None)
    spec, runner, (guessed, dropped), _ = run({"method": "ngram", "num_speculative_tokens": k}, True,
                                              [p + o.outputs[0].token_ids for p, o in zip(prompts, plain)])
    assert min(agree(spec, plain)) >= 4
    assert guessed > dropped > 0
    assert runner.decode_graphs.max_rows > 4 and runner.decode_graphs.replays >= 20

    method = {"deepseek-v4-tiny": "mtp", "deepseek-v41-tiny": "dspark"}[model]
    sync, _, _, want = run({"method": method, "num_speculative_tokens": 2})
    got_async, runner, _, got = run({"method": method, "num_speculative_tokens": 2}, True)
    firsts = agree(got_async, sync)
    assert min(firsts) >= 4 and runner.decode_graphs.replays >= 10
    compared = 0
    for a, prompt, n in zip(got_async, prompts, firsts):
        for pos in range(len(prompt), len(prompt) + n - 1):        # decode positions both runs computed alike
            key = (a.request_id, pos)
            if key in got and key in want:
                err = (got[key] - want[key]).norm() / want[key].norm()
                assert err < 0.1, (key, err.item())
                compared += 1
    assert compared >= 30
    print(method, "decode positions whose features were compared:", compared)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_draft_head_drafts_from_graph_features_and_keeps_greedy(smollm_dir, tmp_path, async_scheduling):
    """The draft head reads the target's features of the accepted rows; with decode and verify steps replayed in
    CUDA graphs those features are the graphs' own outputs. An untrained head (its drafts mostly rejected): greedy
    tokens equal plain decoding (fp32), every position reaches the head once, in order — also under async
    scheduling, where the head's block is read past the token still on the device."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from openinfer.benchmarks.spec import CHAT_QUESTIONS
    from openinfer.spec_decode.draft_head import DraftHead, DraftHeadConfig
    from openinfer.spec_decode.speculator import ASYNC_PROBE_INTERVAL

    hf = AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(smollm_dir)
    torch.manual_seed(0)
    cfg = DraftHeadConfig.for_target(hf.config, noise_token_id=tok.unk_token_id, block_size=3, window=16,
                                     intermediate_size=256, markov_rank=32)
    DraftHead(cfg, hf.get_input_embeddings().weight, hf.get_output_embeddings().weight).save(tmp_path / "head")
    del hf
    messages = [[{"role": "user", "content": q}] for q in CHAT_QUESTIONS[:4]]   # one slot each
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(smollm_dir, device="cuda", dtype="float32", max_num_seqs=4, kv_cache_memory_bytes=1 << 30)
    ref = [o.outputs[0].token_ids for o in plain.chat(messages, sp, use_tqdm=False)]
    plain.shutdown()
    del plain
    gc.collect()
    llm = LLM(smollm_dir, device="cuda", dtype="float32", max_num_seqs=4, kv_cache_memory_bytes=1 << 30,
              speculative_config={"method": "draft_head", "num_speculative_tokens": 2 if async_scheduling else 3,
                                  "draft_model": str(tmp_path / "head")}, async_scheduling=async_scheduling)
    assert llm.engine.async_scheduling == async_scheduling
    drafter = llm.engine.speculator.features.drafter
    extended = record_drafter_extends(drafter)
    outs = [o.outputs[0] for o in llm.chat(messages, sp, use_tqdm=False)]
    assert [o.token_ids for o in outs] == ref
    # The untrained head's drafts are all rejected, so under async scheduling each request drafts only to probe,
    # once per ASYNC_PROBE_INTERVAL steps (speculator.py, since 589bda5); synchronously it drafts at every step.
    probes = 24 // ASYNC_PROBE_INTERVAL
    assert sum(o.num_draft_tokens for o in outs) >= (2 * 4 * probes if async_scheduling else 2 * 4 * 5)
    runner = llm.engine.runner
    assert runner.decode_graphs.max_rows > 4 and runner.decode_graphs.replays >= 20
    assert drafter.graphs is not None                                    # the drafts came from its graphs
    assert drafter.graphs.replays >= (probes if async_scheduling else 20)
    for positions in extended.values():
        assert positions == list(range(positions[0], positions[0] + len(positions)))
    llm.shutdown()


def test_draft_head_propose_graphs_equal_eager(smollm_dir):
    """The draft head's `propose` replayed from CUDA graphs (batch buckets 1, 2, 4, 8; padded rows) gives the
    eager call's drafts and confidences for 1..8 requests over random context rings (fp32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from openinfer.spec_decode.draft_head import DraftHead, DraftHeadConfig, DraftHeadDrafter

    hf = AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(smollm_dir)
    torch.manual_seed(0)
    cfg = DraftHeadConfig.for_target(hf.config, noise_token_id=tok.unk_token_id, block_size=4, window=16,
                                     intermediate_size=256, markov_rank=32)
    head = DraftHead(cfg, hf.get_input_embeddings().weight, hf.get_output_embeddings().weight).cuda()
    del hf
    eager = DraftHeadDrafter(head, max_requests=12)
    graphed = DraftHeadDrafter(head, max_requests=12, max_batch=8)
    g = torch.Generator(device="cuda").manual_seed(1)
    rings = torch.randn(eager.rings.shape, generator=g, device="cuda")
    eager.rings.copy_(rings)
    graphed.rings.copy_(rings)
    for B in (1, 3, 2, 5, 8, 3):
        slots = torch.randperm(12, device="cuda")[:B]
        last = torch.randint(0, 40, (B,), device="cuda")
        nxt = torch.randint(0, cfg.vocab_size, (B,), device="cuda")
        a, b = eager.propose(slots, last, nxt), graphed.propose(slots, last, nxt)
        assert torch.equal(a.tokens, b.tokens)
        torch.testing.assert_close(a.confidences, b.confidences, atol=1e-5, rtol=0)
    assert sorted(graphed.graphs.graphs) == [1, 2, 4, 8] and graphed.graphs.replays == 6
    with pytest.raises(ValueError, match="batch 9 is above the 8 requests"):
        graphed.propose(torch.arange(9, device="cuda"), torch.zeros(9, device="cuda"), torch.zeros(9, device="cuda"))


def test_mtp_chain_graphs_equal_eager():
    """DeepSeek-V4's MTP chain (k heads, k - 1 decode steps of its block with MoE) replayed from CUDA graphs (batch
    buckets, padded rows on the scratch state slot) gives the eager chain's drafts and confidences for 1..4
    requests, bf16, over the same rings (each call rewrites the same ring rows with the same values)."""
    from openinfer.spec_decode.mtp import MtpDrafter

    llm = LLM("deepseek-v4-tiny", device="cuda", dtype="bfloat16", max_num_seqs=4,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3}, kv_cache_memory_bytes=256 << 20)
    runner = llm.engine.runner
    model, caches = runner.model, runner.caches
    eager = MtpDrafter(model, caches, runner.block_size, 3)
    graphed = MtpDrafter(model, caches, runner.block_size, 3, max_batch=4, scratch_slot=runner.num_state_slots)
    assert eager.graphs is None and graphed.graphs is not None
    g = torch.Generator(device="cuda").manual_seed(2)
    for ring in caches["mtp_swa"]:
        ring.copy_(torch.randn(ring.shape, generator=g, device="cuda").to(ring.dtype))
    hidden = torch.randn((runner.num_state_slots, model.config.hidden_size), generator=g, device="cuda")
    for d in (eager, graphed):
        d._newest = {s: hidden[s].to(torch.bfloat16) for s in range(runner.num_state_slots)}
    for B in (1, 3, 2, 4, 3):
        slots = torch.randperm(runner.num_state_slots, device="cuda")[:B]
        last = torch.randint(0, 200, (B,), device="cuda")
        nxt = torch.randint(0, 1000, (B,), device="cuda")
        a = eager.propose(slots, last, nxt)
        b = graphed.propose(slots, last, nxt)
        assert torch.equal(a.tokens, b.tokens)
        torch.testing.assert_close(a.confidences, b.confidences, atol=1e-2, rtol=0)
    assert sorted(graphed.graphs.graphs) == [1, 2, 4] and graphed.graphs.replays == 5
    llm.shutdown()


def test_dspark_propose_graphs_equal_eager():
    """DeepSeek-V4.1's DSpark block (stages with MoE, Markov and confidence heads) replayed from CUDA graphs (batch
    buckets, padded rows) gives the eager call's drafts, confidences and logits for 1..4 requests, bf16, over the
    same random context rings."""
    from openinfer.spec_decode.dspark import DSparkDrafter

    llm = LLM("deepseek-v41-tiny", device="cuda", dtype="bfloat16", max_num_seqs=4, kv_cache_memory_bytes=256 << 20)
    model = llm.engine.runner.model
    eager, graphed = DSparkDrafter(model, 6), DSparkDrafter(model, 6, max_batch=4)
    assert eager.graphs is None and graphed.graphs is not None
    g = torch.Generator(device="cuda").manual_seed(3)
    keys = model.mtp[0].context_keys(torch.randn((eager.rings.shape[1] * eager.rings.shape[2], model.config.dim),
                                                 generator=g, device="cuda").to(eager.dtype),
                                     torch.zeros(eager.rings.shape[1] * eager.rings.shape[2], dtype=torch.long,
                                                 device="cuda"), model.ropes, eager.codec)
    for d in (eager, graphed):
        d.rings.copy_(keys.view(eager.rings.shape[1:]).expand_as(d.rings))
    for B in (1, 3, 2, 4, 3):
        slots = torch.randperm(6, device="cuda")[:B]
        last = torch.randint(0, 200, (B,), device="cuda")
        nxt = torch.randint(0, 1000, (B,), device="cuda")
        a, b = eager.propose(slots, last, nxt), graphed.propose(slots, last, nxt)
        assert torch.equal(a.tokens, b.tokens)
        torch.testing.assert_close(a.confidences, b.confidences, atol=1e-2, rtol=0)
        torch.testing.assert_close(a.logits, b.logits, atol=5e-2, rtol=1e-2)
    assert sorted(graphed.graphs.graphs) == [1, 2, 4] and graphed.graphs.replays == 5
    llm.shutdown()


def test_confidence_policy_in_a_captured_graph_follows_eager():
    """The DSpark verification-length policy (spec §6.5) inside a CUDA graph: confidences, draft counts and the
    budget are device buffers updated in place before each replay (no host value is frozen into the graph), and
    every replay equals the eager policy on the same inputs; a budget passed as a Python int would be frozen."""
    from openinfer.spec_decode.policy import confidence_lengths

    g = torch.Generator(device="cuda").manual_seed(7)
    batch, k = 48, 5
    conf = torch.zeros(batch, k, device="cuda")
    num = torch.zeros(batch, dtype=torch.long, device="cuda")
    budget = torch.zeros((), dtype=torch.long, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):                       # warm-up outside the capture, as CUDA graphs require
        confidence_lengths(conf, num, budget)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = confidence_lengths(conf, num, budget)
    seen = set()
    for step in range(40):
        conf.copy_(torch.rand(batch, k, generator=g, device="cuda"))
        num.copy_(torch.randint(0, k + 1, (batch,), generator=g, device="cuda"))
        budget.fill_(step * 6)                             # 0 (the per-request minimum wins) .. past sum(num)
        graph.replay()
        want = confidence_lengths(conf.clone(), num.clone(), int(budget))
        assert torch.equal(out, want), f"replay {step}: {out.tolist()} != {want.tolist()}"
        assert int(out.sum()) == min(max(step * 6, int((num > 0).sum())), int(num.sum()))
        seen.add(int(out.sum()))
    assert len(seen) > 20                                  # the replays really saw different budgets and inputs
