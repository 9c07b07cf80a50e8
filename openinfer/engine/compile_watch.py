"""What would stall a step under traffic, counted: Triton JIT compiles in this process.

A Triton kernel compiles (or loads from Triton's disk cache, `~/.triton/cache` or `$TRITON_CACHE_DIR`, which
persists across restarts) the first time it meets a new specialization: argument dtypes, constexprs, and integer
arguments' divisibility by 16 or equality to 1. A compile takes 0.1-2 s; a step that meets one stalls every
request in it. The engine warms up at start (LLMEngine.warm_up: prefill and decode kernels over varied shapes; decode
graphs of every bucket, cuda_graphs.py) and reports the count from then on (`stats()["jit_compiles"]`), which
serving traffic should leave unchanged: benchmarks read it around their timed windows, and a GPU test asserts it.

Triton's hook is process-wide (`triton.knobs.runtime.jit_post_compile_hook`): the counter is one per process,
installed once, chaining any hook installed before it. CUDA graph captures are counted where they happen
(DecodeGraphs.captures).
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_count: list[int] | None = None      # [compiles since install]; None: not installed (or no Triton)
_recent: list[str] = []              # the last compiles' kernels and specializations (diagnostics)


def install_triton_compile_counter() -> bool:
    """Count Triton JIT compiles in this process from now on; idempotent. False where Triton (or its hook,
    Triton >= 3.4) is missing."""
    global _count
    with _lock:
        if _count is not None:
            return True
        try:
            from triton import knobs
        except ImportError:
            return False
        runtime = knobs.runtime
        try:
            previous = runtime.jit_post_compile_hook
        except AttributeError:          # Triton < 3.4
            return False
        counter = [0]

        def counting_hook(*args, **kwargs):
            counter[0] += 1
            _recent.append(str(kwargs.get("repr", "?"))[:300])
            del _recent[:-32]
            return previous(*args, **kwargs) if previous is not None else False

        runtime.jit_post_compile_hook = counting_hook
        _count = counter
        return True


def triton_compiles() -> int | None:
    """Triton JIT compiles in this process since the counter was installed (None: not installed)."""
    return None if _count is None else _count[0]


def recent_triton_compiles(n: int = 8) -> list[str]:
    """The last `n` compiles: kernel name, launch options and argument specializations (what made them new)."""
    return _recent[-n:] if n > 0 else []
