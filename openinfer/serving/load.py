"""What an engine server tells the router (`GET /load`, docs/serving.md), and the prefill role's request cap.

The router's balancers (serving/balancers.py) read these numbers; they follow DeepInfer's load balancers
(spec 003 §1.1-1.2): the prefill side sizes work by uncached prompt tokens and a compute-quota measure, the
decode side by request count and total KV length.

- `BusyMeter`: the compute-quota proxy, the fraction of the last `window_s` seconds the engine thread spent
  in steps. It hears of each step after it ran (`AsyncLLMEngine`'s on_step), so a step is timed from the
  previous one when the engine went straight on, and at the recent steps' mean length after idle time.
- `engine_load`: one JSON snapshot (role, model, requests, KV blocks and tokens, queued uncached prefill
  tokens, busy fraction, the prefix-KV store's namespace). Read from the server's event loop while the engine
  thread runs: each number is a consistent-enough sample, not a transaction.
- `prefill_body`: a request as a `prefill` instance runs it: one output token.
"""

from __future__ import annotations

import threading
import time
from collections import deque

ROLES = ("both", "prefill", "decode", "encoder")     # encoder: the vision tower alone (encoder_server.py)


class BusyMeter:
    def __init__(self, window_s: float = 10.0):
        self.window_s = window_s
        self._steps: deque[tuple[float, float]] = deque()    # (end time, seconds busy)
        self._last_end: float | None = None
        self._last_had_work = False
        self._mean_step = 0.0
        self._lock = threading.Lock()

    def on_step(self, has_more_work: bool, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            if self._last_end is not None and self._last_had_work:
                busy = now - self._last_end             # the loop went straight from that step into this one
                self._mean_step = busy if self._mean_step == 0 else 0.9 * self._mean_step + 0.1 * busy
            else:                                       # after idle: its start is unknown
                busy = self._mean_step if self._last_end is None else min(self._mean_step, now - self._last_end)
            self._steps.append((now, busy))
            self._last_end, self._last_had_work = now, has_more_work
            self._trim(now)

    def record(self, busy_s: float, now: float | None = None) -> None:
        """A piece of work of known length that just ended (the encoder role times each image itself)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._steps.append((now, busy_s))
            self._trim(now)

    def fraction(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._trim(now)
            return min(1.0, sum(b for _, b in self._steps) / self.window_s)

    def _trim(self, now: float) -> None:
        while self._steps and self._steps[0][0] < now - self.window_s:
            self._steps.popleft()


def _requests(engine) -> list | None:
    """The engine's live Request objects; None for the multi-process front end (they live in the ranks)."""
    if not hasattr(engine, "scheduler"):
        return None
    reqs = engine.requests
    for _ in range(3):
        try:
            return list(reqs.values())
        except RuntimeError:         # changed size while copied (engine thread): try again
            continue
    return []


def engine_load(engine, async_engine, role: str, model: str, busy: BusyMeter) -> dict:
    st = engine.stats()
    block_size = engine.config.block_size
    used = st["kv_blocks_total"] - st["kv_blocks_free"]
    reqs = _requests(engine)
    patches = 0                      # image patches of spans not computed yet (the encoder's work in flight)
    if reqs is None:                 # DP front end: blocks in use stand for tokens; queued prefill unknown
        kv_tokens, prefill_queued = used * block_size, 0
    else:
        kv_tokens = prefill_queued = 0
        for r in reqs:
            computed = max(r.num_computed_tokens, 0)
            kv_tokens += computed
            prefill_queued += max(r.num_prompt_tokens - computed, 0)
            patches += sum(img.num_patches for img in r.images if img.end > computed)
    namespace = engine.kv_store_namespace()
    return {
        "role": role, "model": model,
        "num_requests_running": st["num_running"],
        "num_requests_waiting": async_engine.num_waiting,
        "kv_blocks_total": st["kv_blocks_total"],
        "kv_blocks_used": used,
        "block_size": block_size,
        "kv_tokens": kv_tokens,
        "kv_capacity_tokens": st["kv_blocks_total"] * block_size,
        "prefill_tokens_queued": prefill_queued,
        "image_patches_in_flight": patches,
        "busy_fraction": round(busy.fraction(), 4),
        "busy_window_s": busy.window_s,
        # the shared tier's namespace (None: no directory / Redis tier): instances that should hand KV over
        # through the store must report the same one
        "kv_store_namespace": namespace,
        "prefix_cache_store_hit_tokens": st.get("prefix_cache_store_hit_tokens", 0),
        "prefix_cache_hit_tokens": st.get("prefix_cache_hit_tokens", 0),
        "max_model_len": engine.max_model_len,
        # vision models: spans its own tower encoded, and spans whose rows came from encoder instances (EPD)
        **{k: st[k] for k in ("images_encoded", "images_given") if k in st},
    }


# body fields that name the output length, per route
_MAX_TOKENS = {"/v1/chat/completions": ("max_tokens", "max_completion_tokens"),
               "/v1/completions": ("max_tokens",), "/v1/messages": ("max_tokens",),
               "/v1/responses": ("max_output_tokens",)}


def prefill_body(path: str, body: dict, stream: bool | None = None) -> dict:
    """The request as a prefill instance runs it: one output token (enough to compute and save every full
    block of the prompt); min_tokens dropped (it would contradict the cap), and n / best_of (one sequence
    computes the prompt, which is all a prefill is for); `stream` False: not streamed (the router's step 1), None:
    as asked."""
    names = _MAX_TOKENS[path]
    drop = set(names[1:]) | {"min_tokens", "n", "best_of"}
    if stream is False:
        drop |= {"stream", "stream_options"}
    out = {k: v for k, v in body.items() if k not in drop}
    out[names[0]] = 1
    return out
