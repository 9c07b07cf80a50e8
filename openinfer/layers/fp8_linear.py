"""Layers that keep published quantized weights as stored and compute through the kernel interface
(`LayerOps.fp8_linear` / `LayerOps.grouped_gemm`, chosen once at start-up: the float32 reference on the CPU,
Triton on CUDA)."""

from __future__ import annotations

import math

import torch
from torch import nn

from openinfer.layers.basic import TORCH_OPS, LayerOps, StackedLinear
from openinfer.quantization import kernel_choice
from openinfer.quantization.formats import MXFP4_GROUP, fp8_scale_shape, mxfp4_scale_shape


def stored_parameters(shape: tuple[int, ...], fmt: str, block: int) -> tuple[nn.Parameter, nn.Parameter]:
    """(weight, scale) parameters holding a quantized weight of logical shape [..., N, K] as published."""
    *lead, n, k = shape
    if fmt == "fp8":
        w = torch.empty(shape, dtype=torch.float8_e4m3fn)
        s = torch.empty(fp8_scale_shape(shape, block), dtype=torch.float8_e8m0fnu)
    elif fmt == "mxfp4":
        if k % MXFP4_GROUP:
            raise ValueError(f"MXFP4 needs in_features divisible by {MXFP4_GROUP}, got {k}")
        w = torch.empty((*lead, n, k // 2), dtype=torch.uint8)
        s = torch.empty(mxfp4_scale_shape(shape), dtype=torch.float8_e8m0fnu)
    else:
        raise ValueError(f"unknown quantized weight format {fmt!r} (fp8, mxfp4)")
    return nn.Parameter(w, requires_grad=False), nn.Parameter(s, requires_grad=False)


class Fp8Linear(nn.Module):
    """y = x W^T with W stored FP8 E4M3 plus one E8M0 scale per block x block tile (no bias: DeepSeek's
    projections have none). `parts`: the rows of the checkpoint matrices W stacks (a model's `StackedLinear`: its
    gate/up, its query down-projection and KV projection), each with its own scale tiles: the scale rows are the
    parts' scale rows in order (`part_rows`). Where every part but the last is whole tiles, a weight row's tile is
    still row // block: one GEMM; otherwise (parts narrower than a tile, tiny test configs) one GEMM per part."""

    def __init__(self, in_features: int, out_features: int, block: int, ops: LayerOps = TORCH_OPS,
                 parts: tuple[int, ...] | None = None):
        super().__init__()
        parts = tuple(parts) if parts else (out_features,)
        if sum(parts) != out_features or min(parts) <= 0:
            raise ValueError(f"an FP8 linear of {out_features} rows cannot stack parts of {parts} rows")
        self.in_features, self.out_features, self.block, self.ops = in_features, out_features, block, ops
        self.parts = parts
        self.weight = stored_parameters((out_features, in_features), "fp8", block)[0]
        # the parts' scale rows in order, allocated at once (a torch.cat on the meta device imports torch._dynamo)
        tiles = [fp8_scale_shape((rows, in_features), block) for rows in parts]
        scale = torch.empty((sum(t[0] for t in tiles), tiles[0][1]), dtype=torch.float8_e8m0fnu)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        self.one_gemm = all(rows % block == 0 for rows in parts[:-1])

    def part_rows(self, param: str) -> tuple[int, ...]:
        """The rows each part holds of parameter `param` ("weight" or "weight_scale")."""
        return self.parts if param == "weight" else tuple(-(-rows // self.block) for rows in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if self.one_gemm:
            y = self.ops.fp8_linear(x, self.weight, self.weight_scale, self.block)
        else:                   # each part's rows with its own (ragged) scale tiles
            y = torch.cat([self.ops.fp8_linear(x, w, s, self.block) for w, s in
                           zip(self.weight.split(self.parts), self.weight_scale.split(self.part_rows("weight_scale")))],
                          dim=-1)
        return y.view(*shape[:-1], self.out_features)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The parts' columns of an output (views), as `StackedLinear.split`."""
        return y.split(self.parts, dim=-1)

    def forward_groups(self, x: torch.Tensor) -> torch.Tensor:
        """Block-diagonal use (DeepSeek-V4's grouped output projection `wo_a`): x [T, g, K]; group i
        multiplies by rows [i*N/g, (i+1)*N/g) of W. One grouped GEMM, weight-only: DeepSeek's inference code
        dequantizes `wo_a` to bf16 and multiplies unquantized activations, and so does this.

        The GEMM's "experts" are row slices that each own their scale tiles whole: the groups themselves when
        a group is whole `block`-row tiles; otherwise (groups narrower than a tile, as V4's layout allows and
        transformers' dequantization reads: row r scaled by tile r // block) slices of gcd(N/g, block) rows,
        each inside one tile, whose one scale row is that tile's. A group spanning two tiles is then several
        slices over the same activations (their rows repeated); a group inside one tile is one slice.
        From the token count `kernel_choice.fp8_grouped_kernel` names on, where the ops have it, the weight is
        dequantized to bf16 and the groups multiplied by one batched GEMM instead (`ops.fp8_grouped_dequant`: the
        same values up to fp32 summation order)."""
        T, g, k = x.shape
        if self.ops.fp8_grouped_dequant is not None and kernel_choice.fp8_grouped_kernel(T) == "bf16_dequant":
            return self.ops.fp8_grouped_dequant(x, self.weight, self.weight_scale, self.block)
        rows_per_group = self.out_features // g
        sub = rows_per_group if rows_per_group % self.block == 0 else math.gcd(rows_per_group, self.block)
        parts = rows_per_group // sub
        rows = x.transpose(0, 1)[:, None].expand(g, parts, T, k).reshape(g * parts * T, k)
        offs = torch.arange(1, g * parts + 1, dtype=torch.int32, device=x.device) * T
        w = self.weight.view(g * parts, sub, k)
        s = self.weight_scale
        if sub % self.block:        # slice j lies in tile j * sub // block: repeat each tile row per slice
            b = s.view(torch.uint8)[:, None].expand(-1, self.block // sub, -1).reshape(-1, s.shape[-1])
            s = b[:g * parts].view(s.dtype)
        s = s.reshape(g * parts, -1, s.shape[-1])
        y = self.ops.grouped_gemm(rows, offs, w, s, "fp8", self.block)
        return y.view(g, parts, T, sub).permute(2, 0, 1, 3).reshape(T, g, rows_per_group)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 block={self.block}"


def to_fp8_linear(linear: nn.Linear, block: int, ops: LayerOps, groups: int = 1) -> Fp8Linear:
    """The Fp8Linear that takes `linear`'s place (built on whatever device `linear` is: meta at load time), with
    the parts of a `StackedLinear`."""
    if linear.bias is not None:
        raise ValueError("FP8 block-scaled linears have no bias")
    if linear.out_features % groups:
        raise ValueError(f"a grouped FP8 projection needs equal groups; {linear.out_features} rows in {groups} groups")
    with torch.device(linear.weight.device):
        return Fp8Linear(linear.in_features, linear.out_features, block, ops,
                         linear.parts if isinstance(linear, StackedLinear) else None)


def join_linears(parent: nn.Module, names: tuple[str, ...], joined: str) -> bool:
    """Replace `parent`'s bias-free linears `names`, which read the same input, by one linear `joined` stacking their
    rows in order (a `StackedLinear`, or an `Fp8Linear` with those parts): one GEMM where there were len(names).
    Only where they are stored alike: all nn.Linear of one dtype, or all single-part Fp8Linear of one block whose
    rows, but the last one's, are whole tiles (a weight row's scale tile then stays row // block, so the stacked
    weight is one GEMM). Otherwise (formats mixed, ragged FP8 tiles) they stay as they are and it returns False. At
    load, on the meta device, nothing is copied; materialized weights (and scales) are copied in row order."""
    mods = [getattr(parent, n) for n in names]
    rows = tuple(m.out_features for m in mods)
    first = mods[0]
    if len({m.in_features for m in mods}) != 1:
        return False
    if all(type(m) is nn.Linear and m.bias is None and m.weight.dtype == first.weight.dtype for m in mods):
        new = StackedLinear(first.in_features, rows, device=first.weight.device, dtype=first.weight.dtype)
    elif (all(type(m) is Fp8Linear and len(m.parts) == 1 and m.block == first.block and m.ops is first.ops
              for m in mods) and all(r % first.block == 0 for r in rows[:-1])):
        with torch.device(first.weight.device):
            new = Fp8Linear(first.in_features, sum(rows), first.block, first.ops, rows)
    else:
        return False
    if first.weight.device.type != "meta":
        with torch.no_grad():
            for name, p in new.named_parameters():
                p.copy_(torch.cat([getattr(m, name) for m in mods]))
    for n in names:
        delattr(parent, n)
    setattr(parent, joined, new)
    return True
