"""Random decode steps of DeepSeek's sparse attention, the fused Triton kernel (`layers/triton_sparse_decode.py`)
checked against the torch reference (`layers/sparse_attention.py:sparse_decode_attention`) on the same caches.

A case is a window ring with rollback room (R > W: rows of other positions that must not be read), decode rows at
random positions (some below W, so part of their window is before the sequence start) in shuffled state slots, a
compressed cache whose rows are picked per query in random order (invalid picks pointing at arbitrary rows, one
row with no valid pick at all), in both softmax semantics, fp32 and bf16, with unquantized caches (V4), V4.1's
packed FP8 window / FP4 compressed rows (`quantized=True`) or V4's FlashMLA rows in both (`quantized="ds_mla"`:
FP8 NoPE values with E8M0 scales, a bf16 RoPE part; `cpu --ds-mla` runs those). Ring and cache rows that no query may read (rollback room, positions
outside the window, rows only invalid picks point at) hold NaN, and the kernel's output starts as NaN: an output
without NaN was wholly written and read no such row.

Tolerances, by dtype:
- float32: the kernel and the reference compute the same float32 sums in other orders (and exp2 for exp): over
  up to ~1,000 keys that is a few float32 roundings of the output, so max |kernel - reference| <= 1e-5 of the
  output's largest magnitude (measured up to 5e-6 at full width, outputs up to ~6).
- bf16: both round (the reference its logits (V4) or probabilities and its output, the kernel its probabilities
  and output), so each is compared with the float32 oracle (the reference on the same values upcast): the
  kernel's error is at most the reference's plus one bf16 rounding of the output (2^-8 of its magnitude).

`compare_engines` runs the tiny V4 / V4.1 models through the engine with the kernel and with the reference in its
place (`LayerOps.sparse_decode_attention`, all else equal) and compares their logits.

Used by tests/test_sparse_decode_attention.py (Triton's interpreter on the CPU, a subprocess with
TRITON_INTERPRET=1; and the real kernel on CUDA at full width); run directly (`cpu [--quick | --engine]`) it prints
one line per case.
"""

from __future__ import annotations

import dataclasses
import random
import sys

import torch

from openinfer.layers.sparse_attention import SOFTMAXES, V4_SOFTMAX, V41_SOFTMAX, sparse_decode_attention
from openinfer.quantization.kv_formats import Fp4BlockCodec, Fp8BlockCodec, Fp8DsMlaCodec

V41_CODECS = (Fp8BlockCodec(32), Fp4BlockCodec(16, "e4m3"))       # what V4.1 stores (window, compressed)


