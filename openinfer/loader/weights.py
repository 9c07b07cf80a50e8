"""Build a model from an HF-layout directory: config.json -> model class -> safetensors weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from openinfer.layers.attention import AttentionBackend
from openinfer.layers.basic import TORCH_OPS, LayerOps
from openinfer.models.deepseek_v4 import DeepseekV4Config, DeepseekV4ForCausalLM
from openinfer.models.llama import LlamaConfig, LlamaForCausalLM


def read_hf_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def iter_safetensors(model_dir: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} has no *.safetensors weights")
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                yield name, sf.get_tensor(name).to(dtype)


def build_model(model_dir: Path, dtype: torch.dtype, device: torch.device, backend: AttentionBackend,
                ops: LayerOps = TORCH_OPS, max_positions: int | None = None, dummy: bool = False,
                quantization: str | None = None) -> LlamaForCausalLM:
    """`dummy`: random weights (normal, std 0.02) instead of the checkpoint, for benchmarks of a shape.
    `quantization="int4"`: linears are quantized from the full-precision checkpoint weights, then the rest
    is cast to `dtype`."""
    final_dtype, dtype = dtype, (torch.float32 if quantization else dtype)
    hf = read_hf_config(model_dir)
    if hf.get("model_type") == "deepseek_v4":
        if quantization:
            raise ValueError(f"quantization={quantization!r} is not supported for DeepSeek-V4 models")
        return _build_deepseek_v4(model_dir, hf, dtype, device, max_positions, dummy, ops)
    cfg = LlamaConfig.from_hf(hf)
    if max_positions is not None:
        cfg.max_position_embeddings = max(cfg.max_position_embeddings, max_positions)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, backend, ops)
    model = model.to_empty(device=device).to(dtype)
    model.rotary.reset_tables(device)   # buffers made on "meta" are recomputed for real, in float32
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if dummy:
        gen = torch.Generator(device=device).manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02, generator=gen)
    else:
        model.load_weights(iter_safetensors(model_dir, dtype))
    if quantization == "int4":
        from openinfer.layers.quantized import quantize_linears

        quantize_linears(model)
        model.to(final_dtype)
        model.rotary.reset_tables(device)
    return model.eval()


def _build_deepseek_v4(model_dir: Path, hf: dict, dtype: torch.dtype, device: torch.device,
                       max_positions: int | None, dummy: bool, ops: LayerOps) -> DeepseekV4ForCausalLM:
    cfg = DeepseekV4Config.from_hf(hf)
    if max_positions is not None:
        cfg.max_position_embeddings = max(cfg.max_position_embeddings, max_positions)
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(cfg, ops).cast(dtype)   # cast first: memory is only taken in the final dtypes
    model = model.to_empty(device=device)
    for rope in model.ropes.values():
        rope.reset(device)
    if dummy:
        init_deepseek_v4_random(model, seed=0)
    else:
        model.load_weights(iter_safetensors(model_dir, torch.float32))
    return model.eval()


def init_deepseek_v4_random(model: DeepseekV4ForCausalLM, seed: int, std: float = 0.02) -> None:
    """Random weights of a working shape: normal(std) matrices, unit norms and mHC scales, small random
    biases/sinks, a random hash table (tid2eid), so every branch carries signal."""
    dev = next(model.parameters()).device
    gen = torch.Generator(device=dev).manual_seed(seed)   # drawn where the weights live (GB-sized on GPUs)
    n_experts = model.config.n_routed_experts
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(("_hc.scale", "hc_head.hc_scale")):
                p.fill_(1.0)
            elif name.endswith(("sinks", "position_bias", "_hc.base", "hc_head.hc_base")):
                p.copy_(torch.randn(p.shape, generator=gen, device=dev) * 0.5)
            else:
                p.normal_(0.0, std, generator=gen)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):   # top_k distinct experts per token
                b.copy_(torch.rand(b.shape[0], n_experts, generator=gen, device=dev).argsort(-1)[:, :b.shape[1]])
            elif name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen, device=dev) * 0.01)
