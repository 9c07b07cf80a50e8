"""Batch-invariant mode (`EngineConfig.batch_invariant`): a request's logits are the same bits whether it runs
alone or in any batch, with any chunking and at any row of the batch (spec `000_…txt` §9; docs/structured_output.md
"Determinism").

Results change with the batch because reductions are split or ordered by the batch: GEMM libraries pick kernels
(and split-K) by M, attention kernels split the context by how many sequences there are or group keys relative to
the chunk, and a prefill chunk's last block of keys depends on where the chunk ends. Row-wise ops (RMSNorm,
rotary, SiLU, softmax, log-softmax, argmax, sort) are already invariant: each row is reduced alone. So this mode
replaces exactly two things:

- **Linear layers** (`make_batch_invariant`: every linear layer of the model, the LM head included): on the CPU the rows
  go through GEMMs of exactly `ROW_QUANTUM` rows each (zero-padded, as one batched matmul over a broadcast weight),
  so every row is computed by a GEMM of the same shape whatever M is. CPU BLAS libraries pick kernels and blockings
  by M: rows past the last register block use another microkernel, M = 1 runs a GEMV, and on AVX-512 machines a
  GEMM of 16 rows and one of 8 round a row differently, so padding M to a multiple is not enough: only one fixed
  shape is. Checked for M = 1..600 in tests/test_batch_invariant.py. On
  CUDA they run `triton_batch_invariant.matmul`: one tile shape for every M and no split-K, so each output is the
  same K-ordered sum of the same MMA partials whatever M is.
- **Attention** (`BatchInvariantTorchAttention` on the CPU, `triton_batch_invariant.BatchInvariantTritonAttention`
  on CUDA): every query row, decode or prefill, walks the keys in blocks of `KV_BLOCK` positions aligned to
  position 0 of its sequence with the same online softmax, whatever chunk it came in. Keys a row may not see
  contribute exact zeros (score -inf: the running max, sum and accumulator are unchanged bit for bit), so extra
  masked keys from a longer chunk or a wider batch change nothing.

The sampler needs nothing new: it works row by row, and a request with its own `seed` draws from its own
generator. Requests without a seed draw from the engine's generator in batch order and are not invariant.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from openinfer.layers.attention import TorchPagedAttention, gather_kv, write_kv

# CPU GEMMs run on exactly this many rows each (see module docstring): 16 costs ~1.9x a plain GEMM at M = 512 on 2
# cores (8: ~5x, one GEMM per 8 rows; 32: ~1.4x but 2x the work of a decode step's padded rows)
ROW_QUANTUM = 16
# keys per block of the online softmax; blocks start at position 0 of each sequence
KV_BLOCK = 128


def pad_rows(x: torch.Tensor, quantum: int = ROW_QUANTUM) -> torch.Tensor:
    """x [..., M, K] with M zero-padded up to a multiple of `quantum` (at least one quantum)."""
    m = x.shape[-2]
    padded = max(quantum, -(-m // quantum) * quantum)
    return x if padded == m else F.pad(x, (0, 0, 0, padded - m))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias with each row's bits independent of the other rows (see module docstring)."""
    if x.is_cuda:
        from openinfer.layers.triton_batch_invariant import matmul

        return matmul(x, weight, bias)
    shape = x.shape
    rows = pad_rows(x.reshape(-1, shape[-1]))
    chunks = rows.view(-1, ROW_QUANTUM, shape[-1])
    # one GEMM of ROW_QUANTUM rows per chunk; the weight broadcast over the chunks (no copy)
    y = torch.bmm(chunks, weight.t().unsqueeze(0).expand(chunks.shape[0], -1, -1)).view(rows.shape[0], -1)
    y = y[: x.numel() // shape[-1]]
    if bias is not None:
        y = y + bias
    return y.view(*shape[:-1], weight.shape[0])


def matmul_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., M, K] @ b [..., K, N] on the CPU, each row's bits independent of M (rows padded)."""
    m = a.shape[-2]
    return torch.matmul(pad_rows(a), b)[..., :m, :]


def _invariant_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias)


