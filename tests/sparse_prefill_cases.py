"""Random prefill steps of DeepSeek's sparse attention: the batched Triton kernel (`layers/triton_sparse_prefill.py`)
against the torch contract (`layers/sparse_attention.py:sparse_prefill_attention`), and the contract against the
per-sequence path the models ran before it (attend_v4 / attend_v41 over keys gathered per chunk).

A case is a step of 1-4 prefill chunks in shuffled state slots: random starts (0: a fresh prompt; below W: part of
the window before the sequence; beyond R: the ring wrapped) and lengths (1 .. 3W: a chunk longer than the ring),
optionally a YOCO floor per chunk; a window ring with rollback room whose rows no query may read hold NaN; compressed
rows picked per query at random (invalid picks, a query with none, K = 0) or as HCA's prefix of closed entries; both
softmax conventions, fp32 and bf16, unquantized caches (V4), V4.1's packed FP8 window / FP4 compressed rows and V4's
FlashMLA rows (`quantized="ds_mla"`, `cpu --ds-mla`; tests/sparse_decode_cases.py: case_codecs).
The kernel's output starts as NaN: an output without NaN was wholly written and read no unreadable row.

Tolerances are the decode kernel's (tests/sparse_decode_cases.py): fp32 max |kernel - contract| <= 1e-5 of the
output's magnitude; bf16: the kernel's error against the float32 contract at most the bf16 contract's plus one bf16
rounding of the output.

`compare_engines` runs the tiny V4 / V4.1 engines' prefill (several chunks per step, chunked prompts, a prefix hit)
with `LayerOps.sparse_prefill_attention` set against the same engine without it (the per-sequence path).

Run directly (`cpu [--quick | --engine]`, with TRITON_INTERPRET=1 on the CPU) it prints one line per case.
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys
import tempfile

import torch

from openinfer.layers.sparse_attention import (SOFTMAXES, V4_SOFTMAX, V41_SOFTMAX, attend_v4, attend_v41,
                                               sparse_prefill_attention)
from tests.sparse_decode_cases import case_codecs


def random_case(rng: random.Random, *, device: str, dtype: torch.dtype, chunks: int, heads: int, head_dim: int,
                window: int, rollback: int, topk: int | None, softmax: str, quantized: bool, prefix_valid: bool = False,
                floors: bool = False, max_len: int | None = None, cache_rows: int = 200, nan: bool = True) -> dict:
    """Keyword arguments of `sparse_prefill_attention` for one random step (`topk` None: window only; 0: K = 0).
    `nan` False: unreadable rows keep finite values (the per-sequence path multiplies them by zero)."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    W, R, S = window, window + rollback, chunks + 2
    ring_codec, cache_codec = case_codecs(quantized, head_dim)
    ds_mla = quantized == "ds_mla"
    max_len = max_len or 3 * max(W, 4)
    lens = [rng.randint(1, max_len) for _ in range(chunks)]
    starts = [rng.choice([0, rng.randrange(0, max(W, 1)), rng.randrange(0, 4 * W + 9)]) for _ in range(chunks)]
    slots = torch.randperm(S, generator=g)[:chunks]
    floor = [rng.choice([-1, s - rng.randrange(0, W + 2), s + rng.randrange(0, 3)]) for s in starts] if floors else None
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
    cu = torch.tensor([0] + lens).cumsum(0)
    T = int(cu[-1])
    ring_vals = torch.randn(S, R, head_dim, generator=g) * 2
    ring = ring_codec.encode(ring_vals) if quantized else ring_vals.to(dtype)
    read = torch.zeros(S, R, dtype=torch.bool)      # history rows some query reads; the others hold NaN
    for c, (s, slot) in enumerate(zip(starts, slots.tolist())):
        lo = max(s - W + 1, 0, floor[c] if floor else 0)
        read[slot, [p % R for p in range(lo, s)]] = True
    if nan and ds_mla:
        ring[~read] = 0xFF                          # E4M3 and bf16 NaN values, E8M0 NaN scales
    elif nan and quantized:
        ring[~read] = 0x7F                          # E4M3 NaN values (E8M0 scale 1)
    elif nan:
        ring[~read] = float("nan")
    kv = (torch.randn(T, head_dim, generator=g) * 2).to(dtype)
    if quantized:                                   # the chunk's keys as the ring will hold them, decoded
        kv = ring_codec.decode(ring_codec.encode(kv.float()), dtype)
    args = dict(q=torch.randn(T, heads, head_dim, generator=g).to(dtype), sinks=torch.randn(heads, generator=g) * 2,
                scale=head_dim ** -0.5, softmax=softmax, kv=kv, positions=positions, cu_seqlens=cu, ring=ring,
                slots=slots, window=W, ring_codec=ring_codec,
                floors=None if floor is None else torch.tensor(floor))
    if topk is not None:
        cache_vals = torch.randn(cache_rows, head_dim, generator=g) * 2
        cache = cache_codec.encode(cache_vals) if quantized else cache_vals.to(dtype)
        if prefix_valid:                            # HCA: entries 0 .. K-1 of each chunk, the closed ones valid
            rows = torch.cat([torch.randperm(cache_rows, generator=g)[:topk].expand(n, -1) for n in lens])
            valid = torch.arange(topk)[None, :] < ((positions + 1) // 4).clamp(max=topk)[:, None]
        else:
            rows = torch.randint(0, cache_rows, (T, topk), generator=g)
            valid = torch.rand(T, topk, generator=g) < 0.7
            valid[0] = False                        # a query without a valid pick: its window only
        picked = torch.zeros(cache_rows, dtype=torch.bool)
        picked[rows[valid]] = True
        if nan and ds_mla:
            cache[~picked] = 0xFF
        elif nan and quantized:
            cache[~picked, head_dim // 2:] = 0x7F   # E4M3 NaN scales
        elif nan:
            cache[~picked] = float("nan")
        args.update(cache=cache.view(-1, 4, cache.shape[-1]) if cache_rows % 4 == 0 else cache, rows=rows,
                    valid=valid, cache_codec=cache_codec)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def cases(device: str, quick: bool = False, formats: tuple = (False, True, "ds_mla")):
    """Yield (name, case): small shapes on the CPU; these and DeepSeek's Flash width on CUDA; caches in `formats`
    (`random_case`'s `quantized`)."""
    rng = random.Random(0)
    specs = []
    for dtype in (torch.float32, torch.bfloat16):
        for softmax in SOFTMAXES:
            for quantized in formats:
                for heads, head_dim in ((4, 32), (20, 64)):
                    for window, rollback, topk in ((16, 0, None), (16, 5, 24), (8, 3, 40), (8, 2, 0)):
                        specs.append(dict(dtype=dtype, softmax=softmax, quantized=quantized, heads=heads,
                                          head_dim=head_dim, window=window, rollback=rollback, topk=topk,
                                          chunks=rng.randint(1, 4), prefix_valid=rng.random() < 0.3,
                                          floors=softmax == V41_SOFTMAX and rng.random() < 0.3))
    if quick:                   # one random shape of every (dtype, softmax, cache format), shorter chunks
        rng.shuffle(specs)
        picked: dict = {}
        for spec in specs:
            picked.setdefault((spec["dtype"], spec["softmax"], spec["quantized"]), []).append(spec)
        specs = [{**group[0], "max_len": 2 * group[0]["window"]} for group in picked.values()]
    if device == "cuda":        # V4-Flash / V4.1-Flash width: 64 heads of 512, window 128, CSA top-512, HCA
        for dtype in (torch.float32, torch.bfloat16):
            for softmax, quantized in ((V4_SOFTMAX, False), (V41_SOFTMAX, True), (V41_SOFTMAX, False),
                                       (V4_SOFTMAX, "ds_mla")):
                if quantized not in formats:
                    continue
                for chunks, topk, prefix, max_len in ((1, 512, False, 300), (3, 512, False, 200), (2, 64, True, 300),
                                                      (2, 1024, True, 100), (5, None, False, 150)):
                    specs.append(dict(dtype=dtype, softmax=softmax, quantized=quantized, heads=64, head_dim=512,
                                      window=128, rollback=rng.choice([0, 3]), topk=topk, chunks=chunks,
                                      prefix_valid=prefix, max_len=max_len, cache_rows=4096))
    for spec in specs:
        name = " ".join(f"{k}={str(v).replace('torch.', '')}" for k, v in spec.items())
        yield name, random_case(rng, device=device, **spec)


def check(case: dict, tuning: dict | None = None) -> tuple[str | None, float]:
    """(failure or None, max |kernel - contract|) for one case."""
    from openinfer.layers.triton_sparse_prefill import sparse_prefill_attention as fused

    q = case["q"]
    out = torch.full_like(q, float("nan"))
    got = fused(**case, out=out, tuning=tuning)
    ref = sparse_prefill_attention(**case)
    err = (got.float() - ref.float()).abs().max().item()
    if got.isnan().any() or ref.isnan().any():
        return "NaN in the output (an element not written, or an unreadable row read?)", err
    if q.dtype == torch.float32:
        bound = 1e-5 * max(1.0, ref.abs().max().item())
        if err <= bound:
            return None, err
        note, got2, ref2 = _rerun(case, tuning, got, ref)
        err2 = (got2.float() - ref2.float()).abs().max().item()
        if torch.equal(got, got2) and not torch.equal(ref, ref2) and err2 <= bound:
            # seen in full-suite runs on the CPU (2026-12-03): the contract's first call in a process came out ~1e-4
            # off (779 of 3,584 elements) and its second call, like a fresh process, matched the kernel to 3.3e-6.
            # The kernel is still held to the bound against a contract run; the contract's nondeterminism is an
            # open bug, reported on stdout
            print(f"CONTRACT NONDETERMINISTIC: {note}", flush=True)
            return None, err2
        return f"max |kernel - contract| = {err:.3g} > {bound:.3g}; {note}", err
    oracle = sparse_prefill_attention(**{**case, "q": q.float()})
    err_k = (got.float() - oracle).abs().max().item()
    err_r = (ref.float() - oracle).abs().max().item()
    bound = err_r + 2 ** -8 * oracle.abs().max().item()
    if not err_k <= bound:
        return f"bf16: kernel vs float32 contract {err_k:.3g} > contract's {err_r:.3g} + one output rounding", err
    return None, err


def _rerun(case: dict, tuning: dict | None, got: torch.Tensor, ref: torch.Tensor
           ) -> tuple[str, torch.Tensor, torch.Tensor]:
    """A failing float32 case once more, to say which side moved: both sides are pure functions of the case, so a
    second run that differs from the first names a nondeterministic side (the interpreted kernel or the torch
    contract), and one that repeats the failure bit for bit names the inputs. The case and all four outputs are
    saved for an offline look (tests/test_sparse_prefill_attention.py: an intermittent failure in full-suite runs
    that no rerun reproduced). Returns (what moved, the kernel's second output, the contract's)."""
    from openinfer.layers.triton_sparse_prefill import sparse_prefill_attention as fused

    got2 = fused(**case, out=torch.full_like(case["q"], float("nan")), tuning=tuning)
    ref2 = sparse_prefill_attention(**case)
    path = os.path.join(tempfile.gettempdir(), f"sparse_prefill_failure_{os.getpid()}.pt")
    torch.save({"case": case, "tuning": tuning, "got": got, "ref": ref, "got2": got2, "ref2": ref2}, path)

    def moved(a, b):
        return "bit for bit the same" if torch.equal(a, b) else f"differs by {(a - b).abs().max().item():.3g}"
    return (f"second run: kernel {moved(got, got2)}, contract {moved(ref, ref2)}, |kernel - contract| "
            f"{(got2 - ref2).abs().max().item():.3g} (saved to {path})"), got2, ref2


def check_all(device: str, quick: bool = False, formats: tuple = (False, True, "ds_mla")) -> list[str]:
    """Failures (empty: every case within tolerance), each case with the default launch and small tiles."""
    failures = []
    for name, case in cases(device, quick, formats):
        for tuning in (None, {"BLOCK_N": 16, "BLOCK_H": 16}):
            fail, err = check(case, tuning)
            print(f"{name} tuning={tuning}: max |kernel - contract| {err:.3g}" + (f" FAIL: {fail}" if fail else ""),
                  flush=True)
            if fail:
                failures.append(f"{name} tuning={tuning}: {fail}")
    return failures


def check_per_sequence(device: str) -> list[str]:
    """The contract against the per-sequence path over the cases' shapes (finite unreadable rows: that path
    multiplies them by zero): bit for bit where both gather the same keys (V4.1; V4's window and picks); V4's HCA
    (one shared [N, D] block there, per-query rows here) within a few float32 ulps, or one bf16 rounding of its
    logits."""
    failures = []
    rng = random.Random(1)
    for name, _ in cases(device, quick=True, formats=(False, True)):
        spec = dict(kv.split("=") for kv in name.split(" "))
        for hca in ((False, True) if spec["softmax"] == V4_SOFTMAX and spec["topk"] not in ("None", "0") else (False,)):
            case = random_case(rng, device=device, dtype=getattr(torch, spec["dtype"]), chunks=3,
                               heads=int(spec["heads"]), head_dim=int(spec["head_dim"]), window=int(spec["window"]),
                               rollback=int(spec["rollback"]), topk=None if spec["topk"] == "None" else int(spec["topk"]),
                               softmax=spec["softmax"], quantized=spec["quantized"] == "True", prefix_valid=hca,
                               floors=spec["floors"] == "True", nan=False)
            got, want = sparse_prefill_attention(**case), per_sequence(case, hca)
            err = (got.float() - want.float()).abs().max().item()
            print(f"{name} hca={hca}: max |contract - per-sequence| {err:.3g}", flush=True)
            if not hca:
                ok = torch.equal(got, want)
            else:
                rel = 1e-6 if case["q"].dtype == torch.float32 else 2 ** -7
                ok = err <= rel * max(1.0, want.abs().max().item())
            if not ok:
                failures.append(f"{name} hca={hca}: contract differs from the per-sequence path by {err:.3g}")
    return failures


def per_sequence(case: dict, hca: bool = False) -> torch.Tensor:
    """What the models computed before the batched op, chunk by chunk (deepseek_v4 `_window_keys` + attend_v4 with
    the band; deepseek_v41 `_window` + attend_v41): the window as W history rows then the chunk's, the compressed
    entries as one [N, D] block with per-query picks (`hca`: V4's HCA, every entry of the block, masked)."""
    q, W, R, dev = case["q"], case["window"], case["ring"].shape[1], case["q"].device
    ring, cache, rows, valid = case["ring"], case.get("cache"), case.get("rows"), case.get("valid")
    dec = (lambda x, c: x.to(q.dtype) if c is None else c.decode(x, q.dtype))
    out = torch.empty_like(q)
    bounds = case["cu_seqlens"].tolist()
    for c, slot in enumerate(case["slots"].tolist()):
        t0, t1 = bounds[c], bounds[c + 1]
        pos = case["positions"][t0:t1]
        start = int(pos[0])
        hist = torch.arange(start - W, start, device=dev)
        keys = torch.cat((dec(ring[slot, hist % R], case["ring_codec"]), case["kv"][t0:t1]))
        block = picks = None
        if cache is not None:
            flat, picks = rows[t0:t1].unique(return_inverse=True)     # the chunk's entries, the queries' picks
            block = dec(cache.view(-1, cache.shape[-1])[flat], case["cache_codec"])
        if case["softmax"] == V4_SOFTMAX:
            kpos = torch.cat((hist, pos))[None, :]
            mask = (kpos <= pos[:, None]) & (kpos > pos[:, None] - W) & (kpos >= 0)
            groups = [(keys, mask, None)]
            if block is not None:
                if hca:
                    shared = dec(cache.view(-1, cache.shape[-1])[rows[t0]], case["cache_codec"])
                    groups.append((shared, valid[t0:t1], None))
                else:
                    groups.append((block, valid[t0:t1], picks))
            out[t0:t1] = attend_v4(q[t0:t1], groups, case["sinks"], case["scale"], band=W)
        else:
            wc = min(int(pos[-1]) + 1, W)
            kpos = (pos[:, None] - W + 1).clamp(min=0) + torch.arange(wc, device=dev)
            ok = kpos <= pos[:, None]
            if case["floors"] is not None:      # YOCO decoder layers: only the decoder's own tokens
                ok &= kpos >= int(case["floors"][c])
            comp = None if block is None else (block, valid[t0:t1], picks)
            out[t0:t1] = attend_v41(q[t0:t1], (keys, kpos - (start - W), ok), comp,
                                    case["sinks"], case["scale"])
    return out


def engine_prefill(model: str, device: str, dtype: str, op, max_tokens: int = 2) -> tuple[list, list, int]:
    """Greedy generation of four requests whose prompts (24 .. 130 tokens, the last sharing a 96-token prefix with
    an earlier one: a prefix hit) prefill in chunks of a 48-token step budget, several chunks per step, with `op` as
    the engine's `LayerOps.sparse_prefill_attention` (None: the per-sequence path): (tokens per request, logits per
    request and step, calls of `op`)."""
    from openinfer import LLM, SamplingParams
    from openinfer.engine import llm_engine
    from tests.conftest import record_step_logits

    calls = [0]
    make = llm_engine.make_kernels

    def kernels(config):
        backend, ops = make(config)
        if op is None:
            return backend, ops

        def counted(*args, **kwargs):
            calls[0] += 1
            return op(*args, **kwargs)
        return backend, dataclasses.replace(ops, sparse_prefill_attention=counted)

    llm_engine.make_kernels = kernels
    try:
        llm = LLM(model, device=device, dtype=dtype, max_num_seqs=4, max_num_batched_tokens=48,
                  **({"gpu_memory_utilization": 0.3} if device == "cuda" else {}))
    finally:
        llm_engine.make_kernels = make
    logits = record_step_logits(llm)
    prompts = [[(i * 7919 + k) % 120000 + 100 for i in range(n)] for k, n in enumerate((24, 130, 61))]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, use_tqdm=False, sampling_params=params)
    outs += llm.generate(prompt_token_ids=[prompts[1][:96] + [7, 8, 9] * 8], use_tqdm=False, sampling_params=params)
    result = [o.outputs[0].token_ids for o in outs], [logits[o.request_id] for o in outs], calls[0]
    llm.shutdown()
    return result


def compare_engines(model: str, device: str, dtype: str, tol: float) -> list[str]:
    """The engine's prefill through `op` (the kernel) against the per-sequence path: failures (empty: the op ran and
    every step's logits agree within `tol`, relative norm, up to the first differing token)."""
    from openinfer.layers.triton_sparse_prefill import sparse_prefill_attention as fused

    return compare_engine_ops(model, device, dtype, tol, fused)


BF16_MARGIN = 1.5      # as tests/sparse_decode_cases.py: the bf16 kernel engine vs the bf16 per-sequence engine,
#                        both against the per-sequence engine in float32


def compare_engine_ops(model: str, device: str, dtype: str, tol: float, op) -> list[str]:
    """float32: every step's logits within `tol` (relative norm) of the per-sequence engine's, up to the first
    differing token. bfloat16: both bf16 engines are held against the per-sequence engine in float32 (the exact
    oracle), and the op's may be no farther from it than `BF16_MARGIN` x the per-sequence bf16 engine's + `tol` (a
    random tiny model amplifies bf16 roundings, and a flipped near-tie moves a whole request: on the H200 the direct
    bf16 comparison gave 0.034 on one request whose first token flipped, with float32 at 2.5e-7)."""
    tok_k, lg_k, calls = engine_prefill(model, device, dtype, op)
    tok_r, lg_r, _ = engine_prefill(model, device, dtype, None)
    oracle = engine_prefill(model, device, "float32", None) if dtype == "bfloat16" else None
    failures = [] if calls else [f"{model}: the batched op never ran"]
    for req, (tk, tr, a, b) in enumerate(zip(tok_k, tok_r, lg_k, lg_r)):
        same = next((i for i, (x, y) in enumerate(zip(tk, tr)) if x != y), len(tr))
        worst = max(((a[i] - b[i]).norm() / b[i].norm()).item() for i in range(min(same + 1, len(a))))
        print(f"{model} {dtype} request {req}: tokens agree for {same}/{len(tr)}, worst relative logit error "
              f"{worst:.3g}", flush=True)
        if oracle is None:
            if not worst <= tol:
                failures.append(f"{model} {dtype} request {req}: relative logit error {worst:.3g} > {tol}")
            continue
        to, o = oracle[0][req], oracle[1][req]
        upto = min(next((i for i, (x, y) in enumerate(zip(tr, to)) if x != y), len(to)),
                   next((i for i, (x, y) in enumerate(zip(tk, to)) if x != y), len(to)))
        steps = range(min(upto + 1, len(a), len(b), len(o)))
        err_k = max(((a[i].float() - o[i].float()).norm() / o[i].float().norm()).item() for i in steps)
        err_r = max(((b[i].float() - o[i].float()).norm() / o[i].float().norm()).item() for i in steps)
        print(f"{model} {dtype} request {req}: vs float32 over {len(steps)} steps: op {err_k:.3g}, per-sequence "
              f"{err_r:.3g}", flush=True)
        if not err_k <= BF16_MARGIN * err_r + tol:
            failures.append(f"{model} {dtype} request {req}: the op's error vs float32 {err_k:.3g} > "
                            f"{BF16_MARGIN} x the per-sequence engine's {err_r:.3g} + {tol}")
    return failures


if __name__ == "__main__":
    from tests.triton_interpreter import patch_lang_once_per_launch

    patch_lang_once_per_launch()
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    if "--per-sequence" in sys.argv:
        fails = check_per_sequence(device)
    elif "--engine" in sys.argv:      # the tiny models, float32 (Triton's interpreter on the CPU: its fp32 dots)
        fails = [f for m in ("deepseek-v4-tiny", "deepseek-v41-tiny") for f in compare_engines(m, device, "float32",
                                                                                               1e-5)]
    elif "--ds-mla" in sys.argv:    # V4's FlashMLA cache rows only (one random shape per dtype and softmax)
        fails = check_all(device, quick=True, formats=("ds_mla",))
    else:
        fails = check_all(device, quick="--quick" in sys.argv, formats=(False, True))
    print("\n".join(fails) or "all cases pass")
    sys.exit(1 if fails else 0)
