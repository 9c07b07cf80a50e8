"""The model cache (loader/model_source.py): a GGUF given by path converts into the given cache and loads like the
registered model; processes sharing the cache (the suite's workers, several servers started together) resolve the
same model at once without converting it twice."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from openinfer import LLM, SamplingParams

_RESOLVE = ("import sys; from pathlib import Path; from openinfer.loader.model_source import resolve_model_dir; "
            "print(resolve_model_dir(sys.argv[1], Path(sys.argv[2])))")


def test_a_gguf_path_converts_once_for_processes_sharing_a_cache_and_loads_like_the_registered_one(
        tmp_path, smollm_gguf, llm):
    """Two processes resolve a copy of the default model's GGUF into one empty cache at the same time: one
    converts, the other waits on the cache lock and finds the result (without the lock both convert, and the
    second replaces the first's directory while it may be loading); both get the same complete directory. An
    engine on that path then uses the conversion and generates what the session's engine on the registered model
    does (CPU, float32, as `dtype="auto"` gives on CPU)."""
    gguf = tmp_path / "model.gguf"
    shutil.copy(smollm_gguf, gguf)
    cache = tmp_path / "cache"
    procs = [subprocess.Popen([sys.executable, "-c", _RESOLVE, str(gguf), str(cache)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    dirs = {out.strip() for out, _ in outs}
    assert len(dirs) == 1
    assert sum(err.count("converting model.gguf") for _, err in outs) == 1, [err[-2000:] for _, err in outs]
    converted = Path(dirs.pop())
    assert (converted / "config.json").is_file()

    mtime = (converted / "model.safetensors").stat().st_mtime_ns
    a = LLM(str(gguf), device="cpu", cache_dir=str(cache))
    assert (converted / "model.safetensors").stat().st_mtime_ns == mtime         # loaded, not converted again
    sp = SamplingParams(temperature=0, max_tokens=6)
    assert a.generate("Hello there", sp, use_tqdm=False)[0].outputs[0].token_ids == \
        llm.generate("Hello there", sp, use_tqdm=False)[0].outputs[0].token_ids
    a.shutdown()
