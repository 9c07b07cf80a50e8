"""The W4A8 grouped expert GEMM against the reference in Triton's interpreter on the CPU
(tests/quant_kernel_cases.py). A subprocess: the interpreter is chosen when the kernels are defined."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_w4a8_grouped_gemm_equals_reference_in_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "quant_kernel_cases.py"), "--quick"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "all cases pass" in r.stdout
