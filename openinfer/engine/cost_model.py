"""Step cost model for time-budgeted chunked prefill (spec `003_…txt` §1.1, level 4 of the prefill balancer).

A forward step's time is modelled as a sum over its sequences of

    cost(q, c) = a·q² + b·q·c + d·q            (q new tokens over c tokens already in the cache)

plus a fixed per-step cost e: `a·q²` is attention among the new tokens, `b·q·c` their attention to the cached
context, `d·q` the per-token work (projections, MLP/experts), `e` the launch / host / head overhead. A decode
row is q = 1. The coefficients are fitted by least squares on a short calibration run on the real model and
device (`calibrate`), saved beside the model's converted files, and refitted on demand (`openinfer calibrate`).

With `EngineConfig.prefill_step_budget_ms` the scheduler gives each step a time budget instead of a token
budget: the decodes' cost is taken first, then each prefill chunk is the largest q whose cost fits what is left
(the quadratic solved for q), so a long prompt's chunks shrink as its context grows and decodes keep their
inter-token latency.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class StepCostModel:
    a: float      # ms per q² (new-token attention)
    b: float      # ms per q·c (attention to the cached context)
    d: float      # ms per new token
    e: float      # ms per step

    def seq_cost(self, q: int, c: int) -> float:
        return self.a * q * q + self.b * q * c + self.d * q

    def step_cost(self, seqs: list[tuple[int, int]]) -> float:
        """Predicted ms of one step over (new tokens, cached context) per sequence."""
        return self.e + sum(self.seq_cost(q, c) for q, c in seqs)

    def max_tokens(self, budget_ms: float, c: int) -> int:
        """The largest q with seq_cost(q, c) <= budget_ms (0 if not even one token fits)."""
        if budget_ms <= 0:
            return 0
        lin = self.b * c + self.d
        if self.a > 0:
            q = (-lin + math.sqrt(lin * lin + 4 * self.a * budget_ms)) / (2 * self.a)
        elif lin > 0:
            q = budget_ms / lin
        else:
            return 1 << 30
        q = int(q)
        while q > 0 and self.seq_cost(q, c) > budget_ms:    # float rounding at the boundary
            q -= 1
        return q

    # ---- persistence ----------------------------------------------------------------------------------
    def save(self, path: Path, meta: dict) -> None:
        path.write_text(json.dumps({"coefficients_ms": asdict(self), **meta}, indent=1))

    @classmethod
    def load(cls, path: Path) -> "StepCostModel":
        return cls(**json.loads(path.read_text())["coefficients_ms"])


def fit(samples: list[tuple[list[tuple[int, int]], float]]) -> tuple[StepCostModel, float]:
    """Least squares over steps (sequences as (q, c), measured ms) with non-negative coefficients (a
    coefficient the data would make negative is dropped and the rest refitted). Returns the model and the
    relative RMS error of its predictions."""
    rows = np.array([[sum(q * q for q, _ in s), sum(q * c for q, c in s), sum(q for q, _ in s), 1.0]
                     for s, _ in samples])
    y = np.array([ms for _, ms in samples])
    keep = list(range(4))
    while True:
        coef, *_ = np.linalg.lstsq(rows[:, keep], y, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            break
        keep.pop(int(np.argmin(coef)))
    full = np.zeros(4)
    full[keep] = np.clip(coef, 0, None)
    model = StepCostModel(*map(float, full))
    pred = rows @ full
    return model, float(np.sqrt(np.mean(((pred - y) / y) ** 2)))


def calibrate(engine, prompt_lengths=None, contexts=None, repeats: int = 2) -> dict:
    """Time single-sequence prefill steps of q new tokens over c cached ones (the cached context comes from a
    prefix-cache hit on a first request) and decode steps, on the engine's real model; fit the model.
    Default shapes: on the CPU q in (16, 128, 512), c in (0, 512); on a GPU, where a step under ~1K tokens is
    mostly fixed cost, q up to 4,096 and c up to 8,192 (an H200 fit on the CPU's shapes had a 124% error), each
    shape run once untimed first (kernel compiles and autotuning are not step costs).
    Returns {"model": StepCostModel, "rel_rms_error": float, "samples": [...]}."""
    from openinfer.sampling_params import SamplingParams

    on_gpu = engine.runner.device.type == "cuda"
    if prompt_lengths is None:
        prompt_lengths = (64, 512, 1024, 2048, 4096) if on_gpu else (16, 128, 512)
    if contexts is None:
        contexts = (0, 2048, 8192) if on_gpu else (0, 512)

    limit = min(engine.max_model_len - 2, engine.config.max_num_batched_tokens)
    bs = engine.config.block_size
    rng = np.random.default_rng(0)
    vocab = engine.model_config.vocab_size
    samples = []

    def timed_step() -> float:
        t = time.perf_counter()
        engine.step()
        _sync(engine)
        return (time.perf_counter() - t) * 1e3

    for c in contexts:
        c = c // bs * bs                       # hits are whole blocks
        for q in prompt_lengths:
            if c + q > engine.max_model_len - 2 or q > limit:
                continue
            for rep in range(repeats + on_gpu):
                prefix = rng.integers(10, vocab - 1, size=c).tolist()
                if c:
                    engine.add_request(prefix + [1], SamplingParams(max_tokens=1))
                    while engine.has_unfinished_requests():
                        engine.step()
                rid = engine.add_request(prefix + rng.integers(10, vocab - 1, size=q).tolist(),
                                         SamplingParams(max_tokens=2, ignore_eos=True))
                ms = timed_step()               # the whole (q, c) prefill in one step (q <= the token budget)
                dec = timed_step()              # one decode row at context c + q
                if not (on_gpu and rep == 0):  # the warm-up run of this shape
                    samples.append(([(q, c)], ms))
                    samples.append(([(1, c + q)], dec))
                engine.abort_request(rid)
                while engine.has_unfinished_requests():
                    engine.step()
    model, err = fit(samples)
    return {"model": model, "rel_rms_error": err, "samples": samples}


def _sync(engine) -> None:
    import torch

    dev = engine.runner.device
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def cost_model_path(cache_dir: Path, model_dir: Path, device: str, dtype: str) -> Path:
    """Where a model's fitted step cost lives in the openinfer cache: per model directory, device kind and dtype
    (a user's model directory may not be writable)."""
    import hashlib

    import torch

    where = torch.cuda.get_device_name(0).replace(" ", "_") if device.startswith("cuda") else "cpu"
    key = hashlib.sha1(str(Path(model_dir).resolve()).encode()).hexdigest()[:10]
    return Path(cache_dir) / "step_cost" / f"{Path(model_dir).name}-{key}-{where}-{dtype}.json"


def load_or_calibrate(engine, refit: bool = False) -> tuple[StepCostModel, Path]:
    """The engine's saved step cost, or a fresh calibration saved for next time (one process only: ranks
    of a multi-process engine must schedule from the same file, see EngineConfig.prefill_step_budget_ms)."""
    import sys

    cfg = engine.config
    path = cost_model_path(cfg.cache_path, engine.model_dir, cfg.device, str(cfg.torch_dtype).split(".")[-1])
    if path.exists() and not refit:
        return StepCostModel.load(path), path
    if engine.parallel.is_distributed:
        raise ValueError(f"prefill_step_budget_ms with several ranks needs a calibrated step cost at {path}: run "
                         f"`openinfer calibrate` with the same model, device and dtype first")
    print("[openinfer] calibrating the step cost model (once per model, device and dtype) ...", file=sys.stderr,
          flush=True)
    result = calibrate(engine)
    path.parent.mkdir(parents=True, exist_ok=True)
    result["model"].save(path, {"model_dir": str(engine.model_dir), "device": cfg.device,
                                "rel_rms_error": result["rel_rms_error"], "num_samples": len(result["samples"]),
                                "date": time.strftime("%Y-%m-%d")})
    return result["model"], path
