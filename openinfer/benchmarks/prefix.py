"""`openinfer bench prefix`: multi-turn conversations that share and grow prefixes, with and without the prefix-KV
store, in one run.

Workload (the same for every mode): ``--conversations`` agent-style conversations, all starting with one shared
system prompt of ``--system-tokens`` tokens; turn k of a conversation appends a user message of ``--turn-tokens``
tokens to the previous turn's prompt plus that turn's answer, so every turn's prompt extends the previous one. Token
ids come from the model's tokenizer on deterministic English text (`spec.PARAGRAPHS`), so any model works. Turns
are issued one at a time across conversations: all conversations' turn k submitted at once (continuous batching,
``max_num_seqs`` = conversations), greedy, EOS ignored, ``--max-tokens`` output tokens each.

Modes, each on its own fresh engine (every other option identical):

- ``no_cache``: prefix caching off (the peer every ratio is taken against);
- ``pool``: prefix caching on, the device/host pool only;
- ``store_restart``: a temporary ``kv_store_dir``; a warm engine runs the whole workload once and shuts down (another
  replica / an earlier process), then a FRESH engine on the same store runs the workload and is measured: its first
  hits come from the store. ``--num-kv-blocks`` (default: none, the engine's sizing) can shrink the pool so pool
  hits get evicted across turns while the store keeps them.

Per mode: TTFT p50/p99 (per request: metrics.first_token_time - arrival_time), prompt tokens, cached prompt tokens
(`RequestOutput.num_cached_tokens`) and computed prefill tokens (the difference), the measured hit ratio (cached /
prompt), cached tokens per turn, wall time, output tok/s, and ratios to ``no_cache``; plus whether every mode's
outputs are identical to ``no_cache``'s.
"""

from __future__ import annotations

import gc
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass

from openinfer.benchmarks.spec import PARAGRAPHS, _env_info

MODES = ("no_cache", "pool", "store_restart")


@dataclass
class PrefixBenchConfig:
    model: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    load_format: str = "auto"
    conversations: int = 4
    turns: int = 4
    system_tokens: int = 512
    turn_tokens: int = 64
    max_tokens: int = 16
    block_size: int = 16
    num_kv_blocks: int | None = None
    max_num_batched_tokens: int = 2048
    threads: int | None = None


def _text_tokens(tok, n: int, offset: int) -> list[int]:
    ids: list[int] = []
    i = offset
    while len(ids) < n:
        ids += tok.encode_plain(" " + PARAGRAPHS[i % len(PARAGRAPHS)])
        i += 1
    return ids[:n]


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def _engine(cfg: PrefixBenchConfig, **kw):
    from openinfer.entrypoints.llm import LLM

    opts = dict(device=cfg.device, dtype=cfg.dtype, load_format=cfg.load_format, block_size=cfg.block_size,
                max_num_seqs=cfg.conversations, max_num_batched_tokens=cfg.max_num_batched_tokens)
    if cfg.num_kv_blocks:
        opts["num_kv_blocks"] = cfg.num_kv_blocks
    opts.update(kw)
    return LLM(cfg.model, **opts) if cfg.model else LLM(**opts)


def _workload(llm, cfg: PrefixBenchConfig, measure: bool) -> dict:
    from openinfer.sampling_params import SamplingParams

    tok = llm.tokenizer
    system = _text_tokens(tok, cfg.system_tokens, 0)
    convs = [list(system) for _ in range(cfg.conversations)]
    sp = SamplingParams(max_tokens=cfg.max_tokens, temperature=0, ignore_eos=True)
    ttfts, prompt, cached, per_turn, outs, out_tokens = [], 0, 0, [], [], 0
    t0 = time.perf_counter()
    for k in range(cfg.turns):
        for c in range(cfg.conversations):
            convs[c] += _text_tokens(tok, cfg.turn_tokens, 1 + c * 7 + k)
        res = llm.generate(prompt_token_ids=[list(p) for p in convs], sampling_params=sp, use_tqdm=False)
        turn_cached = 0
        for c, o in enumerate(res):
            m = o.metrics
            ttfts.append(m.first_token_time - m.arrival_time)
            prompt += len(o.prompt_token_ids)
            cached += o.num_cached_tokens
            turn_cached += o.num_cached_tokens
            ids = list(o.outputs[0].token_ids)
            out_tokens += len(ids)
            outs.append(ids)
            convs[c] += ids
        per_turn.append(turn_cached)
    wall = time.perf_counter() - t0
    return {"ttft_s_p50": _pct(ttfts, 0.5), "ttft_s_p99": _pct(ttfts, 0.99), "prompt_tokens": prompt,
            "cached_tokens": cached, "prefill_tokens_computed": prompt - cached,
            "hit_ratio": cached / max(prompt, 1), "cached_tokens_per_turn": per_turn, "wall_s": wall,
            "output_tok_s": out_tokens / wall, "_outputs": outs}