def case_codecs(quantized, head_dim: int) -> tuple:
    """(ring codec, cache codec) of a case: None (unquantized), V4.1's, or V4's FlashMLA rows (`"ds_mla"`; a RoPE
    part of head_dim / 8: 64 at DeepSeek's width)."""
    if quantized == "ds_mla":
        codec = Fp8DsMlaCodec.for_head(head_dim, head_dim // 8)
        return codec, codec
    return V41_CODECS if quantized else (None, None)


def random_case(rng: random.Random, *, device: str, dtype: torch.dtype, batch: int, heads: int, head_dim: int,
                window: int, rollback: int, topk: int | None, softmax: str, quantized: bool, valid_mask: bool = True,
                prefix_valid: bool = False, cache_rows: int = 200) -> dict:
    """Keyword arguments of `sparse_decode_attention` for one random step. `topk` None: window only. `prefix_valid`:
    the picks are entries 0 .. K-1 with the first ones valid (HCA: every closed entry); else random rows with
    random validity. `valid_mask` False: no mask (every pick valid)."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    dev = torch.device(device)
    R, S = window + rollback, batch + 3
    ring_codec, cache_codec = case_codecs(quantized, head_dim)
    ds_mla = quantized == "ds_mla"

    ring_vals = torch.randn(S, R, head_dim, generator=g) * 2
    ring = ring_codec.encode(ring_vals) if quantized else ring_vals.to(dtype)
    slots = torch.randperm(S, generator=g)[:batch]
    positions = torch.tensor([rng.choice([rng.randrange(0, max(window, 1)), rng.randrange(0, 4 * window + 9)])
                              for _ in range(batch)])
    # every ring row no query may read (rollback room, positions outside the window, other slots) holds NaN
    read = torch.zeros(S, R, dtype=torch.bool)
    for s, p in zip(slots.tolist(), positions.tolist()):
        read[s, [q % R for q in range(max(p - window + 1, 0), p + 1)]] = True
    if ds_mla:
        ring[~read] = 0xFF                              # E4M3 and bf16 NaN values, E8M0 NaN scales
    elif quantized:
        ring[~read] = 0x7F                              # E4M3 NaN values (E8M0 scale 1)
    else:
        ring[~read] = float("nan")
    args = dict(q=torch.randn(batch, heads, head_dim, generator=g).to(dtype),
                sinks=torch.randn(heads, generator=g) * 2, scale=head_dim ** -0.5, softmax=softmax, ring=ring,
                slots=slots, positions=positions, window=window, ring_codec=ring_codec)
    if topk is not None:
        cache_vals = torch.randn(cache_rows, head_dim, generator=g) * 2
        cache = cache_codec.encode(cache_vals) if quantized else cache_vals.to(dtype)
        if prefix_valid:
            rows = torch.randperm(cache_rows, generator=g)[:topk].expand(batch, -1).contiguous()
            closed = torch.randint(0, topk + 1, (batch,), generator=g)
            valid = torch.arange(topk)[None, :] < closed[:, None]
        else:
            rows = torch.randint(0, cache_rows, (batch, topk), generator=g)
            valid = torch.rand(batch, topk, generator=g) < 0.7
            valid[0] = False                            # a row without a valid pick: its window only
        picked = torch.zeros(cache_rows, dtype=torch.bool)   # rows only invalid picks point at hold NaN too
        picked[rows[valid] if valid_mask else rows.flatten()] = True
        if ds_mla:
            cache[~picked] = 0xFF
        elif quantized:
            cache[~picked, head_dim // 2:] = 0x7F          # E4M3 NaN scales
        else:
            cache[~picked] = float("nan")
        args.update(cache=cache.view(-1, 4, cache.shape[-1]) if cache_rows % 4 == 0 else cache, rows=rows,
                    valid=valid if valid_mask else None, cache_codec=cache_codec)
    return {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def cases(device: str, quick: bool = False, formats: tuple = (False, True, "ds_mla")):
    """Yield (name, case): small shapes (interpreter) on the CPU, these and DeepSeek's full width on CUDA; caches
    in `formats` (`random_case`'s `quantized`)."""
    rng = random.Random(0)
    specs = []
    dtypes = (torch.float32, torch.bfloat16)
    for dtype in dtypes:
        for softmax in SOFTMAXES:
            for quantized in formats:
                for heads, head_dim in ((4, 32), (20, 64)):
                    for window, rollback, topk in ((16, 0, None), (16, 5, 24), (8, 3, 40), (0, 2, 12)):
                        specs.append(dict(dtype=dtype, softmax=softmax, quantized=quantized, heads=heads,
                                          head_dim=head_dim, window=window, rollback=rollback, topk=topk,
                                          batch=rng.randint(1, 5), prefix_valid=rng.random() < 0.3,
                                          valid_mask=rng.random() < 0.9))
    if quick:                   # two random shapes of every (dtype, softmax, cache format); fp8_ds_mla: one
        rng.shuffle(specs)
        picked: dict = {}
        for spec in specs:
            picked.setdefault((spec["dtype"], spec["softmax"], spec["quantized"]), []).append(spec)
        specs = [spec for (_, _, fmt), group in picked.items() for spec in group[:1 if fmt == "ds_mla" else 2]]
    if device == "cuda":        # DeepSeek's width: 64 heads of 512, window 128 (+ rollback), CSA top-512, HCA
        for dtype in dtypes:
            for softmax, quantized in ((V4_SOFTMAX, False), (V41_SOFTMAX, True), (V41_SOFTMAX, False),
                                       (V4_SOFTMAX, "ds_mla")):
                if quantized not in formats:
                    continue
                for batch, topk, prefix in ((1, 512, False), (3, 512, False), (2, 64, True), (2, 1024, True),
                                            (37, 512, False), (130, 8, True)):
                    specs.append(dict(dtype=dtype, softmax=softmax, quantized=quantized, heads=64, head_dim=512,
                                      window=128, rollback=rng.choice([0, 3, 9]), topk=topk, batch=batch,
                                      prefix_valid=prefix, cache_rows=4096))
    for spec in specs:
        case = random_case(rng, device=device, **spec)
        name = " ".join(f"{k}={str(v).replace('torch.', '')}" for k, v in spec.items())
        yield name, case


def check(case: dict, tuning: dict | None = None) -> tuple[str | None, float]:
    """(failure or None, max |kernel - reference|) for one case."""
    from openinfer.layers.triton_sparse_decode import sparse_decode_attention as fused

    q = case["q"]
    out = torch.full_like(q, float("nan"))                # every element must be written
    got = fused(**case, out=out, tuning=tuning)
    ref = sparse_decode_attention(**case)
    err = (got.float() - ref.float()).abs().max().item()
    if got.isnan().any() or ref.isnan().any():
        return "NaN in the output (an element not written, or a ring row outside the window read?)", err
    if q.dtype == torch.float32:
        bound = 1e-5 * max(1.0, ref.abs().max().item())
        if not err <= bound:
            return f"max |kernel - reference| = {err:.3g} > {bound:.3g}", err
        return None, err
    oracle = sparse_decode_attention(**{**case, "q": q.float()})
    err_k = (got.float() - oracle).abs().max().item()
    err_r = (ref.float() - oracle).abs().max().item()
    bound = err_r + 2 ** -8 * oracle.abs().max().item()
    if not err_k <= bound:
        return f"bf16: kernel vs float32 oracle {err_k:.3g} > reference's {err_r:.3g} + one output rounding", err
    return None, err


def check_all(device: str, quick: bool = False, formats: tuple = (False, True, "ds_mla")) -> list[str]:
    """Failures as strings (empty: every case within tolerance), each case with the default launch and with a
    forced split (a second kernel merging partial softmaxes) over small key tiles."""
    failures = []
    for name, case in cases(device, quick, formats):
        for tuning in (None, {"splits": 3, "BLOCK_N": 16, "BLOCK_H": 16}):
            fail, err = check(case, tuning)
            print(f"{name} tuning={tuning}: max |kernel - reference| {err:.3g}", flush=True)
            if fail:
                failures.append(f"{name} tuning={tuning}: {fail}")
    return failures


def engine_decode(model: str, device: str, dtype: str, op, max_tokens: int = 24,
                  kv_cache_dtype: str = "auto") -> tuple[list, list, int]:
    """Greedy decoding of three requests (20, 130 and 300 prompt tokens: contexts across window, compression and
    context-bucket boundaries) with `op` as the engine's `LayerOps.sparse_decode_attention`, all else as the engine
    chooses: (tokens per request, logits per request and step, calls of `op` — under CUDA graphs, captures)."""
    from openinfer import LLM, SamplingParams
    from openinfer.engine import llm_engine
    from tests.conftest import record_step_logits

    calls = [0]
    make = llm_engine.make_kernels

    def kernels(config):
        backend, ops = make(config)

        def counted(*args, **kwargs):
            calls[0] += 1
            return op(*args, **kwargs)
        return backend, dataclasses.replace(ops, sparse_decode_attention=counted)

    llm_engine.make_kernels = kernels
    try:
        llm = LLM(model, device=device, dtype=dtype, max_num_seqs=4, kv_cache_dtype=kv_cache_dtype,
                  **({"gpu_memory_utilization": 0.3} if device == "cuda" else {}))
    finally:
        llm_engine.make_kernels = make
    logits = record_step_logits(llm)
    prompts = [[(i * 7919 + k) % 120000 + 100 for i in range(n)] for k, n in enumerate((20, 130, 300))]
    outs = llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                        sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    result = [o.outputs[0].token_ids for o in outs], [logits[o.request_id] for o in outs], calls[0]
    llm.shutdown()
    return result


BF16_MARGIN = 1.5      # the bf16 kernel engine vs the bf16 torch engine, both against float32 (compare_engines)


def compare_engines(model: str, device: str, dtype: str, tol: float, max_tokens: int = 24,
                    kv_cache_dtype: str = "auto") -> list[str]:
    """The engine decoding with the fused kernel against the same engine with the torch reference in its place:
    failures (empty: the kernel ran, and every step's logits up to the first differing token agree within `tol`,
    relative norm). bfloat16: both are also held against the reference engine in float32 (the exact oracle), and
    the kernel's engine may be no farther from it than `BF16_MARGIN` x the reference's own bf16 engine (a random
    tiny model amplifies bf16 roundings step by step, so an absolute bf16 bound says little): the kernel must not
    make the bf16 engine less exact than the torch path does."""
    from openinfer.layers.triton_sparse_decode import sparse_decode_attention as fused

    tok_k, lg_k, calls = engine_decode(model, device, dtype, fused, max_tokens, kv_cache_dtype)
    tok_r, lg_r, _ = engine_decode(model, device, dtype, sparse_decode_attention, max_tokens, kv_cache_dtype)
    oracle = engine_decode(model, device, "float32", sparse_decode_attention, max_tokens, kv_cache_dtype) \
        if dtype == "bfloat16" else None
    failures = [] if calls else [f"{model}: the kernel never ran"]
    for req, (tk, tr, a, b) in enumerate(zip(tok_k, tok_r, lg_k, lg_r)):
        same = next((i for i, (x, y) in enumerate(zip(tk, tr)) if x != y), len(tr))
        steps = range(min(same + 1, len(a)))
        worst = max(((a[i] - b[i]).norm() / b[i].norm()).item() for i in steps)
        print(f"{model} {dtype} request {req}: tokens agree for {same}/{len(tr)}, worst relative logit error "
              f"{worst:.3g}", flush=True)
        if oracle is None:
            if not worst < tol:
                failures.append(f"{model} {dtype} request {req}: relative logit error {worst:.3g} >= {tol}")
            continue
        to, o = oracle[0][req], oracle[1][req]
        upto = min(same, next((i for i, (x, y) in enumerate(zip(tr, to)) if x != y), len(to)),
                   next((i for i, (x, y) in enumerate(zip(tk, to)) if x != y), len(to)))
        steps = range(min(upto + 1, len(a), len(o)))
        err_k = max(((a[i].float() - o[i].float()).norm() / o[i].float().norm()).item() for i in steps)
        err_r = max(((b[i].float() - o[i].float()).norm() / o[i].float().norm()).item() for i in steps)
        print(f"{model} {dtype} request {req}: vs float32 over {len(steps)} steps: kernel {err_k:.3g}, "
              f"reference {err_r:.3g}", flush=True)
        if not err_k <= BF16_MARGIN * err_r + tol:
            failures.append(f"{model} {dtype} request {req}: kernel's error vs float32 {err_k:.3g} > "
                            f"{BF16_MARGIN} x the reference's {err_r:.3g} + {tol}")
    return failures

if __name__ == "__main__":
    from tests.triton_interpreter import patch_lang_once_per_launch

    patch_lang_once_per_launch()
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    if "--engine" in sys.argv:      # the tiny models, float32 (Triton's interpreter on the CPU: its fp32 dots)
        fails = [f for m in ("deepseek-v4-tiny", "deepseek-v41-tiny")
                 for f in compare_engines(m, device, "float32", 1e-5, max_tokens=8)]
    elif "--engine-ds-mla" in sys.argv:     # the tiny V4 with kv_cache_dtype="fp8_ds_mla", float32
        fails = compare_engines("deepseek-v4-tiny", device, "float32", 1e-5, max_tokens=8,
                                kv_cache_dtype="fp8_ds_mla")
    elif "--ds-mla" in sys.argv:    # V4's FlashMLA cache rows only (one random shape per dtype and softmax)
        fails = check_all(device, quick=True, formats=("ds_mla",))
    else:
        fails = check_all(device, quick="--quick" in sys.argv, formats=(False, True))
    print("\n".join(fails) or "all cases pass")
    sys.exit(1 if fails else 0)
