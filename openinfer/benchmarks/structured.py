"""`openinfer bench structured`: structured output (xgrammar masks) vs unconstrained decoding, in one run.

Modes, all on the same engine (one engine per concurrency, every engine option identical), the same prompts and
the same ``max_tokens``, greedy, EOS not ignored:

- ``none``: unconstrained (the peer every ratio is taken against, at the same concurrency, in the same run);
- ``json_schema``: a realistic nested schema (`ORDER_SCHEMA`: an object with required fields, an enum, an integer
  with bounds, an array of objects, strings with a pattern and a maxLength);
- ``regex``: an ISO date, an email-like address and a phone number on one line (`RECORD_REGEX`);
- ``json_object``: any JSON object.

The prompts (`prompts`) describe a customer order in prose and ask for the order's fields, so every mode gets text it
can answer from. Concurrency c means: the engine is built with ``max_num_seqs=c`` and a cell's
``max(c, --min-requests)`` requests are submitted at once (continuous batching, as in `bench spec`); prefix caching
is off so every cell prefills its prompts the same way. The modes of one c run back to back on that engine, their
order reversed at every other c. Grammars are compiled (and cached) before the timed cells, so TTFT does not
include compilation: that is measured on its own (below).

Per (mode, c): output tokens actually produced (a constrained request ends early by EOS once its grammar is in an
accepting state; an unconstrained one ends at EOS or ``max_tokens``), output tok/s over the cell's wall time and per
CPU second of this process, mean TPOT (per request (finished - first token) / (output tokens - 1)), mean TTFT,
their ratios to ``none``, finish reasons, and validity: every structured output is checked -- ``json.loads`` +
jsonschema validation (json_schema), ``re.fullmatch`` (regex), ``json.loads`` is a dict (json_object); counts of
valid outputs, outputs cut by ``max_tokens`` (``length``: an unfinished structure, so not valid) and invalid outputs
that were *not* cut (a bug: the CLI exits 1). It also reports where the mask time goes: the host fill (wrapping the
engine's `StructuredOutputManager.bitmask`: xgrammar fills one int32 row of ceil(V/32) words per constrained
request per step, on the host, before the step is queued) and, on the CPU, the apply (wrapping the sampler's
`apply_token_bitmask`: -inf on the disallowed logits, one batched op); ``mask_ms_per_step`` = (fill + apply) per
step with a mask and ``mask_share_of_tpot`` = that / TPOT. On CUDA the apply is an async kernel and is not timed
(``null``: the share then counts the host fill only). A constrained request also turns async scheduling off for
its steps (the next mask needs this step's token on the host): on a GPU that is part of the cost the tok/s ratio
measures, and not part of mask_ms_per_step.

Grammar compile time, per structured mode and engine (one fresh compiler pool per c): ``cold`` = submitting the
grammar to the engine's `GrammarCompilerPool` with its cache empty and waiting for it (``compile_ms``: the worker's
own timing of the xgrammar compile), ``cached`` = submitting the same grammar again (a cache hit:
``num_compiles`` must not grow). ``pool_setup_ms``: building the pool (xgrammar's view of the vocabulary), which the
engine does on its first constrained request.

Default model: the engine's default (SmolLM2-135M-Instruct), CPU. ``--model PATH --load-format dummy`` (or
``--tokenizer-json PATH``, which builds a Llama-3-8B-shaped model dir with that tokenizer through
`benchmarks/gpu_llama8b.py`'s `model_dir`) runs it on a GPU with random weights: the outputs are then garbage, but
garbage inside the grammar, which is what measuring the mask overhead needs (expect many ``length`` finishes: random
weights rarely close a JSON object early).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import dataclass, field

from openinfer.benchmarks.spec import _env_info, _f, _ints

ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{5}$"},
        "customer": {"type": "object",
                     "properties": {"name": {"type": "string", "maxLength": 24},
                                    "email": {"type": "string",
                                              "pattern": "^[a-z]{1,12}\\.[a-z]{1,12}@[a-z]{2,10}\\.(com|org|net)$"}},
                     "required": ["name", "email"]},
        "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        "items": {"type": "array", "minItems": 1, "maxItems": 3,
                  "items": {"type": "object",
                            "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                                           "quantity": {"type": "integer", "minimum": 1, "maximum": 99}},
                            "required": ["sku", "quantity"]}},
    },
    "required": ["order_id", "customer", "status", "priority", "items"],
}
# date, email-like address, phone
RECORD_REGEX = (r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01]) "
                r"[a-z]{1,12}\.[a-z]{1,12}@[a-z]{2,10}\.(com|org|net) \+1 [0-9]{3}-[0-9]{3}-[0-9]{4}")

MODES = ("none", "json_schema", "regex", "json_object")

_FIRST = ["anna", "ben", "carla", "deniz", "emil", "fatima", "george", "hana", "ivan", "julia", "kofi", "lena"]
_LAST = ["meyer", "okafor", "rossi", "tanaka", "novak", "silva", "berg", "haddad", "walsh", "kim", "moreau", "diaz"]
_DOMAINS = ["example.com", "mail.org", "shop.net", "post.com"]
_PRODUCTS = [("desk lamp", "LMP"), ("coffee grinder", "GRD"), ("wool blanket", "BLK"), ("bike light", "BIK"),
             ("tea kettle", "KTL"), ("notebook set", "NTB"), ("phone stand", "STD"), ("garden hose", "HSE")]
_STATUS = ["pending", "paid", "shipped", "delivered", "cancelled"]


def prompts(n: int) -> list[str]:
    """n distinct user messages describing an order in prose (deterministic)."""
    out = []
    for i in range(n):
        first, last = _FIRST[i % len(_FIRST)], _LAST[(3 * i + 1) % len(_LAST)]
        items = [_PRODUCTS[(i + k) % len(_PRODUCTS)] for k in range(1 + i % 3)]
        lines = ", ".join(f"{1 + (i + 2 * k) % 4} x {name} (SKU {code}-{100 + 37 * (i + k) % 900})"
                          for k, (name, code) in enumerate(items))
        out.append(
            f"Hello, this is {first.title()} {last.title()} ({first}.{last}@{_DOMAINS[i % len(_DOMAINS)]}, "
            f"phone +1 {200 + i % 700:03d}-555-{1000 + 17 * i % 9000:04d}). On 2024-{1 + i % 12:02d}-{1 + i % 28:02d} "
            f"I placed order ORD-{10000 + 7919 * i % 90000:05d}: {lines}. It shows as {_STATUS[i % len(_STATUS)]}; "
            f"how urgent it is for me, on a scale of 1 to 5: {1 + i % 5}.\n\n"
            f"Write down this order's record: order id, customer name and email, status, priority, the items with "
            f"their SKU and quantity, the order date and the phone number.")
    return out


@dataclass
class StructuredBenchConfig:
    model: str
    device: str | None = "cpu"
    dtype: str = "auto"
    load_format: str = "auto"
    concurrency: tuple[int, ...] = (1, 16, 64)
    modes: tuple[str, ...] = MODES
    max_tokens: int = 128
    min_requests: int = 4
    max_num_batched_tokens: int = 2048
    block_size: int = 128
    kv_cache_memory_bytes: int | None = None
    threads: int | None = None                    # torch threads (None: torch's default)
    warmup_tokens: int = 8                        # per warm-up request (every mode at batch c, before the cells)
    schema: dict = field(default_factory=lambda: ORDER_SCHEMA)
    regex: str = RECORD_REGEX


def structured_outputs(mode: str, cfg: StructuredBenchConfig) -> dict | None:
    return {"none": None, "json_schema": {"json": cfg.schema}, "regex": {"regex": cfg.regex},
            "json_object": {"json_object": True}}[mode]


def _validator(mode: str, cfg: StructuredBenchConfig):
    """text -> valid?, and the name of what checks it."""
    if mode == "regex":
        pattern = re.compile(cfg.regex)
        return (lambda t: pattern.fullmatch(t) is not None), "re.fullmatch"

    def loads(t):
        try:
            return json.loads(t), True
        except ValueError:
            return None, False

    if mode == "json_object":
        return (lambda t: (lambda v, ok: ok and isinstance(v, dict))(*loads(t))), "json.loads -> dict"
    try:
        import jsonschema
    except ImportError:        # structure only
        return (lambda t: (lambda v, ok: ok and isinstance(v, dict))(*loads(t))), "json.loads (jsonschema missing)"
    checker = jsonschema.Draft202012Validator(cfg.schema)
    return (lambda t: (lambda v, ok: ok and checker.is_valid(v))(*loads(t))), "json.loads + jsonschema"


class _MaskTimer:
    """Wraps the engine's bitmask builder (host fill) and, on the CPU, the sampler's mask apply; the engine is
    unchanged. `restore()` puts the sampler's function back."""

    def __init__(self, engine, time_apply: bool):
        import openinfer.sampling.sampler as sampler_mod

        self.fill_s = self.apply_s = 0.0
        self.fill_steps = self.rows = self.apply_calls = 0
        so = engine.structured_output
        inner = so.bitmask

        def bitmask(requests, drafts=None):
            t0 = time.perf_counter()
            out = inner(requests, drafts)
            if out is not None:
                self.fill_s += time.perf_counter() - t0
                self.fill_steps += 1
                self.rows += out.mask.shape[0]
            return out

        so.bitmask = bitmask
        self._sampler_mod, self._apply = sampler_mod, sampler_mod.apply_token_bitmask
        if time_apply:
            apply = self._apply

            def timed_apply(logits, mask):
                t0 = time.perf_counter()
                apply(logits, mask)
                self.apply_s += time.perf_counter() - t0
                self.apply_calls += 1

            sampler_mod.apply_token_bitmask = timed_apply
        self.time_apply = time_apply

    def snapshot(self) -> tuple:
        return self.fill_s, self.fill_steps, self.rows, self.apply_s, self.apply_calls

    def restore(self) -> None:
        self._sampler_mod.apply_token_bitmask = self._apply