def make_batch_invariant(model: nn.Module) -> nn.Module:
    """Give every linear layer of `model` (nn.Linear and its one-rank parallel forms, the LM head included)
    the forward `linear` above, in place: parameters, names and loaded weights are unchanged. One process
    only (EngineConfig refuses more ranks): the parallel forms are then plain x @ W.T + b. The engine calls it
    only for models whose every other reduction is row-wise (`ModelTraits.batch_invariant`: the Llama family and
    Gemma-3; DeepSeek-V4/V4.1's MoE routing, grouped expert GEMMs and compressed attention reduce across the
    batch)."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            parallel = getattr(module, "parallel", None)
            assert parallel is None or parallel.tp_size == 1, "batch_invariant runs with one rank"
            module.forward = types.MethodType(_invariant_forward, module)
    return model


class BatchInvariantTorchAttention(TorchPagedAttention):
    """Paged attention whose every query row (decode or prefill) runs the same blocked online softmax over
    its own sequence's keys, blocks of KV_BLOCK positions from position 0 (CPU; torch ops). A decode row is a
    one-token chunk here, so a prompt token gives the same bits in a decode row or inside any chunk."""

    applies_rotary = False        # the model rotates q and k itself, as before

    def forward(self, q, k, v, kv_cache, meta, scale, window=None, kv_scale=None):
        write_kv(kv_cache, meta.slot_mapping, k, v, kv_scale)
        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd:
            lens = meta.decode_context_lens
            out[:nd] = self._attend(q[:nd, None], (lens - 1)[:, None], lens, meta.decode_block_tables, meta.block_size,
                                    kv_cache, kv_scale, scale, window)[:, 0]
        for p in meta.prefills:
            rows = slice(p.query_start, p.query_start + p.query_len)
            pos = torch.arange(p.context_len - p.query_len, p.context_len, device=q.device)
            lens = torch.tensor([p.context_len], device=q.device)
            out[rows] = self._attend(q[None, rows], pos[None], lens, p.block_ids[None], p.block_size,
                                     kv_cache, kv_scale, scale, window)[0]
        return out

    @staticmethod
    def _attend(q, q_pos, ctx_lens, tables, block_size, kv_cache, kv_scale, scale, window):
        """q [S, R, H, D]: R query rows of each of S sequences at positions q_pos [S, R]; sequence s has
        ctx_lens[s] keys in the pages of tables[s]. Returns [S, R, H, D]."""
        S, R, H, D = q.shape
        kvh = kv_cache.shape[3]
        group = H // kvh
        # rows of one KV head: (query row, head of the group) -> [S, KVH, R*G, D]
        qg = q.view(S, R, kvh, group, D).permute(0, 2, 1, 3, 4).reshape(S, kvh, R * group, D).float()
        pos = q_pos[:, :, None].expand(S, R, group).reshape(S, 1, R * group, 1)
        dev = q.device
        m = torch.full((S, kvh, R * group, 1), float("-inf"), device=dev)
        l = torch.zeros(S, kvh, R * group, 1, device=dev)
        acc = torch.zeros(S, kvh, R * group, D, device=dev)
        for start in range(0, int(ctx_lens.max()), KV_BLOCK):
            key_pos = torch.arange(start, start + KV_BLOCK, device=dev)
            slots = _block_slots(tables, start, block_size)
            keys, vals = gather_kv(kv_cache, slots, kv_scale, torch.float32)          # [S, KV_BLOCK, KVH, D]
            exists = key_pos[None, :] < ctx_lens[:, None]                            # [S, KV_BLOCK]
            keys = torch.where(exists[:, :, None, None], keys.float(), 0.0).transpose(1, 2)
            vals = torch.where(exists[:, :, None, None], vals.float(), 0.0).transpose(1, 2)
            s = matmul_rows(qg, keys.transpose(-1, -2)) * scale                     # [S, KVH, R*G, KV_BLOCK]
            visible = key_pos.view(1, 1, 1, -1) <= pos
            if window is not None:
                visible = visible & (key_pos.view(1, 1, 1, -1) > pos - window)
            s = torch.where(visible, s, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            m_use = torch.where(m_new > float("-inf"), m_new, 0.0)
            p = torch.exp(s - m_use)
            alpha = torch.exp(m - m_use)
            l = l * alpha + p.sum(-1, keepdim=True)
            acc = acc * alpha + matmul_rows(p, vals)
            m = m_new
        o = (acc / l).view(S, kvh, R, group, D).permute(0, 2, 1, 3, 4).reshape(S, R, H, D)
        return o.to(q.dtype)


def _block_slots(tables: torch.Tensor, start: int, block_size: int) -> torch.Tensor:
    """[S, KV_BLOCK] flat slots of positions [start, start + KV_BLOCK) of each sequence; positions past the
    end of a block table read slot 0 (valid memory, masked out as not existing)."""
    pos = torch.arange(start, start + KV_BLOCK, device=tables.device)
    page = pos // block_size
    inside = page < tables.shape[1]
    ids = tables[:, page.clamp(max=tables.shape[1] - 1)]
    return torch.where(inside, ids * block_size + pos % block_size, 0)
