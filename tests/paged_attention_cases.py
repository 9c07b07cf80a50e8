"""Random paged-attention steps checked kernel against reference: the Triton backend (`TritonPagedAttention`)
against the torch reference (`TorchPagedAttention`) over the same cache, for mixed steps of decode rows and
prefill chunks with cached context (prefix hits), shuffled page tables (what preemption and reuse leave),
GQA, sliding windows and the FP8 KV cache (whose reference is attention over the dequantized cache). With an
unquantized cache each case also runs with `rotary=`: the backend's RoPE fused with the KV write
(`rotate_and_write`) against the model's RoPE module applied first and the reference write.

Used by tests/test_paged_prefill.py (Triton's interpreter on the CPU, a subprocess with TRITON_INTERPRET=1)
and tests/test_gpu.py (the real kernels on CUDA); run directly it prints one line per case.
"""

from __future__ import annotations

import random
import sys

import torch

from openinfer.layers.attention import AttentionMetadata, PrefillChunk, TorchPagedAttention
from openinfer.layers.basic import RotaryEmbedding
from openinfer.quantization.kv_formats import fp8_kv_dequantize, fp8_kv_quantize


def random_step(rng: random.Random, *, device: str, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                page: int, num_decodes: int, prefill: list[tuple[int, int]], fp8: bool = False):
    """A cache with random contents and shuffled pages, and one step: `num_decodes` decode rows (random
    contexts) then prefill chunks of (cached tokens, new tokens). Returns (q, k, v, cache, kv_scale, meta)."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    decode_ctx = [rng.randint(1, 3 * page + 5) for _ in range(num_decodes)]
    seqs = [(c - 1, 1) for c in decode_ctx] + prefill           # (tokens already cached, new tokens)
    need = [-(-(c + n) // page) for c, n in seqs]
    blocks = list(range(1, sum(need) + 4))
    rng.shuffle(blocks)
    num_blocks = len(blocks) + 1
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    full = torch.randn(num_blocks, page, 2, kv_heads, head_dim, generator=g)
    kv_scale = None
    if fp8:
        cache, kv_scale = fp8_kv_quantize(full)
    else:
        cache = full.to(cache_dtype)
    tables, slot, pos = [], [], []
    for (c, n), nb in zip(seqs, need):
        t = [blocks.pop() for _ in range(nb)]
        tables.append(t)
        for p in range(c, c + n):
            slot.append(t[p // page] * page + p % page)
            pos.append(p)
    T = len(slot)
    q = torch.randn(T, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(T, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(T, kv_heads, head_dim, generator=g).to(dtype)
    dev = torch.device(device)
    meta = AttentionMetadata(block_size=page, slot_mapping=torch.tensor(slot, device=dev),
                             num_decode_tokens=num_decodes)
    if num_decodes:
        width = max(len(t) for t in tables[:num_decodes])
        meta.decode_block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables[:num_decodes]],
                                                device=dev)
        meta.decode_context_lens = torch.tensor(decode_ctx, device=dev)
        meta.max_decode_context_len = max(decode_ctx)
    row = num_decodes
    for (c, n), t in zip(prefill, tables[num_decodes:]):
        meta.prefills.append(PrefillChunk(row, n, c + n, torch.tensor(t, device=dev), page))
        row += n
    to = (lambda x: None if x is None else x.to(dev))
    return q.to(dev), k.to(dev), v.to(dev), cache.to(dev), to(kv_scale), meta


def run_case(backend, step, window, scale=0.125):
    """(backend output, reference output, backend's cache, reference's cache) for one step."""
    q, k, v, cache, kv_scale, meta = step
    extra = {} if window is None else {"window": window}
    c1 = cache.clone()
    s1 = None if kv_scale is None else kv_scale.clone()
    out = backend.forward(q, k, v, c1, meta, scale, **extra, **({} if s1 is None else {"kv_scale": s1}))
    # reference: the torch backend over the dequantized cache (FP8) or the same cache
    ref_backend = TorchPagedAttention()
    if kv_scale is None:
        c2 = cache.clone()
        ref = ref_backend.forward(q, k, v, c2, meta, scale, **extra)
        return out, ref, c1, c2
    # write the new rows the FP8 way (quantized), then attend over the dequantized cache in fp32
    c2, s2 = cache.clone(), kv_scale.clone()
    rows = c2.view(-1, *c2.shape[2:])
    srows = s2.view(-1, *s2.shape[2:])
    kq, ks = fp8_kv_quantize(k)
    vq, vs = fp8_kv_quantize(v)
    rows[meta.slot_mapping] = torch.stack((kq, vq), 1)
    srows[meta.slot_mapping] = torch.stack((ks, vs), 1)
    # Triton's CPU interpreter rounds float32 -> e4m3 wrongly where rounding carries into the exponent (124.7
    # becomes 64, not 128); there the read path is checked over the cache the backend wrote, and the write
    # (bit-equal to fp8_kv_quantize) on CUDA only
    read = (c2, s2) if q.is_cuda else (c1, s1)
    deq = fp8_kv_dequantize(*read, torch.float32)
    new = deq.view(-1, *deq.shape[2:])[meta.slot_mapping]          # the new rows as stored: quantized
    ref = ref_backend.forward(q.float(), new[:, 0], new[:, 1], deq, meta, scale, **extra)
    return out, ref, (c1, s1), (c2, s2) if q.is_cuda else (c1, s1)


def run_rotary_case(backend, step, window, scale=0.125):
    """As `run_case` (unquantized cache) with unrotated q, k and random positions: the backend rotates them with
    the KV write; the reference applies the RoPE module (torch ops) first."""
    q, k, v, cache, _, meta = step
    rope = RotaryEmbedding(q.shape[-1], 4096, 10000.0, None)
    rope.reset_tables(q.device)
    positions = torch.randint(0, 4096, (q.shape[0],), generator=torch.Generator().manual_seed(q.shape[0]))
    positions = positions.to(q.device)
    extra = {} if window is None else {"window": window}
    c1, c2 = cache.clone(), cache.clone()
    out = backend.forward(q.clone(), k.clone(), v, c1, meta, scale, rotary=(rope, positions), **extra)
    qr, kr = rope(positions, q, k)
    ref = TorchPagedAttention().forward(qr, kr, v, c2, meta, scale, **extra)
    return out, ref, c1, c2


def cases(device: str, quick: bool = False):
    """Yield (name, step, window) for a spread of shapes."""
    rng = random.Random(0)
    specs = []
    # Triton's CPU interpreter computes bf16 dots on raw bits: float32 only there
    for dtype in (torch.float32, torch.bfloat16) if device == "cuda" else (torch.float32,):
        for heads, kv_heads, head_dim in ((4, 4, 16), (8, 2, 32), (6, 2, 64)):
            for page in (4, 16, 128):
                for window in (None, 7, 40):
                    for fp8 in (False, True):
                        specs.append((dtype, heads, kv_heads, head_dim, page, window, fp8))
    if quick:
        rng.shuffle(specs)
        specs = specs[:8]
    for dtype, heads, kv_heads, head_dim, page, window, fp8 in specs:
        nchunks = rng.randint(1, 3)
        prefill = [(rng.choice([0, 0, rng.randint(1, 3 * page + 9)]), rng.randint(1, 70)) for _ in range(nchunks)]
        step = random_step(rng, device=device, dtype=dtype, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                           page=page, num_decodes=rng.randint(0, 3), prefill=prefill, fp8=fp8)
        name = (f"{str(dtype)[6:]} h{heads}/{kv_heads} d{head_dim} page{page} window{window} fp8={fp8} "
                f"prefill={prefill} decodes={step[5].num_decode_tokens}")
        yield name, step, window


def tolerance(step) -> float:
    q, _, _, cache, kv_scale, _ = step
    if kv_scale is not None:                      # bf16/fp32 operands from FP8 vs fp32 over the dequantized
        return 3e-2 if q.dtype == torch.bfloat16 else 1e-4
    return 3e-2 if q.dtype == torch.bfloat16 else 1e-5


def check_all(device: str, quick: bool = False) -> list[str]:
    """Failures as strings (empty: every case within tolerance and every cache write identical)."""
    from openinfer.layers.triton_attention import TritonPagedAttention

    backend = TritonPagedAttention()
    failures = []
    for name, step, window in cases(device, quick):
        out, ref, c1, c2 = run_case(backend, step, window)
        err = (out.float() - ref.float()).abs().max().item()
        if not err <= tolerance(step):
            failures.append(f"{name}: max |out - ref| = {err:.3g} > {tolerance(step)}")
        same_cache = all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                                     b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
                         for a, b in zip(c1 if isinstance(c1, tuple) else (c1,),
                                         c2 if isinstance(c2, tuple) else (c2,)))
        if not same_cache:
            failures.append(f"{name}: the cache written differs from the reference's")
        if step[4] is None:
            out, ref, c1, c2 = run_rotary_case(backend, step, window)
            err = max((out.float() - ref.float()).abs().max().item(), (c1.float() - c2.float()).abs().max().item())
            if not err <= tolerance(step):
                failures.append(f"{name} rotary: max |out - ref| or |cache - ref| = {err:.3g} > {tolerance(step)}")
    return failures


if __name__ == "__main__":
    from tests.triton_interpreter import patch_lang_once_per_launch

    patch_lang_once_per_launch()
    fails = check_all(sys.argv[1] if len(sys.argv) > 1 else "cpu", quick="--quick" in sys.argv)
    print("\n".join(fails) or "all cases pass")
    sys.exit(1 if fails else 0)