def _compile_times(llm, cfg: StructuredBenchConfig) -> dict:
    """Cold (pool cache empty) vs cached submission of each structured mode's grammar to the engine's pool."""
    from openinfer.sampling_params import SamplingParams

    t0 = time.perf_counter()
    pool = llm.engine.structured_output.pool     # built here: the engine's first constrained request would
    out = {"pool_setup_ms": 1000 * (time.perf_counter() - t0)}
    for mode in cfg.modes:
        so = structured_outputs(mode, cfg)
        if so is None:
            continue
        params = SamplingParams(structured_outputs=so).structured_outputs
        n0, k0 = pool.num_compiles, len(pool.compile_seconds)
        t0 = time.perf_counter()
        pool.compile_blocking(params)
        cold = time.perf_counter() - t0
        n1 = pool.num_compiles
        t0 = time.perf_counter()
        pool.compile_blocking(params)
        cached = time.perf_counter() - t0
        out[mode] = {"cold_ms": 1000 * cold, "cached_ms": 1000 * cached,
                     "compile_ms": 1000 * pool.compile_seconds[k0] if len(pool.compile_seconds) > k0 else None,
                     "compiles_cold": n1 - n0, "compiles_cached": pool.num_compiles - n1}
    return out


def _run_cell(llm, timer: _MaskTimer, texts: list[str], mode: str, cfg: StructuredBenchConfig) -> dict:
    from openinfer.sampling_params import SamplingParams

    so = structured_outputs(mode, cfg)
    params = SamplingParams(temperature=0.0, max_tokens=cfg.max_tokens, structured_outputs=so)
    before = timer.snapshot()
    load0 = os.getloadavg()[0]
    cpu0 = time.process_time()
    start = time.perf_counter()
    if llm.tokenizer.chat_template or llm.tokenizer.is_deepseek:
        outs = llm.chat([[{"role": "user", "content": t}] for t in texts], params, use_tqdm=False)
    else:   # a dummy model dir without a chat template: the message as a raw prompt
        outs = llm.generate(texts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu0
    fill_s, fill_steps, rows, apply_s, apply_calls = (a - b for a, b in zip(timer.snapshot(), before))
    comp = [o.outputs[0] for o in outs]
    n_out = sum(len(c.token_ids) for c in comp)
    tpots = [(o.metrics.finished_time - o.metrics.first_token_time) / (len(c.token_ids) - 1)
             for o, c in zip(outs, comp) if len(c.token_ids) > 1 and o.metrics.finished_time is not None]
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs if o.metrics.first_token_time]
    row = {
        "mode": mode, "num_requests": len(texts), "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
        "output_tokens": n_out, "mean_output_tokens": n_out / len(comp), "elapsed_s": elapsed,
        "output_tok_per_s": n_out / elapsed,
        # this process's CPU seconds (all its threads): less sensitive than wall time to other jobs on the host
        "cpu_s": cpu, "output_tok_per_cpu_s": n_out / cpu if cpu > 0 else None,
        "tpot_ms": 1000 * sum(tpots) / len(tpots) if tpots else None,
        "ttft_ms": 1000 * sum(ttfts) / len(ttfts) if ttfts else None,
        "finish_reasons": {r: sum(c.finish_reason == r for c in comp) for r in sorted({c.finish_reason for c in comp})},
        "finished_length": sum(c.finish_reason == "length" for c in comp),
        "mask_fill_steps": fill_steps, "mask_rows": rows, "mask_fill_ms": 1000 * fill_s,
        "mask_fill_us_per_row": 1e6 * fill_s / rows if rows else None,
        "mask_fill_frac_of_wall": fill_s / elapsed,
        "mask_apply_ms": 1000 * apply_s if timer.time_apply else None,
        "mask_apply_us_per_call": 1e6 * apply_s / apply_calls if timer.time_apply and apply_calls else None,
        # host fill + (CPU) apply per step that had a mask: the part of TPOT the mask itself costs
        "mask_ms_per_step": 1000 * (fill_s + apply_s) / fill_steps if fill_steps else None,
        "loadavg_1m": [load0, os.getloadavg()[0]],
    }
    if so is not None:
        valid, row["validated_with"] = _validator(mode, cfg)
        ok = [valid(c.text) for c in comp]
        row["valid"] = sum(ok)
        # an output that ended by EOS in an accepting state (or any way but max_tokens) must be valid
        row["invalid_not_length"] = sum(not v and c.finish_reason != "length" for v, c in zip(ok, comp))
        row["sample_output"] = comp[0].text
    return row


