"""Megatron-style tensor-parallel layers: every TP rank holds a slice of each matrix.

- `ColumnParallelLinear`: the output dimension is split. A fused projection (q/k/v, gate/up) is split per
  sub-matrix: rank r holds rows [r*s/tp, (r+1)*s/tp) of *each* sub-matrix s, concatenated, so its output is
  [q_r, k_r, v_r] (its own heads) or [gate_r, up_r], and the unfused consumer code works unchanged on the
  local widths. No communication.
- `RowParallelLinear`: the input dimension is split (it consumes a column-parallel output as is); the
  partial products are summed over the TP group (`tp_all_reduce`) and the bias, replicated, is added once,
  after the sum.
- `VocabParallelEmbedding`: rank r holds vocabulary rows [r*V/tp, (r+1)*V/tp); ids outside them give zero
  rows, and the all-reduce fills in every row from the one rank that holds it (exactly: x + 0 + ... = x).
- `ParallelLMHead`: the same vocabulary split for the output projection; the logits shards are all-gathered
  in rank order, so every TP rank ends up with the full, identical logits.

Every parameter keeps the name and layout of the one-process model (`weight`, `bias` of an nn.Linear /
nn.Embedding subclass), and each class knows how to cut its slice from a full checkpoint tensor
(`weight_loader`). With `tp_size == 1` each layer computes exactly what nn.Linear / nn.Embedding computes
(same kernels, same operation order), so the one-process model is unchanged bit for bit.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from openinfer.distributed.collectives import tp_all_gather, tp_all_reduce
from openinfer.distributed.parallel_state import ParallelContext
from openinfer.layers.basic import TORCH_OPS, LayerOps


def _split(size: int, tp_size: int, what: str) -> int:
    if size % tp_size:
        raise ValueError(f"{what} ({size}) is not divisible by tensor_parallel_size ({tp_size})")
    return size // tp_size


class ParallelLoadMixin:
    """Cutting this rank's shard out of a full checkpoint tensor.

    `full_shape(param_name, shard_id)` is the shape the checkpoint tensor must have; `weight_loader` narrows
    it to this rank's slice and copies it into the parameter (into the sub-matrix `shard_id` of a fused one).
    """
    parallel: ParallelContext

    def shard_dim(self, param_name: str) -> int | None:
        """Dimension of parameter `param_name` split over the TP ranks (None: replicated)."""
        raise NotImplementedError

    def _dst(self, param_name: str, shard_id: int | None) -> torch.Tensor:
        return getattr(self, param_name).data

    def full_shape(self, param_name: str, shard_id: int | None = None) -> tuple[int, ...]:
        shape = list(self._dst(param_name, shard_id).shape)
        dim = self.shard_dim(param_name)
        if dim is not None:
            shape[dim] *= self.parallel.tp_size
        return tuple(shape)

    def weight_loader(self, param_name: str, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        dst = self._dst(param_name, shard_id)
        dim = self.shard_dim(param_name)
        if dim is not None and self.parallel.tp_size > 1:
            n = dst.shape[dim]
            loaded = loaded.narrow(dim, self.parallel.tp_rank * n, n)
        dst.copy_(loaded)


class ColumnParallelLinear(ParallelLoadMixin, nn.Linear):
    """y_r = x W_r^T + b_r: this rank's slice of the outputs (not gathered).

    `output_sizes`: the full sizes of the fused sub-matrices (e.g. [q, k, v] or [gate, up]); each is split
    over the ranks separately, and `local_sizes` gives this rank's widths in its output."""

    def __init__(self, in_features: int, output_sizes: list[int] | int, bias: bool,
                 parallel: ParallelContext | None = None, names: list[str] | None = None):
        self.parallel = parallel or ParallelContext.single()
        sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        names = names or [f"output {i}" for i in range(len(sizes))]
        self.output_sizes = sizes
        self.local_sizes = [_split(s, self.parallel.tp_size, n) for s, n in zip(sizes, names)]
        super().__init__(in_features, sum(self.local_sizes), bias=bias)

    def shard_dim(self, param_name: str) -> int | None:
        return 0

    def _dst(self, param_name: str, shard_id: int | None) -> torch.Tensor:
        t = getattr(self, param_name).data
        if shard_id is None:
            return t
        return t.narrow(0, sum(self.local_sizes[:shard_id]), self.local_sizes[shard_id])

    # forward: nn.Linear's (the local output is what the row-parallel consumer wants)


