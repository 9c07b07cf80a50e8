"""Offline throughput benchmark: random prompts of random lengths, EOS ignored, fixed output lengths.

The OW-256x512 workload of the GPU issue is `num_requests=256, input_len=(100, 1024), output_len=(512, 512),
seed=0`. Prompts are random token ids, so no tokenizer work is timed.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

from openinfer.entrypoints.llm import LLM
from openinfer.sampling_params import SamplingParams


@dataclass
class OfflineWorkload:
    num_requests: int
    input_len: tuple[int, int]    # inclusive range
    output_len: tuple[int, int]
    seed: int = 0

    def build(self, vocab_size: int) -> tuple[list[list[int]], list[int]]:
        rng = np.random.default_rng(self.seed)
        in_lens = rng.integers(self.input_len[0], self.input_len[1] + 1, self.num_requests)
        out_lens = rng.integers(self.output_len[0], self.output_len[1] + 1, self.num_requests)
        prompts = [rng.integers(0, vocab_size, int(n)).tolist() for n in in_lens]
        return prompts, [int(n) for n in out_lens]


def parse_range(text: str) -> tuple[int, int]:
    """'128' -> (128, 128); '100:1024' -> (100, 1024)."""
    lo, _, hi = text.partition(":")
    lo_i, hi_i = int(lo), int(hi or lo)
    if lo_i < 1 or hi_i < lo_i:
        raise ValueError(f"bad length range {text!r}: want N or LO:HI with 1 <= LO <= HI")
    return lo_i, hi_i


def run_offline(llm: LLM, workload: OfflineWorkload, use_tqdm: bool = True) -> dict:
    prompts, out_lens = workload.build(llm.engine.model_config.vocab_size)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in out_lens]
    start = time.perf_counter()
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    n_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    n_in = sum(len(p) for p in prompts)
    return {
        "workload": asdict(workload), "elapsed_s": elapsed, "input_tokens": n_in, "output_tokens": n_out,
        "output_tok_per_s": n_out / elapsed, "total_tok_per_s": (n_in + n_out) / elapsed,
        "requests_per_s": len(prompts) / elapsed,
    }