def run_structured_bench(cfg: StructuredBenchConfig, log=print) -> dict:
    import torch

    from openinfer.entrypoints.llm import LLM
    from openinfer.sampling_params import SamplingParams

    for m in cfg.modes:
        if m not in MODES:
            raise ValueError(f"unknown mode {m!r}; known: {list(MODES)}")
    if "none" not in cfg.modes:
        raise ValueError("modes must include 'none' (the baseline)")
    if cfg.max_tokens < 2:
        raise ValueError("max_tokens must be >= 2 (TPOT needs two tokens)")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    result = {"config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(cfg).items()},
              "concurrency_semantics": "engine max_num_seqs = c, all of a cell's max(c, min_requests) requests "
                                       "submitted at once (continuous batching); one engine per c shared by every "
                                       "mode (same options), modes run back to back (order reversed every other c) "
                                       "on the same prompts; greedy; prefix caching off; grammars compiled before "
                                       "the timed cells",
              "rows": [], "compile": []}
    t_start = time.perf_counter()
    for ci, c in enumerate(cfg.concurrency):
        texts = prompts(max(c, cfg.min_requests))
        t0 = time.perf_counter()
        llm = LLM(cfg.model, device=cfg.device, dtype=cfg.dtype, load_format=cfg.load_format, max_num_seqs=c,
                  max_num_batched_tokens=cfg.max_num_batched_tokens, block_size=cfg.block_size,
                  enable_prefix_caching=False, kv_cache_memory_bytes=cfg.kv_cache_memory_bytes)
        setup_s = time.perf_counter() - t0
        try:
            if "env" not in result:
                result["env"] = _env_info(str(llm.config.device))
                result["env"]["torch_threads"] = torch.get_num_threads()
                result["model"] = cfg.model
                result["dtype"] = str(llm.config.torch_dtype)
                result["vocab_size"] = llm.engine.model_config.vocab_size
            comp = _compile_times(llm, cfg)
            comp["concurrency"] = c
            result["compile"].append(comp)
            log(f"c={c} compile: " + ", ".join(f"{m} cold {v['cold_ms']:.1f} ms cached {v['cached_ms']:.3f} ms"
                                                for m, v in comp.items() if isinstance(v, dict)))
            timer = _MaskTimer(llm.engine, time_apply=not str(llm.config.device).startswith("cuda"))
            try:
                # warm-up: every mode at batch c on the cell's own prompts, a few tokens (the same prompt
                # lengths compile the same kernel variants: on CUDA, the prefill kernel's context splits)
                warm = texts
                for mode in cfg.modes:
                    p = SamplingParams(temperature=0, max_tokens=cfg.warmup_tokens,
                                       structured_outputs=structured_outputs(mode, cfg))
                    if llm.tokenizer.chat_template or llm.tokenizer.is_deepseek:
                        llm.chat([[{"role": "user", "content": w}] for w in warm], p, use_tqdm=False)
                    else:
                        llm.generate(warm, p, use_tqdm=False)
                order = list(cfg.modes) if ci % 2 == 0 else list(reversed(cfg.modes))
                for mode in order:
                    row = _run_cell(llm, timer, texts, mode, cfg)
                    row.update(concurrency=c, engine_setup_s=setup_s,
                               async_scheduling=llm.config.use_async_scheduling)
                    result["rows"].append(row)
                    log(_fmt_row(row))
            finally:
                timer.restore()
        finally:
            llm.shutdown()
    order = {m: i for i, m in enumerate(MODES)}
    result["rows"].sort(key=lambda r: (cfg.concurrency.index(r["concurrency"]), order[r["mode"]]))
    for row in result["rows"]:
        base = next(r for r in result["rows"] if r["mode"] == "none" and r["concurrency"] == row["concurrency"])
        if row["mode"] == "none":
            continue
        row["tok_per_s_vs_none"] = row["output_tok_per_s"] / base["output_tok_per_s"]
        row["tok_per_cpu_s_vs_none"] = (row["output_tok_per_cpu_s"] / base["output_tok_per_cpu_s"]
                                        if row["output_tok_per_cpu_s"] and base["output_tok_per_cpu_s"] else None)
        row["tpot_vs_none"] = row["tpot_ms"] / base["tpot_ms"] if row["tpot_ms"] and base["tpot_ms"] else None
        row["ttft_vs_none"] = row["ttft_ms"] / base["ttft_ms"] if row["ttft_ms"] and base["ttft_ms"] else None
        row["mask_share_of_tpot"] = (row["mask_ms_per_step"] / row["tpot_ms"]
                                     if row["mask_ms_per_step"] is not None and row["tpot_ms"] else None)
    structured = [r for r in result["rows"] if r["mode"] != "none"]
    result["structured_outputs"] = sum(r["num_requests"] for r in structured)
    result["valid"] = sum(r["valid"] for r in structured)
    result["finished_length"] = sum(r["finished_length"] for r in structured)
    result["invalid_not_length"] = sum(r["invalid_not_length"] for r in structured)
    result["total_s"] = time.perf_counter() - t_start
    return result


