"""Serving benchmark: load an OpenAI-compatible server, report throughput, TTFT/TPOT/ITL percentiles and
goodput (requests/s meeting the TTFT and TPOT SLOs; the seeds judge serving by goodput, not raw throughput).

Works against any server with /v1/chat/completions or /v1/completions that streams with usage. `prompt_mode="image"`
(chat only): each prompt also carries one generated image of `image_size` pixels (random noise, a different one per
prompt, so no cache holds it), sent as a PNG data URL: the vision path's cost (encoding, image tokens) in the numbers.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np

_WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one had by "
          "word but not what all were we when your can said there use an each which she do how their if will up "
          "other about out many then them these so some her would make like him into time has look two more write "
          "go see number no way could people my than first water been call who oil its now find long down day did "
          "get come made may part").split()


@dataclass
class ServeBenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "chat"                 # chat | completions
    model: str | None = None
    num_prompts: int = 64
    max_concurrency: int | None = None
    request_rate: float | None = None      # Poisson arrivals per second; None with no concurrency: all at once
    input_len: int = 128                   # words (about one token each)
    output_len: int = 128
    seed: int = 0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    api_key: str | None = None
    ignore_eos: bool = False               # every request runs to output_len (the server must take ignore_eos)
    prompt_mode: str = "text"              # text | image: each prompt with one generated image (chat only)
    image_size: str | None = None          # "WxH" pixels (prompt_mode image)

    def __post_init__(self):
        if self.prompt_mode not in ("text", "image"):
            raise ValueError(f"prompt_mode must be 'text' or 'image', got {self.prompt_mode!r}")
        if self.prompt_mode == "image":
            if self.endpoint != "chat":
                raise ValueError("--prompt-mode image sends images in chat messages: use --endpoint chat")
            image_dims(self.image_size)
        elif self.image_size is not None:
            raise ValueError("--image-size is for --prompt-mode image")


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""
    content_chunks: int = 0
    usage_reported: bool = True

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


def image_dims(size: str | None) -> tuple[int, int]:
    """(width, height) of a "WxH" image size; ValueError naming the problem."""
    try:
        w, h = (int(x) for x in (size or "").lower().split("x"))
    except ValueError:
        raise ValueError(f"--image-size must be WxH pixels (e.g. 672x448), got {size!r}") from None
    if w < 1 or h < 1:
        raise ValueError(f"--image-size must be positive, got {size!r}")
    return w, h


def image_data_url(width: int, height: int, seed: int) -> str:
    """A PNG of random pixels as a data URL."""
    import base64
    import io

    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _prompts(cfg: ServeBenchConfig) -> list[str]:
    rng = random.Random(cfg.seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(cfg.input_len)) for _ in range(cfg.num_prompts)]


def _messages(cfg: ServeBenchConfig) -> list[list[dict]]:
    """Each prompt as a chat conversation (with its image in image mode; made before the clock starts)."""
    prompts = _prompts(cfg)
    if cfg.prompt_mode == "text":
        return [[{"role": "user", "content": p}] for p in prompts]
    w, h = image_dims(cfg.image_size)
    return [[{"role": "user", "content": [{"type": "text", "text": p}, {"type": "image_url", "image_url": {
        "url": image_data_url(w, h, cfg.seed * 100_003 + i)}}]}] for i, p in enumerate(prompts)]


async def _one(client: httpx.AsyncClient, cfg: ServeBenchConfig, prompt: str | list[dict]) -> RequestResult:
    if cfg.endpoint == "chat":
        url, body = "/v1/chat/completions", {"messages": prompt}
    else:
        url, body = "/v1/completions", {"prompt": prompt}
    body.update(model=cfg.model, max_tokens=cfg.output_len, temperature=0.0, stream=True,
                stream_options={"include_usage": True})
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    start = time.perf_counter()
    res, last, answered = RequestResult(ok=False), None, False
    try:
        async with client.stream("POST", url, json=body) as resp:
            answered = True
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = str(chunk["error"])
                    return res
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                choice = (chunk.get("choices") or [{}])[0]
                delta = choice.get("delta") or {}       # (a reasoning model's first tokens are its reasoning)
                text = choice.get("text") or delta.get("content") or delta.get("reasoning_content")
                if text:
                    res.content_chunks += 1
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2e = time.perf_counter() - start
        if res.output_tokens == 0:          # server sent no usage: assume one token per content chunk
            res.output_tokens, res.usage_reported = res.content_chunks, False
        res.ok = True
    except httpx.HTTPError as e:
        phase = "after the response began" if answered else "before any response"
        res.error = (f"{type(e).__name__}: {e}{_causes(e)} ({phase}, {res.content_chunks} chunks, "
                     f"{time.perf_counter() - start:.1f} s in)")
    return res


def _causes(e: BaseException) -> str:
    """What an httpx error wraps (anyio's BrokenResourceError around a ConnectionResetError, ...): a bare
    "ReadError: " says nothing of a connection reset."""
    chain, cause = [], e.__cause__ or e.__context__
    while cause is not None and len(chain) < 4:
        chain.append(f"{type(cause).__name__}: {cause}".rstrip(": "))
        cause = cause.__cause__ or cause.__context__
    return f" <- {' <- '.join(chain)}" if chain else ""


def _stats(xs: list[float]) -> dict:
    if not xs:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    a = np.asarray(xs) * 1e3
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99))}


_ENGINE_METRICS = ("openinfer:engine_steps_total", "openinfer:engine_step_seconds_total",
                   "openinfer:engine_prefill_steps_total", "openinfer:request_queue_time_seconds_sum",
                   "openinfer:request_queue_time_seconds_count", "openinfer:generation_tokens_total")


async def _scrape(client: httpx.AsyncClient) -> dict[str, float] | None:
    """The server's own counters (`/metrics`, summed over labels); None from a server without them."""
    try:
        r = await client.get("/metrics")
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{")[0].split(" ")[0]
        if name in _ENGINE_METRICS:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    if "openinfer:engine_steps_total" not in out:
        return None                     # not an openinfer server of this version
    return {k: out.get(k, 0.0) for k in _ENGINE_METRICS}    # (a series with no observation yet is absent: 0)


def _engine_view(before: dict | None, after: dict | None, duration_s: float) -> dict | None:
    """What the engine itself saw during the run (the deltas of its counters): its steps and their mean time,
    the steps that ran prefill, the mean time requests waited for a seat, how busy the loop was."""
    if before is None or after is None:
        return None
    d = {k: after[k] - before[k] for k in _ENGINE_METRICS}
    steps = d["openinfer:engine_steps_total"]
    queued = d["openinfer:request_queue_time_seconds_count"]
    return {"steps": int(steps), "prefill_steps": int(d["openinfer:engine_prefill_steps_total"]),
            "mean_step_ms": 1e3 * d["openinfer:engine_step_seconds_total"] / steps if steps else None,
            "step_busy_fraction": d["openinfer:engine_step_seconds_total"] / duration_s if duration_s else None,
            "mean_queue_ms": 1e3 * d["openinfer:request_queue_time_seconds_sum"] / queued if queued else None,
            "generated_tokens": int(d["openinfer:generation_tokens_total"])}


async def _run(cfg: ServeBenchConfig) -> dict:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=max(cfg.max_concurrency or cfg.num_prompts, 1))
    async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers, timeout=None, limits=limits) as client:
        if cfg.model is None:
            cfg.model = (await client.get("/v1/models")).json()["data"][0]["id"]
        prompts = _messages(cfg) if cfg.endpoint == "chat" else _prompts(cfg)
        before = await _scrape(client)
        sem = asyncio.Semaphore(cfg.max_concurrency or len(prompts))
        rng = np.random.default_rng(cfg.seed)

        async def limited(p) -> RequestResult:
            async with sem:
                return await _one(client, cfg, p)

        start = time.perf_counter()
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(limited(p)))
            if cfg.request_rate:
                await asyncio.sleep(float(rng.exponential(1.0 / cfg.request_rate)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        after = await _scrape(client)
    ok = [r for r in results if r.ok]
    good = [r for r in ok if (cfg.slo_ttft_ms is None or r.ttft * 1e3 <= cfg.slo_ttft_ms)
            and (cfg.slo_tpot_ms is None or r.tpot * 1e3 <= cfg.slo_tpot_ms)]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "config": asdict(cfg), "duration_s": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "input_tokens": sum(r.prompt_tokens for r in ok), "output_tokens": out_tokens,
        "token_counts_from_usage": all(r.usage_reported for r in ok),
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "goodput_req_s": len(good) / duration if (cfg.slo_ttft_ms or cfg.slo_tpot_ms) else None,
        "ttft_ms": _stats([r.ttft for r in ok]), "tpot_ms": _stats([r.tpot for r in ok if r.output_tokens > 1]),
        "itl_ms": _stats([x for r in ok for x in r.itl]), "e2e_ms": _stats([r.e2e for r in ok]),
        "engine": _engine_view(before, after, duration),
    }


def run_offline_reference(llm, cfg: ServeBenchConfig) -> dict:
    """The same prompts through `LLM` in this process (the engine alone, no server): output tok/s over the same
    span the client measures (first request in to last token out), all prompts submitted at once (the engine's
    max_num_seqs bounds the batch, as --max-concurrency bounds the server's)."""
    from openinfer.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=cfg.output_len, temperature=0.0, ignore_eos=cfg.ignore_eos)
    prompts = _messages(cfg) if cfg.endpoint == "chat" else _prompts(cfg)
    start = time.perf_counter()
    if cfg.endpoint == "chat":
        outs = llm.chat(prompts, params, use_tqdm=False)
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"duration_s": elapsed, "output_tokens": tokens, "output_throughput": tokens / elapsed,
            "input_tokens": sum(len(o.prompt_token_ids) for o in outs)}


def run_serve_bench(cfg: ServeBenchConfig, quiet: bool = False) -> dict:
    result = asyncio.run(_run(cfg))
    if not quiet:
        print(f"completed {result['completed']}/{cfg.num_prompts} in {result['duration_s']:.2f}s; "
              f"{result['request_throughput']:.2f} req/s, {result['output_throughput']:.1f} output tok/s"
              + (f", goodput {result['goodput_req_s']:.2f} req/s" if result["goodput_req_s"] is not None else ""))
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            s = result[key]
            print(f"  {key:8s} mean {s['mean']:8.1f}  p50 {s['p50']:8.1f}  p90 {s['p90']:8.1f}  p99 {s['p99']:8.1f}")
        eng = result["engine"]
        if eng is not None:
            print(f"  engine   {eng['steps']} steps ({eng['prefill_steps']} with prefill), mean step "
                  f"{_ms(eng['mean_step_ms'])}, busy {eng['step_busy_fraction']:.0%} of the run, mean queue time "
                  f"{_ms(eng['mean_queue_ms'])}")
        if result["errors"]:
            print("  errors:", result["errors"])
    return result


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f} ms"
