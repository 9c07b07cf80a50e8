"""GGUF -> HF-layout directory (config.json, model.safetensors, tokenizer files), done once and cached.

Tensors are dequantized with the `gguf` package and renamed to HF names; llama.cpp's Q/K row permutation
(for its interleaved RoPE) is undone so the weights equal what HF transformers loads from the same file.
Gemma-3 (`gemma3`, text only): llama.cpp stores the Gemma norms with the +1 folded in (w + 1); it is taken
off again (as transformers' GGUF loader does), Q/K are not permuted, and the config gets what llama.cpp
hard-codes (local RoPE base 10,000, 5 sliding layers then 1 full, the attention scale).
The tokenizer is rebuilt from the GGUF metadata by transformers (only needed for this one-time step).
The converted directory is then loaded like any HF checkpoint, so there is one loading path.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

CONVERTER_VERSION = 1

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GEMMA3_LAYER_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                       "post_attention_norm": "post_attention_layernorm",
                       "post_ffw_norm": "post_feedforward_layernorm"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")


class GGUFError(ValueError):
    """The file is not a readable GGUF model of a supported architecture."""


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _hf_config(reader, arch: str, tensor_names: set[str]) -> dict:
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    heads = g("attention.head_count")
    hidden = g("embedding_length")
    cfg = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                           "gemma3": "Gemma3ForCausalLM"}[arch]],
        "model_type": arch,
        "vocab_size": None,
        "hidden_size": hidden,
        "intermediate_size": g("feed_forward_length"),
        "num_hidden_layers": g("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": g("attention.head_count_kv", heads),
        "head_dim": g("attention.key_length", hidden // heads),
        "rms_norm_eps": g("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": g("rope.freq_base", 10000.0),
        "max_position_embeddings": g("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    if arch == "gemma3":
        return _gemma3_config(cfg, g)
    if g("rope.scaling.type") not in (None, "none"):
        raise GGUFError(f"GGUF rope scaling {g('rope.scaling.type')!r} is not supported yet")
    return cfg


def _gemma3_config(cfg: dict, g) -> dict:
    """Gemma3TextConfig fields; what GGUF does not store is what llama.cpp's gemma3 graph hard-codes."""
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    cfg.update(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_activation="gelu_pytorch_tanh",
               sliding_window=g("attention.sliding_window"), sliding_window_pattern=6, rope_local_base_freq=10000.0,
               # llama.cpp: 1/sqrt(hidden/heads) for the 27B model (62 blocks), else 1/sqrt(head_dim)
               query_pre_attn_scalar=hidden // heads if cfg["num_hidden_layers"] == 62 else cfg["head_dim"],
               final_logit_softcapping=g("final_logit_softcapping"), attn_logit_softcapping=g("attn_logit_softcapping"))
    if cfg["sliding_window"] is None:
        raise GGUFError("gemma3 GGUF lacks gemma3.attention.sliding_window")
    kind = g("rope.scaling.type")
    if kind == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(g("rope.scaling.factor"))}
    elif kind not in (None, "none"):
        raise GGUFError(f"GGUF rope scaling {kind!r} is not supported yet")
    return cfg


def _unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert-time permutation of Q/K rows (pairs interleaved per head)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert `gguf_path` into `out_dir` (atomically: a half-written conversion never looks complete)."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except Exception as e:  # numpy/struct errors on truncated or foreign files
        raise GGUFError(f"{gguf_path} is not a readable GGUF file ({type(e).__name__}: {e})") from e
    arch = _field(reader, "general.architecture")
    if arch not in _SUPPORTED_ARCHS:
        raise GGUFError(f"{gguf_path}: GGUF architecture {arch!r} is not supported (supported: {_SUPPORTED_ARCHS})")
    names = {t.name for t in reader.tensors}
    cfg = _hf_config(reader, arch, names)

    layer_names = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
    tensors: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc=f"Converting {gguf_path.name}", unit="tensor"):
        parts = t.name.split(".")
        if parts[0] == "blk":
            hf = f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}" if parts[2] in layer_names else None
        else:
            hf = f"{_TOP_NAMES[parts[0]]}.{parts[1]}" if parts[0] in _TOP_NAMES else None
        if hf is None:
            continue  # e.g. rope_freqs: recomputed from the config
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise GGUFError(f"{gguf_path}: tensor {t.name} could not be dequantized ({e})") from e
        w = np.asarray(w, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
        if arch == "llama" and parts[-2] == "attn_q":
            w = _unpermute_qk(w, cfg["num_attention_heads"])
        elif arch == "llama" and parts[-2] == "attn_k":
            w = _unpermute_qk(w, cfg["num_key_value_heads"])
        elif arch == "gemma3" and t.name.endswith("norm.weight"):
            w = w - 1.0   # llama.cpp stores Gemma norms as 1 + w
        tensors[hf] = torch.from_numpy(np.array(w, dtype=np.float32))   # a writable copy
    cfg["vocab_size"] = tensors["model.embed_tokens.weight"].shape[0]

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=".converting-"))
    try:
        save_file(tensors, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        _save_tokenizer(gguf_path, tmp)
        (tmp / "openinfer_source.json").write_text(json.dumps(
            {"gguf": str(gguf_path), "converter_version": CONVERTER_VERSION}))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _save_tokenizer(gguf_path: Path, out: Path) -> None:
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise GGUFError("converting a GGUF tokenizer needs transformers: pip install 'openinfer[convert]'") from e
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out))
