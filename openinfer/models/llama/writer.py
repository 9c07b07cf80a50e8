"""A random Llama checkpoint in HF's layout (`model.safetensors` + `config.json` under transformers' names): what
tests and benchmarks of a Llama shape load without transformers or a download (LlamaFamily.write_random_checkpoint).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file


def hf_shapes(hf: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a plain Llama (no biases) under its HF name."""
    h, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or h // heads
    q, kv, inter = heads * head_dim, hf.get("num_key_value_heads", heads) * head_dim, hf["intermediate_size"]
    shapes = {"model.embed_tokens.weight": (hf["vocab_size"], h), "model.norm.weight": (h,)}
    if not hf.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (hf["vocab_size"], h)
    for i in range(hf["num_hidden_layers"]):
        for name, shape in (("self_attn.q_proj", (q, h)), ("self_attn.k_proj", (kv, h)),
                            ("self_attn.v_proj", (kv, h)), ("self_attn.o_proj", (h, q)),
                            ("mlp.gate_proj", (inter, h)), ("mlp.up_proj", (inter, h)), ("mlp.down_proj", (h, inter)),
                            ("input_layernorm", (h,)), ("post_attention_layernorm", (h,))):
            shapes[f"model.layers.{i}.{name}.weight"] = shape
    return shapes


def write_checkpoint(hf: dict, out: Path, seed: int = 0, std: float = 0.02,
                     tokenizer_dir: Path | str | None = None) -> None:
    """Matrices normal(0, std), norm weights 1 + normal(0, std), float32, one file; `tokenizer_dir`: a directory
    whose tokenizer.json and tokenizer_config.json are copied beside them (None or "own": none, the Llama family
    has no tokenizer of its own)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {name: (1 + std * torch.randn(shape, generator=g)) if len(shape) == 1
               else std * torch.randn(shape, generator=g) for name, shape in hf_shapes(hf).items()}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "torch_dtype": "float32", **hf}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    if tokenizer_dir not in (None, "own"):
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(tokenizer_dir) / f, out / f)
