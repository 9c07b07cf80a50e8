"""What a checkpoint stores, read from safetensors headers before any weight is allocated: the config's
quantization scheme, each tensor's stored dtype and shape, and every quantized weight paired with its
scale and checked against the block geometry. Errors name the tensor, its shape and the expected one."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from openinfer.quantization.formats import MXFP4_GROUP, fp8_scale_shape

# safetensors dtype names
FP8_STORED = "F8_E4M3"
SCALE_STORED = "F8_E8M0"
PACKED_FP4_STORED = ("I8", "U8")          # E2M1 pairs in a byte container
FLOAT_STORED = ("BF16", "F16", "F32")
_EXPERT_DTYPES = {"fp4": "mxfp4", "fp8": "fp8", None: "fp8"}   # no expert_dtype: older all-FP8 conversions
SCALE_SUFFIXES = (".scale", ".weight_scale_inv")  # upstream DeepSeek, transformers


@dataclass(frozen=True)
class QuantScheme:
    """config.json's `quantization_config` (+ `expert_dtype`): FP8 block size for dense weights (also the
    activation group of the FP8 GEMMs) and the routed experts' format."""
    block: int
    expert_fmt: str          # "mxfp4" | "fp8"

    @classmethod
    def from_hf(cls, hf: dict) -> "QuantScheme | None":
        qc = hf.get("quantization_config")
        if qc is not None and not isinstance(qc, dict):
            raise ValueError(f"quantization_config must be an object, got {qc!r}")
        if qc is None:
            if hf.get("expert_dtype") is not None:
                raise ValueError(f"config.json sets expert_dtype={hf['expert_dtype']!r} but has no quantization_config")
            return None
        if qc.get("quant_method") != "fp8":
            raise ValueError(f"quantization_config.quant_method {qc.get('quant_method')!r} is not supported "
                             f"(supported: 'fp8', DeepSeek's block-scaled FP8)")
        if qc.get("scale_fmt") != "ue8m0":
            raise ValueError(f"quantization_config.scale_fmt {qc.get('scale_fmt')!r} is not supported "
                             f"(supported: 'ue8m0', power-of-two E8M0 scales)")
        bs = qc.get("weight_block_size", [128, 128])
        if not isinstance(bs, (list, tuple)) or len(bs) != 2 or bs[0] != bs[1]:
            raise ValueError(f"quantization_config.weight_block_size must be square [b, b], got {bs!r}")
        if not isinstance(bs[0], int) or bs[0] < 16 or bs[0] & (bs[0] - 1):
            raise ValueError(f"quantization_config.weight_block_size must be a power of two >= 16 (DeepSeek "
                             f"publishes 128 and 32), got {bs!r}")
        if hf.get("expert_dtype") not in _EXPERT_DTYPES:
            raise ValueError(f"expert_dtype {hf.get('expert_dtype')!r} is not supported (fp4, fp8, or unset)")
        return cls(int(bs[0]), _EXPERT_DTYPES[hf.get("expert_dtype")])


_STORED_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8,
                  "U8": torch.uint8, "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
                  "I32": torch.int32, "I64": torch.int64}


@dataclass(frozen=True)
class StoredTensor:
    name: str
    dtype: str               # safetensors dtype name
    shape: tuple[int, ...]
    file: Path

    def torch_dtype(self) -> torch.dtype:
        if self.dtype not in _STORED_DTYPES:
            raise ValueError(f"checkpoint tensor {self.name!r} is stored as {self.dtype}, which openinfer does not "
                             f"read")
        return _STORED_DTYPES[self.dtype]

    def meta(self) -> torch.Tensor:
        """An empty tensor of the stored shape and dtype on the meta device (a loader's dry run)."""
        return torch.empty(self.shape, dtype=self.torch_dtype(), device="meta")