def _fmt_row(r: dict) -> str:
    v = f"valid {r['valid']}/{r['num_requests']} len {r['finished_length']}" if "valid" in r else ""
    return (f"c={r['concurrency']:<3d} {r['mode']:11s} n={r['num_requests']:<3d} out={r['output_tokens']:<5d} "
            f"{r['output_tok_per_s']:7.1f} tok/s TPOT {_f(r['tpot_ms'], '.1f')} ms TTFT {_f(r['ttft_ms'], '.0f')} ms "
            f"fill {_f(r['mask_fill_us_per_row'], '.0f')} us/row apply {_f(r['mask_apply_us_per_call'], '.0f')} us "
            f"{v}")


def markdown_table(result: dict) -> str:
    lines = ["| c | mode | requests | out tokens | out tok/s | vs none | tok/CPU-s vs none | TPOT ms | vs none | "
             "TTFT ms | valid | cut by length | mask fill µs/row | apply µs/step | mask ms/step | mask % of TPOT |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(
            f"| {r['concurrency']} | {r['mode']} | {r['num_requests']} | {r['output_tokens']} | "
            f"{r['output_tok_per_s']:.1f} | {_f(r.get('tok_per_s_vs_none'))} | {_f(r.get('tok_per_cpu_s_vs_none'))} | "
            f"{_f(r['tpot_ms'], '.1f')} | {_f(r.get('tpot_vs_none'))} | {_f(r['ttft_ms'], '.0f')} | "
            f"{r['valid'] if 'valid' in r else '-'} | {r['finished_length']} | "
            f"{_f(r['mask_fill_us_per_row'], '.0f')} | {_f(r['mask_apply_us_per_call'], '.0f')} | "
            f"{_f(r['mask_ms_per_step'], '.2f')} | "
            f"{_f(100 * r['mask_share_of_tpot'] if r.get('mask_share_of_tpot') is not None else None, '.1f')} |")
    modes = [m for m in MODES if any(isinstance(c.get(m), dict) for c in result["compile"])]
    lines += ["", "| grammar | cold ms (per engine) | compile ms (worker) | cached ms | compiles when cached |",
              "|---|---|---|---|---|"]
    for m in modes:
        cs = [c[m] for c in result["compile"]]
        cold = " / ".join(format(x["cold_ms"], ".1f") for x in cs)
        work = " / ".join(_f(x["compile_ms"], ".1f") for x in cs)
        cached = " / ".join(format(x["cached_ms"], ".3f") for x in cs)
        lines.append(f"| {m} | {cold} | {work} | {cached} | {sum(x['compiles_cached'] for x in cs)} |")
    setup = " / ".join(format(c["pool_setup_ms"], ".0f") for c in result["compile"])
    lines.append(f"| (pool setup) | {setup} | | | |")
    return "\n".join(lines)


