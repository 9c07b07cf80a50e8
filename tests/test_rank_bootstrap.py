"""Ranks start without running the front end's `__main__` (executor/rank_bootstrap.py): a front end fed to
`python -` on standard input — no main file to re-run, no main guard — starts its DP2 + EP2 ranks, generates, and
leaves no process behind when it exits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil

from openinfer.executor.rank_bootstrap import PROCESS_PREFIX
from tests.test_parallel import assert_gone

ROOT = Path(__file__).resolve().parent.parent

# no main guard on purpose: were a rank to run this again, it would build an engine while it bootstraps
SCRIPT = """
import json, os
from openinfer import LLM, SamplingParams
llm = LLM("deepseek-v4-tiny", device="cpu", dtype="float32", data_parallel_size=2, enable_expert_parallel=True,
          max_num_seqs=2, num_kv_blocks=16, block_size=16)
outs = llm.generate(prompt_token_ids=[[1, 2, 3], [4, 5, 6, 7]],
                    sampling_params=SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs],
                  "ranks": [p.pid for p in llm.engine._procs], "names": [p.name for p in llm.engine._procs]}))
"""


def test_a_front_end_on_standard_input_starts_its_ranks_and_leaves_nothing_behind(tmp_path):
    proc = subprocess.Popen([sys.executable, "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        out, err = proc.communicate(SCRIPT, timeout=240)
    finally:
        descendants = []
        if proc.poll() is None:
            descendants = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
            proc.kill()
            proc.wait()
        assert_gone(descendants)
    assert proc.returncode == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert [len(t) for t in result["tokens"]] == [3, 3]
    assert all(n.startswith(PROCESS_PREFIX) for n in result["names"])
    assert_gone(result["ranks"])