def read_headers(model_dir: Path) -> dict[str, StoredTensor]:
    """Every tensor's stored dtype and shape (headers only, no data read)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} has no *.safetensors weights")
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        wanted = set(json.loads(index.read_text()).get("weight_map", {}).values())
        missing = sorted(f for f in wanted if not (model_dir / f).is_file())
        if missing:
            raise ValueError(f"{index.name} names shard(s) that are not in {model_dir}: {missing[:5]}")
    out: dict[str, StoredTensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                if name in out:
                    raise ValueError(f"tensor {name!r} is stored twice: in {out[name].file.name} and {f.name}")
                sl = sf.get_slice(name)
                out[name] = StoredTensor(name, sl.get_dtype(), tuple(sl.get_shape()), f)
    return out


@dataclass(frozen=True)
class QuantizedTensor:
    """A stored quantized weight and its scale: `fmt` "fp8" | "mxfp4"; `shape` the logical [N, K]."""
    weight: StoredTensor
    scale: StoredTensor
    fmt: str
    shape: tuple[int, ...]


def pair_quantized(headers: dict[str, StoredTensor], scheme: QuantScheme | None,
                   is_expert) -> dict[str, QuantizedTensor]:
    """Weight name -> its quantized pair, for every weight stored quantized. Checks: the config declares
    quantization; FP8 weights have an E8M0 scale of shape ceil(N/b) x ceil(K/b); packed FP4 is only used
    for routed experts (`is_expert(name)`) of an `expert_dtype: fp4` checkpoint, with [N, K/32] scales;
    no float weight carries a scale."""
    pairs: dict[str, QuantizedTensor] = {}
    for name, t in headers.items():
        if not name.endswith(".weight"):
            continue
        stem = name[:-len(".weight")]
        scales = [headers[stem + s] for s in SCALE_SUFFIXES if stem + s in headers]
        if len(scales) > 1:
            raise ValueError(f"{name!r} has two scales: {[t.name for t in scales]}")
        if t.dtype in FLOAT_STORED:
            if scales:
                raise ValueError(f"{scales[0].name!r} is a scale for {name!r}, which is stored {t.dtype}, "
                                 f"not FP8/FP4")
            continue
        if t.dtype == FP8_STORED:
            fmt = "fp8"
        elif t.dtype in PACKED_FP4_STORED and is_expert(name):
            fmt = "mxfp4"
        elif t.dtype in PACKED_FP4_STORED and scales:
            raise ValueError(f"{name!r} is packed FP4 ({t.dtype}) with a scale, but packed FP4 is only read "
                             f"for routed experts (ffn.experts.E.w1/w2/w3)")
        else:
            continue        # integer tables (tid2eid) and the like: loaded as they are
        if scheme is None:
            raise ValueError(f"checkpoint tensor {name!r} is stored {t.dtype} but config.json has no "
                             f"quantization_config")
        if fmt == "mxfp4" and scheme.expert_fmt != "mxfp4":
            raise ValueError(f"checkpoint tensor {name!r} is packed FP4 ({t.dtype}) but config.json's "
                             f"expert_dtype is not 'fp4'")
        if len(t.shape) != 2:
            raise ValueError(f"quantized tensor {name!r} has shape {t.shape}; expected a 2-D weight")
        if not scales:
            raise ValueError(f"checkpoint tensor {name!r} is {fmt.upper()} ({t.dtype}) but has no scale tensor "
                             f"({stem}.scale)")
        s = scales[0]
        if s.dtype != SCALE_STORED:
            raise ValueError(f"scale {s.name!r} is stored {s.dtype}; expected {SCALE_STORED} (ue8m0)")
        if fmt == "fp8":
            shape = t.shape
            expected = fp8_scale_shape(shape, scheme.block)
        else:
            shape = (t.shape[0], 2 * t.shape[1])
            if shape[1] % MXFP4_GROUP:
                raise ValueError(f"MXFP4 tensor {name!r} has {shape[1]} input channels, not a multiple of "
                                 f"{MXFP4_GROUP}")
            expected = (shape[0], shape[1] // MXFP4_GROUP)
        if s.shape != expected:
            raise ValueError(f"scale {s.name!r} has shape {s.shape}; expected {expected} for {fmt} weight "
                             f"{name!r} of shape {t.shape} (block {scheme.block if fmt == 'fp8' else MXFP4_GROUP})")
        pairs[name] = QuantizedTensor(t, s, fmt, shape)
    return pairs
