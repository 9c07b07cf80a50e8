"""Small building blocks shared by decoder models: RMSNorm, rotary embedding, SiLU-gated MLP, and the
LayerOps they run on (torch reference ops; `triton_ops.py` holds the fused CUDA ones)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from openinfer.layers.sparse_attention import sparse_decode_attention
from openinfer.layers.index_topk import torch_index_topk
from openinfer.quantization import reference as quant_reference


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF semantics: normalize in float32, cast back, then scale by the weight."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def torch_add_rms_norm(x, residual, weight, eps):
    residual = x + residual
    return torch_rms_norm(residual, weight, eps), residual


def torch_silu_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def torch_rotary(positions, cos, sin, *xs):
    cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)   # [T, 1, D/2]
    out = []
    for x in xs:                                                          # [T, heads, D]
        x1, x2 = x.float().chunk(2, dim=-1)
        out.append(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype))
    return tuple(out)


def torch_hc_weights(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek-V4 mHC mixing weights from the stream projection `mixes` [T, (2+n)*n] (float32): pre [T, n],
    post [T, n], and comb [T, n, n] projected onto doubly-stochastic matrices by Sinkhorn iterations."""
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    scale = scale.float()
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * scale[2] + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def sort_by_expert(experts: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MoE picks [T, k] of n expert slots (-1: computed on another rank) -> (order [T*k]: the flat picks sorted
    by expert, stable, the -1 picks last; offs [n] int32: cumulative picks per expert, the grouped GEMMs'
    offsets). Device ops only: no host sync."""
    flat = experts.flatten()
    flat = torch.where(flat < 0, n, flat)
    counts = torch.zeros(n + 1, dtype=torch.int32, device=flat.device)
    offs = counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32)).cumsum(0, dtype=torch.int32)[:n]
    return flat.argsort(stable=True), offs


@dataclass(frozen=True)
class LayerOps:
    """The elementwise/normalization kernels a model uses, chosen once at start-up (like the attention
    backend): torch reference ops here, fused Triton ones in `triton_ops.py`."""
    rms_norm: Callable
    add_rms_norm: Callable   # (x, residual, weight, eps) -> (normed, residual + x)
    silu_mul: Callable
    rotary: Callable         # (positions, cos, sin, *xs) -> rotated xs
    hc_weights: Callable = torch_hc_weights   # DeepSeek-V4 mHC: (mixes, base, scale, n, iters, eps) -> pre, post, comb
    # published quantized weights (openinfer/quantization): (x, weight, scale, block) -> y, and
    # (expert-sorted rows, offs, weight, scale, fmt, block, host_offs=None) -> y (host_offs: a device_io.ReadOnce of
    # offs that calls sharing them read once, where a route needs them on the host)
    fp8_linear: Callable = quant_reference.fp8_linear
    grouped_gemm: Callable = quant_reference.grouped_gemm
    # the same grouped GEMM with the rows quantized to FP8 per token in groups of `block` first (W4A8 / W8A8)
    grouped_gemm_a8: Callable = quant_reference.grouped_gemm_a8
    # a block-diagonal FP8 projection (DeepSeek-V4's grouped `wo_a`) by the dequant route, (x [T, g, K], weight,
    # scale, block) -> [T, g, N/g] (dequant_gemm.grouped_linear_dequant), where kernel_choice.fp8_grouped_kernel names
    # it for T; None: `grouped_gemm` at every size
    fp8_grouped_dequant: Callable | None = None
    # whether quantized GEMMs see FP8-quantized activations (EngineConfig.quantize_activations): `fp8_linear`
    # does it itself; DeepSeek's routed experts read it to take `grouped_gemm_a8` or `grouped_gemm`
    quantize_activations: bool = True
    # DeepSeek-V4/V4.1 fused mHC and MoE routing (layers/triton_mhc.py, layers/triton_moe_routing.py); None: the
    # model's own torch code, which is their reference (the MoE glue: expert_order, moe_act, moe_combine together)
    hc_pre: Callable | None = None       # (streams, fn, base, scale, iters, eps, norm_eps, lagged=None)
    #                                      -> pre, post, comb, sublayer input
    hc_head: Callable | None = None      # (streams, fn, base, scale, eps, norm_eps) -> collapsed streams
    hc_post: Callable | None = None      # (out, streams, post, comb, rounded) -> streams
    route: Callable | None = None        # (logits, bias, top_k, scale, renormalize, *, alt_bias, alt_rows, table,
    #                                      token_ids) -> experts, weights
    expert_order: Callable | None = None  # (experts, n) -> order, rows, inv, offs
    moe_act: Callable | None = None       # (gate_up, limit, weights=None, order=None, rounded=False) -> h
    moe_combine: Callable | None = None   # (y, inv, experts, weights | None, dtype) -> per-token sums
    # ... and those sums plus the shared expert's rows, one launch: (y, inv, experts, weights | None, dtype, add) ->
    # sums in dtype + add, rounded as torch's addition in dtype; None: the models add in torch
    moe_combine_add: Callable | None = None
    # DeepSeek-V4/V4.1 decode rows: sparse attention over the window ring and the compressed cache, read in place
    # (layers/sparse_attention.py's contract; one fused launch per layer on CUDA, triton_sparse_decode.py)
    sparse_decode_attention: Callable = sparse_decode_attention
    # ... and their prefill chunks: every chunk of a step in one call (sparse_attention.sparse_prefill_attention's
    # contract; one launch per layer in triton_sparse_prefill.py); None: the models attend chunk by chunk in torch
    sparse_prefill_attention: Callable | None = None
    # DeepSeek's sparse decode (V4, V4.1): the indexer's top-k, (scores [T, N], k, limit [T] | None) -> (picks in
    # position order, valid) (layers/index_topk.py); and fused decode-row kernels, None where the model runs its own
    # torch code, their reference: the indexer's paged scores (layers/triton_indexer.index_scores), V4's compressor
    # steps (HCA's running state, CSA's ring) and V4.1's KV-source step and index keys (layers/triton_compressor.py)
    index_topk: Callable = torch_index_topk
    index_scores: Callable | None = None
    # ... the same scores for a prefill chunk's queries (V4's `Indexer.select_chunk`: every query with the chunk's one
    # block table); None: the model's torch code over the gathered keys
    index_prefill_scores: Callable | None = None
    v4_hca_decode: Callable | None = None
    v4_csa_decode: Callable | None = None
    v41_compress_decode: Callable | None = None
    v41_index_keys_decode: Callable | None = None
    # DeepSeek-V4/V4.1 attention glue (layers/triton_v4_glue.py): (x, eps, weight, positions, inv_freq, rope_scale,
    # cs_dtype, inverse) -> RMSNorm then interleaved RoPE of each row, one launch; None: the models' torch code
    v4_norm_rope: Callable | None = None
    # ... and the window keys' call with the decode rows' ring write in its epilogue: (x, eps, weight, positions,
    # inv_freq, rope_scale, cs_dtype, ring, slots, fp8_block) -> v4_norm_rope's rows, the first len(slots) of them also
    # stored at ring[slots, positions % R]; None: the models store them in torch (`_decode`)
    v4_kv_ring: Callable | None = None
    # DeepSeek-V4's compressor input rows after the two projections, one launch (triton_compressor.v4_compressor_rows):
    # (kv, gate, position_bias, positions, ratio) -> float32 [T, 2W] = [kv | gate + position_bias[positions % ratio]]
    v4_compressor_rows: Callable | None = None
    # DeepSeek-V4/V4.1 decode rows' compressed entries 0 .. n-1 as flat cache rows, one launch
    # (triton_v4_glue.entry_rows): (tables [T, W], n, entries_per_block) -> int64 [T, n] (`entry_index` of each)
    entry_rows: Callable | None = None


TORCH_OPS = LayerOps(torch_rms_norm, torch_add_rms_norm, torch_silu_mul, torch_rotary, torch_hc_weights)


class StackedLinear(nn.Linear):
    """A bias-free linear whose rows stack checkpoint matrices of `parts` rows each, in order, that read the same
    input: one GEMM where the checkpoint has several (the models' loaders fill and split it part by part). `split`
    cuts its output into the parts' columns (views)."""

    def __init__(self, in_features: int, parts: tuple[int, ...], **factory):
        super().__init__(in_features, sum(parts), bias=False, **factory)
        self.parts = tuple(parts)

    def part_rows(self, param: str) -> tuple[int, ...]:
        """The rows each part holds of parameter `param` ("weight")."""
        return self.parts

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(self.parts, dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: LayerOps = TORCH_OPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """rms_norm(x) when residual is None; else (rms_norm(x + residual), x + residual)."""
        if residual is not None:
            return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
        shape = x.shape
        return self.ops.rms_norm(x.reshape(-1, shape[-1]), self.weight, self.eps).view(shape)


def rope_inv_freq(rotary_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies for RoPE: default, linear and llama3 scaling (HF `rope_parameters` semantics)."""
    # float32 throughout, as HF computes it, so positions far out agree with the reference
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE with a precomputed cos/sin table indexed by position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 ops: LayerOps = TORCH_OPS):
        super().__init__()
        self.ops = ops
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.reset_tables(torch.empty(0).device)   # the default device (meta while building for a checkpoint)

    def reset_tables(self, device: torch.device) -> None:
        """(Re)compute the float32 tables on `device` (after meta-device construction or a dtype cast)."""
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)
        if device.type == "meta":     # shapes only (arange on meta takes torch's reference path, which imports
            shape = (self.max_positions, inv_freq.numel())      # torch._dynamo: ~2 s in a fresh process)
            self.cos, self.sin = torch.empty(shape, device=device), torch.empty(shape, device=device)
            return
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32, device=device), inv_freq)
        self.cos, self.sin = freqs.cos(), freqs.sin()

    def forward(self, positions: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.ops.rotary(positions, self.cos, self.sin, *xs)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False, ops: LayerOps = TORCH_OPS):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))
