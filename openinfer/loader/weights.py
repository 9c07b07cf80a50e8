"""Checkpoint I/O every family shares: safetensors tensors one at a time (reading, and writing shards), tokenizer
files, and allocating a model built on the meta device (stored headers and formats: quantization/checkpoint.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def materialize(model: torch.nn.Module, device) -> torch.nn.Module:
    """`model.to_empty(device=device)` for a model built on the meta device, without its start-up cost: `to_empty`
    makes each tensor with `empty_like` of the meta tensor, whose first call in a process imports torch.fx's
    symbolic shapes and sympy (~1 s); `torch.empty` of the same shape and dtype gives the same uninitialized
    tensors (every one of them is then loaded or initialized)."""
    return model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def iter_safetensors(model_dir: Path, dtype: torch.dtype | None = None,
                     keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every stored tensor, one at a time; cast to `dtype` if given, else as stored. `keep`: read
    only the tensors it accepts (expert parallelism: this rank's experts)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} has no *.safetensors weights")
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                if keep is not None and not keep(name):
                    continue
                t = sf.get_tensor(name)
                yield name, t if dtype is None else t.to(dtype)


def save_sharded(tensors: Iterable[tuple[str, torch.Tensor]], out: Path, shard_bytes: int) -> None:
    """`model-0000k-of-0000n.safetensors` shards of at most `shard_bytes` (a tensor never split) and
    `model.safetensors.index.json`, as `save_pretrained` writes them."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors:
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


def copy_tokenizer(src: Path, out: Path) -> None:
    """tokenizer.json and tokenizer_config.json of `src` (those present) into `out`."""
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (src / f).is_file():
            shutil.copy(src / f, out / f)
