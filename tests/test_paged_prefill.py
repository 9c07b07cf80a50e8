"""The Triton attention kernels (paged prefill, paged decode, FP8 KV reads) against the torch reference, run in
Triton's interpreter on the CPU: random mixed steps of decode rows and prefill chunks over cached prefixes,
shuffled pages, GQA, sliding windows, FP8 caches (tests/paged_attention_cases.py; the GPU runs every case in
tests/test_gpu.py). A subprocess: the interpreter is chosen when the kernels are defined."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_triton_kernels_equal_reference_in_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "paged_attention_cases.py"), "cpu", "--quick"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "all cases pass" in r.stdout
