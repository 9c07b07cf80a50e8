"""EPD vs local encoding on loopback (docs/vision.md): what sending images to a vision-encoder instance costs and
gives, on one machine.

Starts a vision-encoder instance (`openinfer serve MODEL --role encoder`) and two `both` instances of the same
engine options, one sending its images there (`--encoder URL`) and one encoding its own, then measures:

1. **One image, by hand** (the image as a server would plan it: deepseek-recipe's resize, the model's patches): the
   tower's time in this process; `POST /v1/encode` to the encoder instance when it computes the rows (miss) and when
   its cache holds them (hit: the transfer alone, serialization and HTTP on loopback included); the bytes each way.
2. **Serving**: `openinfer bench serve --prompt-mode image` (a prompt + one generated image per request, a different
   image each, new in every round) against each `both` instance, in alternating rounds: TTFT, end-to-end latency,
   throughput; and where each instance's images were encoded (its `/load`).

On a machine whose cores the encoder instance shares with the engine (this CPU), EPD cannot be faster: what it
shows is the transfer's cost against the encoding it moves. The load average is recorded beside the numbers.

    python benchmarks/epd_loopback.py --model deepseek-v41-tiny --device cpu --image-size 672x448 \\
        --num-prompts 8 --max-concurrency 2 --threads 1 --out benchmarks/results/cpu_epd_loopback.json
    python benchmarks/epd_loopback.py --device cuda --image-size 1344x1344 --num-prompts 16 --max-concurrency 4 \\
        --engine-args "--max-num-seqs 8 --num-kv-blocks 256"      # three processes share the GPU: a fixed KV pool
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import torch


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return "unknown"


def planned_image(model, config, size: tuple[int, int], seed: int):
    """The image span a server would make of a generated `size` picture (deepseek-recipe's plan, the patches)."""
    import base64

    import deepseek_recipe as dr

    from openinfer.benchmarks.serve import image_data_url
    from openinfer.serving.images import ImageInputs

    data = base64.b64decode(image_data_url(*size, seed).split(",", 1)[1])
    processor = model.family.image_processor(model.hf_config)
    inputs = ImageInputs(config, processor, model.name)
    return inputs.expand([dr.BytesImageSource(data)], [processor.image_token_id])[1][0]


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def one_image(args, encoder_url: str) -> dict:
    """The tower here vs a round trip to the encoder instance, for one image."""
    from openinfer.config import EngineConfig
    from openinfer.models.registry import resolve
    from openinfer.serving.encoder_wire import (DIGEST_HEADER, ENCODE_PATH, pack_embeds, pack_image, unpack_embeds,
                                                unpack_image)

    config = EngineConfig(model=args.model, device=args.device)
    model = resolve(config)
    image = planned_image(model, config, args.size, seed=987)
    tower = model.family.build_image_encoder(model, config, torch.device(args.device))
    local = timed(lambda: tower.embed_image(image).cpu(), args.repeats)      # (to the host, as the server sends)
    rows = tower.embed_image(image).cpu()
    body = pack_image(image)
    pack_s = timed(lambda: pack_image(image), args.repeats)
    unpack_s = timed(lambda: unpack_image(body, None), args.repeats)
    answer = pack_embeds(rows)

    def post() -> httpx.Response:
        r = client.post(encoder_url + ENCODE_PATH, content=body, headers={DIGEST_HEADER: image.digest.hex()})
        r.raise_for_status()
        return r

    with httpx.Client(timeout=600) as client:
        warm = pack_image(planned_image(model, config, args.size, seed=986))     # the encoder's first call, untimed
        client.post(encoder_url + ENCODE_PATH, content=warm).raise_for_status()
        t = time.perf_counter()
        first = post()
        miss = time.perf_counter() - t
        assert first.headers["x-encoder-cache"] == "miss"
        hits = timed(post, args.repeats)
        same = torch.equal(unpack_embeds(first.content, image), rows)
    return {"patches": image.num_patches, "span_tokens": image.num_tokens, "grid": list(image.grid),
            "request_bytes": len(body), "response_bytes": len(answer), "rows_dtype": str(rows.dtype),
            "rows_equal_local": same,
            "local_encode_ms": 1e3 * statistics.median(local),
            "remote_miss_ms": 1e3 * miss,
            "remote_hit_ms": 1e3 * statistics.median(hits),
            "pack_image_ms": 1e3 * statistics.median(pack_s), "unpack_image_ms": 1e3 * statistics.median(unpack_s)}


def serve_run(args, base_url: str, seed: int) -> dict:
    """One `bench serve --prompt-mode image` run (`seed`: its images, new to every cache)."""
    from openinfer.benchmarks.serve import ServeBenchConfig, run_serve_bench

    cfg = ServeBenchConfig(base_url=base_url, endpoint="chat", num_prompts=args.num_prompts,
                           max_concurrency=args.max_concurrency, input_len=args.input_len,
                           output_len=args.output_len, seed=seed, prompt_mode="image", image_size=args.image_size,
                           ignore_eos=True)
    before = httpx.get(base_url + "/load", timeout=10).json()
    result = run_serve_bench(cfg, quiet=True)
    load = httpx.get(base_url + "/load", timeout=10).json()
    keep = ("completed", "failed", "errors", "duration_s", "input_tokens", "output_tokens", "request_throughput",
            "output_throughput", "ttft_ms", "e2e_ms", "tpot_ms", "engine")
    return {**{k: result[k] for k in keep}, "load_average": os.getloadavg(),
            "images_encoded_here": load["images_encoded"] - before["images_encoded"],
            "images_from_encoders": load["images_given"] - before["images_given"]}


def main() -> None:
    from openinfer.benchmarks.soak import serve_process

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="deepseek-v41-tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--image-size", default="672x448", help="WxH pixels of the generated images")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-concurrency", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2, help="serving runs per instance, alternating")
    ap.add_argument("--threads", type=int, default=0, help="torch threads here and in each server (0: as is)")
    ap.add_argument("--engine-args", default="--max-num-seqs 4 --max-num-batched-tokens 512",
                    help="more `openinfer serve` flags for both `both` instances")
    ap.add_argument("--out", default=None, help="JSON here (default benchmarks/results/<device>_epd_loopback.json)")
    args = ap.parse_args()
    from openinfer.benchmarks.serve import image_dims

    args.size = image_dims(args.image_size)
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)     # the servers' processes
    load_before = os.getloadavg()
    logs = tempfile.mkdtemp(prefix="openinfer-epd-")
    common = [args.model, "--device", args.device, *args.engine_args.split()]
    with serve_process([args.model, "--device", args.device, "--role", "encoder"], f"{logs}/encoder.log") as (enc, _):
        single = one_image(args, enc)
        print(f"one image ({single['patches']} patches, {single['span_tokens']} positions): tower here "
              f"{single['local_encode_ms']:.1f} ms; to the encoder: {single['remote_miss_ms']:.1f} ms computed there, "
              f"{single['remote_hit_ms']:.1f} ms from its cache (the transfer: {single['request_bytes']} B out, "
              f"{single['response_bytes']} B back)", flush=True)
        serving: dict[str, list[dict]] = {"local": [], "epd": []}
        with serve_process(common, f"{logs}/local.log") as (local, _), \
                serve_process([*common, "--encoder", enc], f"{logs}/epd.log") as (epd, _):
            for r in range(args.rounds):            # alternating, so a busy spell of the machine hits both
                for name, base in (("local", local), ("epd", epd)):
                    s = serve_run(args, base, seed=1 + r)
                    serving[name].append(s)
                    print(f"round {r} {name:5s}: {s['completed']}/{args.num_prompts} in {s['duration_s']:.1f} s, "
                          f"TTFT p50 {s['ttft_ms']['p50']:.0f} ms mean {s['ttft_ms']['mean']:.0f} ms, e2e p50 "
                          f"{s['e2e_ms']['p50']:.0f} ms, {s['request_throughput']:.2f} req/s; images encoded here "
                          f"{s['images_encoded_here']}, from encoders {s['images_from_encoders']}", flush=True)
    result = {
        "benchmark": "epd_loopback", "date": datetime.date.today().isoformat(), "commit": _git_commit(),
        "device": args.device, "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
        "load_average_before": load_before, "load_average_after": os.getloadavg(), "model": args.model,
        "image_size": args.image_size, "engine_args": args.engine_args, "one_image": single, "serve": serving,
        "ttft_p50_epd_over_local": [e["ttft_ms"]["p50"] / lo["ttft_ms"]["p50"]
                                    for e, lo in zip(serving["epd"], serving["local"])],
        "logs": logs,
    }
    out = Path(args.out or Path(__file__).parent / "results" / f"{args.device}_epd_loopback.json")
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