def add_cli_args(p) -> None:
    p.add_argument("--model", default=None, help="default: the engine's default model (SmolLM2-135M-Instruct)")
    p.add_argument("--tokenizer-json", default=None, metavar="PATH",
                   help="instead of --model: a Llama-3-8B-shaped model dir with this tokenizer.json "
                        "(benchmarks/gpu_llama8b.py's model_dir; use with --load-format dummy)")
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="dummy: random weights (the outputs are garbage, but inside the grammar)")
    p.add_argument("--concurrency", default="1,16,64", help="comma-separated requests in flight (max_num_seqs)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {list(MODES)} (none required)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--min-requests", type=int, default=4, help="requests per cell: max(concurrency, this)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--result-json", default=None)
    p.add_argument("--markdown", action="store_true", help="also print the results as Markdown tables")


def _llama_model_dir(tokenizer_json: str) -> str:
    """benchmarks/gpu_llama8b.py's model_dir (a script of the repo checkout, not of the package)."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_llama8b.py"
    if not script.is_file():
        raise ValueError(f"--tokenizer-json needs {script} (a repo checkout); otherwise pass --model DIR")
    spec = importlib.util.spec_from_file_location("_gpu_llama8b", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return str(mod.model_dir(tokenizer_json))


def cli_main(args) -> int:
    from openinfer.config import DEFAULT_MODEL

    if args.tokenizer_json and args.model:
        raise ValueError("give --model or --tokenizer-json, not both")
    model = _llama_model_dir(args.tokenizer_json) if args.tokenizer_json else (args.model or DEFAULT_MODEL)
    cfg = StructuredBenchConfig(
        model=model, device=args.device, dtype=args.dtype, load_format=args.load_format,
        concurrency=_ints(args.concurrency), modes=tuple(m for m in args.modes.split(",") if m),
        max_tokens=args.max_tokens, min_requests=args.min_requests,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes, threads=args.threads)
    result = run_structured_bench(cfg, log=lambda s: print(s, flush=True))
    result["command"] = " ".join(["openinfer"] + sys.argv[1:]) if sys.argv else None
    print(f"structured outputs: {result['valid']}/{result['structured_outputs']} valid, "
          f"{result['finished_length']} cut by max_tokens, {result['invalid_not_length']} invalid otherwise; "
          f"total {result['total_s']:.0f}s")
    if args.markdown:
        print(markdown_table(result))
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=2)
    if result["invalid_not_length"]:
        print("openinfer bench structured: a structured output that was not cut by max_tokens fails validation "
              "(see invalid_not_length in the rows)", file=sys.stderr)
        return 1
    return 0
