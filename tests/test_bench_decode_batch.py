"""The GPU decode benchmarks measure the batch they name: `start_decoding` (benchmarks/gpu_llama8b.py, used by the
DeepSeek scripts) leaves every request enough tokens that none finishes inside the caller's timed and profiled
steps, although with chunked prefill the first requests decode while the last are still prefilled (issue 34's
b=128 reading averaged a batch shrinking to 49). Run on the CPU with the device work stubbed (the scheduler is
what decides)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from cpu_decode_host_overhead import DeviceTimer  # noqa: E402
from gpu_llama8b import start_decoding  # noqa: E402

from openinfer import LLM  # noqa: E402


def test_start_decoding_keeps_the_batch_whole_through_the_measured_steps():
    batch, ctx, steps = 32, 256, 12          # prefill takes ~9 steps of 1,024 tokens, as 128 x 1K take 17 of 8K
    llm = LLM("deepseek-v4-tiny", device="cpu", dtype="float32", max_num_seqs=batch, max_num_batched_tokens=1024,
              enable_prefix_caching=False, async_scheduling=True)
    eng = llm.engine
    DeviceTimer(eng.runner, stub=True)
    start_decoding(eng, batch, ctx, steps + 10, warmup=4)      # as gpu_deepseek_v4.decode_steps asks
    running = []
    for _ in range(steps + 3):               # its timed steps, then its profiled ones
        running.append(len(eng.scheduler.running))
        eng.step()
    assert running == [batch] * (steps + 3)
    assert all(len(r.output_token_ids) > steps for r in eng.requests.values())
