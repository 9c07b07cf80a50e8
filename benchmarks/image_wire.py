"""What an image costs on its way to a rank's process (docs/vision.md, "Images through the multi-process executor").

A request's image spans travel with its "add" message: to the engine-core process, and from there to the ranks of
the DP group that owns the request (a pipe, or a TCP connection to another host or a Ray actor). `ImageSpan`
pickles its tensors as bytes. This measures, for the image a server would plan of a `--image-size` picture (the
model's image processor: bf16 patches), the round trip of one "add"-like message to a child process and back (an
ack) through a `multiprocessing` pipe:

- `bytes`: the span as it travels (its tensors' bytes in the message);
- `shared memory`: its tensors sent as torch's multiprocessing reductions would send them (moved to shared memory,
  a file descriptor handed over through the sender's resource sharer: local processes only);
- the sha256 digest of the patches (what the ranks do not compute again: the digest travels).

    python benchmarks/image_wire.py --image-size 672x448 --out benchmarks/results/cpu_image_wire.json
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import numpy as np
import torch


def _echo(conn) -> None:
    while True:
        msg = conn.recv()
        if msg is None:
            return
        conn.send(len(msg[1]["images"]))


def _round_trips(conn, msg, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        conn.send(msg)
        conn.recv()
        out.append((time.perf_counter() - t) * 1e3)
    return out


class _SharedSpan:
    """The span's fields with its tensors left to torch's reductions (what pickling an ImageSpan would do without its
    own `__reduce__`)."""

    def __init__(self, span):
        self.fields = (span.offset, span.token_types, span.patches.clone(), span.grid, span.digest)

    def __len__(self):
        return 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--image-size", default="672x448")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    w, h = (int(x) for x in args.image_size.split("x"))
    from openinfer.models.deepseek_v41.family import DEEPSEEK_V41_TINY_CONFIG, FAMILY

    processor = FAMILY.image_processor(DEEPSEEK_V41_TINY_CONFIG)      # V4.1's patch size and Aligner
    pixels = np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)
    _, (span,) = processor.expand([processor.image_token_id], [pixels])
    add = ("add", {"prompt_token_ids": [1] * span.num_tokens, "images": (span,)})
    ctx = mp.get_context("forkserver")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_echo, args=(child,), daemon=True)
    p.start()
    try:
        _round_trips(parent, add, 3)
        as_bytes = _round_trips(parent, add, args.repeats)
        shared = [_round_trips(parent, ("add", {"images": _SharedSpan(span)}), 1)[0] for _ in range(args.repeats)]
        parent.send(None)
    finally:
        p.join(10)
    t = time.perf_counter()
    for _ in range(args.repeats):
        hashlib.sha256(span.patches.view(torch.uint8).numpy().tobytes()).digest()
    digest_ms = (time.perf_counter() - t) * 1e3 / args.repeats
    result = {
        "bench": "image_wire", "date": datetime.date.today().isoformat(), "device": "cpu",
        "cpu_count": os.cpu_count(), "load_avg": os.getloadavg()[0], "torch": torch.__version__,
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                 cwd=Path(__file__).parent).stdout.strip(),
        "image_size": [w, h], "patches": span.num_patches, "positions": span.num_tokens,
        "patch_bytes": span.patches.numel() * span.patches.element_size(),
        "message_bytes": len(ForkingPickler.dumps(add)),
        "round_trip_ms_bytes_p50": statistics.median(as_bytes),
        "round_trip_ms_shared_memory_p50": statistics.median(shared),
        "digest_ms": digest_ms,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
