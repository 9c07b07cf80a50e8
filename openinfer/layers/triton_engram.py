"""Engram table rows gathered by the GPU straight from pinned host memory (UVA): the released tables (2 x 98 GB)
do not fit next to the model, and a host-side gather would need the step's hash ids on the host — a round trip per
step, outside CUDA graphs. Pinned memory is mapped into the device's address space, so a kernel reads the few
rows a step needs (n_hash_cols x 264 B per token) over the host link, inside the step and inside graphs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_rows_kernel(ids_ptr, values_ptr, scales_ptr, out_values_ptr, out_scales_ptr,
                        VALUE_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, VBLOCK: tl.constexpr,
                        SBLOCK: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(ids_ptr + i).to(tl.int64)
    v = tl.arange(0, VBLOCK)
    vals = tl.load(values_ptr + row * VALUE_BYTES + v, mask=v < VALUE_BYTES)
    tl.store(out_values_ptr + i * VALUE_BYTES + v, vals, mask=v < VALUE_BYTES)
    s = tl.arange(0, SBLOCK)
    sc = tl.load(scales_ptr + row * SCALE_BYTES + s, mask=s < SCALE_BYTES)
    tl.store(out_scales_ptr + i * SCALE_BYTES + s, sc, mask=s < SCALE_BYTES)


def gather_rows(values: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values [rows, V] / scales [rows, S] (1-byte dtypes, pinned host or device memory), ids [...] long on CUDA ->
    (values [..., V], scales [..., S]) on the ids' device."""
    flat = ids.reshape(-1).contiguous()
    vb, sb = values.shape[1], scales.shape[1]
    out_v = torch.empty((flat.numel(), vb), dtype=torch.uint8, device=ids.device)
    out_s = torch.empty((flat.numel(), sb), dtype=torch.uint8, device=ids.device)
    if flat.numel():
        _gather_rows_kernel[(flat.numel(),)](flat, values.view(torch.uint8), scales.view(torch.uint8), out_v, out_s,
                                             vb, sb, triton.next_power_of_2(vb), max(16, triton.next_power_of_2(sb)))
    return (out_v.view(values.dtype).view(*ids.shape, vb), out_s.view(scales.dtype).view(*ids.shape, sb))