class RowParallelLinear(ParallelLoadMixin, nn.Linear):
    """y = sum_r x_r W_r^T + b: the input is this rank's slice (a column-parallel output); the partial sums
    are all-reduced over the TP group and the (replicated) bias is added once, after the reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool, parallel: ParallelContext | None = None,
                 name: str = "input features"):
        self.parallel = parallel or ParallelContext.single()
        super().__init__(_split(in_features, self.parallel.tp_size, name), out_features, bias=bias)

    def shard_dim(self, param_name: str) -> int | None:
        return 1 if param_name == "weight" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return F.linear(x, self.weight, self.bias)   # exactly nn.Linear
        y = tp_all_reduce(F.linear(x, self.weight), self.parallel)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(ParallelLoadMixin, nn.Embedding):
    """Rows [start, end) of the vocabulary on this rank; other ids look up zeros; all-reduce over TP."""

    def __init__(self, num_embeddings: int, embedding_dim: int, parallel: ParallelContext | None = None):
        self.parallel = parallel or ParallelContext.single()
        local = _split(num_embeddings, self.parallel.tp_size, "vocab_size")
        self.vocab_start, self.vocab_end = self.parallel.tp_rank * local, (self.parallel.tp_rank + 1) * local
        # weights come from a checkpoint: skip Embedding's random init (slow on the meta device)
        super().__init__(local, embedding_dim, _weight=torch.empty(local, embedding_dim))

    def shard_dim(self, param_name: str) -> int | None:
        return 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return tp_all_reduce(out, self.parallel)


class ParallelLMHead(ParallelLoadMixin, nn.Linear):
    """Logits over the vocabulary split as in VocabParallelEmbedding (so a tied head shares the embedding
    shard), all-gathered in rank order: every TP rank returns the full logits.

    The all-gather hands every rank bit-identical logits (and the all-reduces before it bit-identical hidden
    states), so the sampler, run on every TP rank with identically seeded generators (the engine seed and
    per-request seeds), draws the same tokens everywhere: TP ranks need no broadcast of sampled tokens, and
    their schedulers stay in lockstep."""

    def __init__(self, hidden: int, vocab_size: int, parallel: ParallelContext | None = None):
        self.parallel = parallel or ParallelContext.single()
        super().__init__(hidden, _split(vocab_size, self.parallel.tp_size, "vocab_size"), bias=False)

    def shard_dim(self, param_name: str) -> int | None:
        return 0

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return tp_all_gather(F.linear(hidden, self.weight), self.parallel, dim=-1)


class ParallelGatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with the intermediate dimension split: gate/up column-parallel (each rank
    holds its gate and up slices, fused as [gate_r, up_r]), down row-parallel (one all-reduce). Same module
    and parameter names as layers.basic.GatedMLP."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False, ops: LayerOps = TORCH_OPS,
                 parallel: ParallelContext | None = None):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, [intermediate, intermediate], bias, parallel,
                                                 names=["intermediate_size"] * 2)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias, parallel, name="intermediate_size")
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))


# HF checkpoint name -> (our fused parameter, its sub-matrix)
FUSED_HF_NAMES = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                  "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def load_fused_hf_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                          rename: Callable[[str], str | None]) -> None:
    """HF-named tensors into a model whose q/k/v and gate/up are fused (`qkv_proj`, `gate_up_proj`), each full
    tensor narrowed to this rank's shard by its module (`ParallelLoadMixin`). `rename(hf_name)` gives our name,
    or None for a tensor the model does not hold (rotary tables, a tied head, a vision tower). Every parameter
    must be covered exactly once; shapes are checked against the full (unsharded) size."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for hf_name, tensor in weights:
        name = rename(hf_name)
        if name is None:
            continue
        parts = name.split(".")
        fused = FUSED_HF_NAMES.get(parts[-2]) if len(parts) >= 2 else None
        if fused is None:
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
            target_name, shard_id = name, None
        else:
            target_name, shard_id = ".".join(parts[:-2] + [fused[0], parts[-1]]), fused[1]
            name = f"{target_name}#{shard_id}"
        if name in loaded:
            raise ValueError(f"checkpoint tensor {name!r} appears twice")
        module_name, _, leaf = target_name.rpartition(".")
        module = model.get_submodule(module_name)
        sharded = isinstance(module, ParallelLoadMixin)
        expected = module.full_shape(leaf, shard_id) if sharded else tuple(params[target_name].shape)
        if tuple(tensor.shape) != tuple(expected):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected)}")
        if sharded:
            module.weight_loader(leaf, tensor, shard_id)
        else:
            params[target_name].data.copy_(tensor)
        loaded.add(name)
    expected_names = set()
    for pname, _ in model.named_parameters():
        if pname.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            expected_names |= {f"{pname}#{i}" for i in range(3)}
        elif pname.endswith(("gate_up_proj.weight", "gate_up_proj.bias")):
            expected_names |= {f"{pname}#{i}" for i in range(2)}
        else:
            expected_names.add(pname)
    missing = sorted(expected_names - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:5]}")