def run_prefix_bench(cfg: PrefixBenchConfig, modes=MODES, log=print) -> dict:
    import torch

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    t_all = time.perf_counter()
    result: dict = {"benchmark": "prefix", "config": dict(cfg.__dict__), "modes": {}}
    for mode in modes:
        store = None
        if mode == "no_cache":
            llm = _engine(cfg, enable_prefix_caching=False)
        elif mode == "pool":
            llm = _engine(cfg)
        else:
            store = tempfile.mkdtemp(prefix="openinfer-prefix-bench-")
            warm = _engine(cfg, kv_store_dir=store)
            _workload(warm, cfg, False)
            warm.shutdown()
            del warm
            gc.collect()
            llm = _engine(cfg, kv_store_dir=store)
        if "env" not in result:
            result["env"] = _env_info(str(llm.config.device))
        r = _workload(llm, cfg, True)
        r["stats"] = {k: v for k, v in llm.engine.stats().items() if "prefix" in k or "store" in k}
        llm.shutdown()
        del llm
        gc.collect()
        if store:
            shutil.rmtree(store, ignore_errors=True)
        result["modes"][mode] = r
        log(f"{mode}: TTFT p50 {r['ttft_s_p50']:.3f}s p99 {r['ttft_s_p99']:.3f}s, prefill computed "
            f"{r['prefill_tokens_computed']}/{r['prompt_tokens']}, hit ratio {r['hit_ratio']:.2f}, "
            f"wall {r['wall_s']:.1f}s")
    base = result["modes"].get("no_cache")
    for mode, r in result["modes"].items():
        r["outputs_match_no_cache"] = base is not None and r["_outputs"] == base["_outputs"]
        if base:
            r["ttft_p50_over_no_cache"] = r["ttft_s_p50"] / base["ttft_s_p50"]
            r["ttft_p99_over_no_cache"] = r["ttft_s_p99"] / base["ttft_s_p99"]
            r["prefill_saved_fraction"] = 1 - r["prefill_tokens_computed"] / base["prefill_tokens_computed"]
            r["wall_over_no_cache"] = r["wall_s"] / base["wall_s"]
    for r in result["modes"].values():
        r.pop("_outputs")
    result["total_s"] = time.perf_counter() - t_all
    return result


def markdown_table(result: dict) -> str:
    rows = ["| mode | TTFT p50 s | TTFT p99 s | p50 / no_cache | prefill computed / prompt tokens | hit ratio "
            "| prefill saved | wall s | out tok/s | outputs = no_cache |", "|" + "---|" * 10]
    for m, r in result["modes"].items():
        rows.append(f"| {m} | {r['ttft_s_p50']:.3f} | {r['ttft_s_p99']:.3f} | {r.get('ttft_p50_over_no_cache', 0):.2f} "
                    f"| {r['prefill_tokens_computed']} / {r['prompt_tokens']} | {r['hit_ratio']:.2f} "
                    f"| {r.get('prefill_saved_fraction', 0):.0%} | {r['wall_s']:.1f} | {r['output_tok_s']:.1f} "
                    f"| {r['outputs_match_no_cache']} |")
    return "\n".join(rows)


def add_cli_args(p) -> None:
    p.add_argument("--model", default=None, help="default: the engine's default model (SmolLM2-135M-Instruct)")
    p.add_argument("--tokenizer-json", default=None, metavar="PATH",
                   help="instead of --model: a Llama-3-8B-shaped model dir with this tokenizer.json "
                        "(benchmarks/gpu_llama8b.py's model_dir; use with --load-format dummy)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--turn-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="a small pool: pool hits evicted across turns")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--result-json", default=None)
    p.add_argument("--markdown", action="store_true")


def cli_main(args) -> int:
    from openinfer.benchmarks.structured import _llama_model_dir

    if args.tokenizer_json and args.model:
        raise ValueError("give --model or --tokenizer-json, not both")
    model = _llama_model_dir(args.tokenizer_json) if args.tokenizer_json else args.model
    cfg = PrefixBenchConfig(model=model, device=args.device, dtype=args.dtype, load_format=args.load_format,
                            conversations=args.conversations, turns=args.turns, system_tokens=args.system_tokens,
                            turn_tokens=args.turn_tokens, max_tokens=args.max_tokens, block_size=args.block_size,
                            num_kv_blocks=args.num_kv_blocks, max_num_batched_tokens=args.max_num_batched_tokens,
                            threads=args.threads)
    result = run_prefix_bench(cfg, tuple(m for m in args.modes.split(",") if m), log=lambda s: print(s, flush=True))
    result["command"] = " ".join(["openinfer"] + sys.argv[1:]) if sys.argv else None
    if args.markdown:
        print(markdown_table(result))
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
