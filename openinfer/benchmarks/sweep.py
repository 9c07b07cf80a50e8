"""`openinfer bench sweep`: a serving sweep over concurrency with a Pareto picture, as DeepInfer publishes its results.

One server (started here with the engine options given, or a running one at --base-url) is loaded at each
concurrency in turn (`openinfer bench serve`'s client: a fixed input/output shape, EOS ignored), and each level is a
point: output tokens/s per GPU (throughput, the operator's axis) against output tokens/s per user (1 / TPOT, the
user's axis). The points of one run are one line of the picture; `--previous FILE` draws an earlier run's line
(another commit, another configuration) beside it. Writes `NAME.json` (every level's full serve result) and
`NAME.png` (matplotlib, the `plots` extra).
"""

from __future__ import annotations

import datetime
import json
import subprocess
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from openinfer.benchmarks.serve import ServeBenchConfig, run_serve_bench


@dataclass
class SweepConfig:
    concurrency: tuple[int, ...] = (1, 8, 32, 64, 128, 256)
    input_len: int = 1024
    output_len: int = 256
    prompts_per_stream: int = 2          # each level sends concurrency x this many prompts (at least 8)
    num_gpus: int = 1                    # the throughput axis is per GPU
    label: str = "openinfer"             # the line's name in the picture
    endpoint: str = "completions"
    seed: int = 0


def sweep(base_url: str, cfg: SweepConfig, model_name: str | None = None, quiet: bool = False) -> dict:
    """Load the server at each concurrency; one point per level."""
    points = []
    for c in cfg.concurrency:
        serve = ServeBenchConfig(base_url=base_url, endpoint=cfg.endpoint, model=model_name,
                                 num_prompts=max(8, c * cfg.prompts_per_stream), max_concurrency=c,
                                 input_len=cfg.input_len, output_len=cfg.output_len, seed=cfg.seed, ignore_eos=True)
        result = run_serve_bench(serve, quiet=True)
        tpot_ms = result["tpot_ms"]["p50"]
        point = {"concurrency": c, "completed": result["completed"], "failed": result["failed"],
                 "output_tok_s_per_gpu": result["output_throughput"] / cfg.num_gpus,
                 "output_tok_s_per_user": 1e3 / tpot_ms if tpot_ms > 0 else None,
                 "tpot_ms_p50": tpot_ms, "ttft_ms_p50": result["ttft_ms"]["p50"], "serve": result}
        points.append(point)
        if not quiet:
            print(f"c={c:4d}: {point['output_tok_s_per_gpu']:9.1f} output tok/s/GPU, "
                  f"{point['output_tok_s_per_user'] or 0:7.1f} tok/s/user (TPOT p50 {tpot_ms:.2f} ms), "
                  f"TTFT p50 {point['ttft_ms_p50']:.0f} ms, {result['failed']} failed", flush=True)
    return {"benchmark": "openinfer bench sweep", "date": datetime.date.today().isoformat(), "commit": _commit(),
            "config": asdict(cfg), "points": points}


def write(result: dict, out_dir: str | Path, name: str, previous: list[dict] = ()) -> list[Path]:
    """NAME.json and NAME.png in `out_dir`; `previous`: earlier sweeps drawn beside this one."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / f"{name}.json", out / f"{name}.png"
    result = {**result, "previous": [{"label": _label(p), "commit": p.get("commit"), "points": _xy(p)}
                                     for p in previous]}
    json_path.write_text(json.dumps(result, indent=1))
    plot([*previous, result], png_path)
    return [json_path, png_path]


def plot(sweeps: list[dict], path: Path) -> None:
    """Output tok/s per GPU against tok/s per user, one line per sweep (labelled with its commit)."""
    from openinfer.tools.plots import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 5), layout="constrained")
    for s in sweeps:
        xy = _xy(s)
        if not xy:
            continue
        ax.plot([p["x"] for p in xy], [p["y"] for p in xy], marker="o", label=_label(s))
        for p in xy:
            ax.annotate(f"c={p['c']}", (p["x"], p["y"]), textcoords="offset points", xytext=(4, 4), fontsize=7)
    first = sweeps[-1].get("config", {})
    ax.set_xlabel("output tokens/s per user (1 / TPOT p50)")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title(f"{first.get('input_len', '?')} in / {first.get('output_len', '?')} out, EOS ignored")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _xy(sweep_result: dict) -> list[dict]:
    if "points" in sweep_result and sweep_result["points"] and "x" in sweep_result["points"][0]:
        return sweep_result["points"]                  # an entry of "previous" (already reduced)
    return [{"c": p["concurrency"], "x": p["output_tok_s_per_user"], "y": p["output_tok_s_per_gpu"]}
            for p in sweep_result.get("points", ()) if p.get("output_tok_s_per_user")]


def _label(sweep_result: dict) -> str:
    label = sweep_result.get("label") or sweep_result.get("config", {}).get("label", "run")
    commit = sweep_result.get("commit")
    return f"{label} ({commit})" if commit else label


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def with_levels(cfg: SweepConfig, text: str) -> SweepConfig:
    """`--concurrency 1,8,32`: the levels, each >= 1."""
    try:
        levels = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--concurrency must be a comma list of integers, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency must list levels >= 1, got {text!r}")
    return replace(cfg, concurrency=levels)
