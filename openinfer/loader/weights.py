"""Build a model from an HF-layout directory: config.json -> model class -> safetensors weights."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open

from openinfer.config import FP8_KV_CACHE_DTYPES
from openinfer.distributed.parallel_state import ParallelContext
from openinfer.layers.attention import AttentionBackend
from openinfer.layers.basic import TORCH_OPS, LayerOps
from openinfer.models.deepseek_v4 import (V4_TP_WITH_EP, DeepseekV4Config, DeepseekV4ForCausalLM, Experts,
                                          hf_to_native, native_to_hf, published_dtype)
from openinfer.quantization.checkpoint import QuantScheme, pair_quantized, read_headers
from openinfer.quantization.formats import FP8_MAX, float_to_e8m0, pow2_ceil
from openinfer.models.gemma3 import SUPPORTED_MODEL_TYPES as GEMMA3_MODEL_TYPES
from openinfer.models.gemma3 import Gemma3Config, Gemma3ForCausalLM
from openinfer.models.llama import SUPPORTED_MODEL_TYPES as LLAMA_MODEL_TYPES
from openinfer.models.llama import LlamaConfig, LlamaForCausalLM


def materialize(model: torch.nn.Module, device) -> torch.nn.Module:
    """`model.to_empty(device=device)` for a model built on the meta device, without its start-up cost: `to_empty`
    makes each tensor with `empty_like` of the meta tensor, whose first call in a process imports torch.fx's
    symbolic shapes and sympy (~1 s); `torch.empty` of the same shape and dtype gives the same uninitialized
    tensors (every one of them is then loaded or initialized)."""
    return model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def read_hf_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def iter_safetensors(model_dir: Path, dtype: torch.dtype | None = None,
                     keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every stored tensor, one at a time; cast to `dtype` if given, else as stored. `keep`: read
    only the tensors it accepts (expert parallelism: this rank's experts)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} has no *.safetensors weights")
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                if keep is not None and not keep(name):
                    continue
                t = sf.get_tensor(name)
                yield name, t if dtype is None else t.to(dtype)


def build_model(model_dir: Path, dtype: torch.dtype, device: torch.device, backend: AttentionBackend,
                ops: LayerOps = TORCH_OPS, max_positions: int | None = None, dummy: bool = False,
                quantization: str | None = None,
                parallel: ParallelContext | None = None, kv_cache_dtype: str = "auto", engram_tables: str = "device"
                ) -> LlamaForCausalLM | Gemma3ForCausalLM | DeepseekV4ForCausalLM:
    """`dummy`: random weights (normal, std 0.02) instead of the checkpoint, for benchmarks of a shape.
    `quantization="int4"`: linears are quantized from the full-precision checkpoint weights, then the rest
    is cast to `dtype`. `parallel`: this rank's place (TP shards, EP experts); None: one process.
    `kv_cache_dtype`: "auto" (the model's own cache format), a dtype name: caches unquantized in that dtype,
    which must be the model's (DeepSeek-V4.1's native caches are quantized), or "fp8" / "fp8_e4m3" (Llama
    family and Gemma-3, on a backend with `supports_fp8_kv`): FP8 K/V with per-row scales."""
    parallel = parallel or ParallelContext.single(device)
    final_dtype, dtype = dtype, (torch.float32 if quantization else dtype)
    hf = read_hf_config(model_dir)
    from openinfer.loader.deepseek_v41 import build_deepseek_v41, is_deepseek_v41

    fp8_kv = kv_cache_dtype in FP8_KV_CACHE_DTYPES
    if fp8_kv:
        _check_fp8_kv_cache(hf, kv_cache_dtype, backend, is_deepseek_v41(hf))
    elif kv_cache_dtype != "auto" and getattr(torch, kv_cache_dtype, None) != final_dtype:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: caches store entries either in the model's own format "
                         f"('auto') or unquantized in the model dtype ({str(final_dtype).removeprefix('torch.')})")
    if is_deepseek_v41(hf):
        if quantization:
            raise ValueError(f"quantization={quantization!r} is not supported for DeepSeek-V4.1 models (their "
                             f"published FP8/MXFP4 formats load as they are)")
        return build_deepseek_v41(model_dir, hf, dtype, device, max_positions, dummy, ops, parallel,
                                  quantized_caches=kv_cache_dtype == "auto", engram_on_host=engram_tables == "host")
    if hf.get("model_type") == "deepseek_v4":
        if quantization:
            raise ValueError(f"quantization={quantization!r} is not supported for DeepSeek-V4 models")
        return _build_deepseek_v4(model_dir, hf, dtype, device, max_positions, dummy, ops, parallel)
    if hf.get("model_type") in GEMMA3_MODEL_TYPES:
        if quantization:
            raise ValueError(f"quantization={quantization!r} is not supported for Gemma-3 models yet")
        if hf.get("quantization_config") is not None:
            raise ValueError(f"{model_dir}: quantized Gemma-3 checkpoints are not supported")
        return _build_gemma3(model_dir, hf, dtype, device, backend, ops, max_positions, dummy, parallel, fp8_kv)
    if hf.get("quantization_config") is not None:
        raise ValueError(f"{model_dir}: quantized checkpoints (quantization_config "
                         f"{hf['quantization_config'].get('quant_method')!r}) are supported for DeepSeek-V4 only")
    cfg = LlamaConfig.from_hf(hf)
    cfg.check_tensor_parallel(parallel.tp_size)   # whole heads, equal MLP and vocabulary slices per TP rank
    if max_positions is not None:
        cfg.max_position_embeddings = max(cfg.max_position_embeddings, max_positions)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, backend, ops, parallel, fp8_kv)
    model = materialize(model, device).to(dtype)
    model.rotary.reset_tables(device)   # buffers made on "meta" are recomputed for real, in float32
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if dummy:
        # every rank draws its own shards; replicated parameters (norms, o_proj bias) come out the same on
        # every rank because all ranks draw the same shapes in the same order from the same seed
        gen = torch.Generator(device=device).manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02, generator=gen)
    else:
        model.load_weights(iter_safetensors(model_dir, dtype))
    if quantization == "int4":
        from openinfer.layers.quantized import quantize_linears

        quantize_linears(model)
        model.to(final_dtype)
        model.rotary.reset_tables(device)
    return model.eval()


def _check_fp8_kv_cache(hf: dict, kv_cache_dtype: str, backend: AttentionBackend, deepseek_v41: bool) -> None:
    """The FP8 KV cache is for the Llama family and Gemma-3 (their caches are the attention backend's), read by
    a backend that supports it; anything else is refused naming the option."""
    model_type = hf.get("model_type", "llama")
    if deepseek_v41 or model_type not in (*LLAMA_MODEL_TYPES, *GEMMA3_MODEL_TYPES):
        own = (" (DeepSeek-V4.1: kv_cache_dtype='auto' keeps its own FP8/FP4 cache formats, the model dtype "
               "keeps its caches unquantized)" if deepseek_v41 else "")
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} (FP8 KV cache) is supported for Llama-family "
                         f"({', '.join(LLAMA_MODEL_TYPES)}) and Gemma-3 models, not for this "
                         f"{'deepseek_v41' if deepseek_v41 else model_type!r} model{own}")
    if not getattr(backend, "supports_fp8_kv", False):
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: the {type(backend).__name__} attention backend does "
                         f"not read FP8 KV caches yet; use attention_backend='torch' (works on CPU and CUDA)")


def _build_gemma3(model_dir: Path, hf: dict, dtype: torch.dtype, device: torch.device, backend: AttentionBackend,
                  ops: LayerOps, max_positions: int | None, dummy: bool,
                  parallel: ParallelContext, fp8_kv: bool = False) -> Gemma3ForCausalLM:
    """Gemma-3 text model; a multimodal `gemma3` checkpoint loads its text tower only (vision weights skipped)."""
    cfg = Gemma3Config.from_hf(hf)
    cfg.check_tensor_parallel(parallel.tp_size)
    if hf.get("model_type") == "gemma3":
        print(f"[openinfer] {model_dir.name}: multimodal Gemma-3 checkpoint, loading the text model only "
              f"(vision tower skipped)", file=sys.stderr, flush=True)
    if max_positions is not None:
        cfg.max_position_embeddings = max(cfg.max_position_embeddings, max_positions)
    with torch.device("meta"):
        model = Gemma3ForCausalLM(cfg, backend, ops, parallel, fp8_kv)
    model = materialize(model, device).to(dtype)
    model.reset_rotary_tables(device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if dummy:
        gen = torch.Generator(device=device).manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.zero_()              # Gemma norms scale by (1 + w)
                else:
                    p.normal_(0.0, 0.02, generator=gen)
    else:
        model.load_weights(iter_safetensors(model_dir, dtype))
    return model.eval()


_STORED_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8,
                  "U8": torch.uint8, "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
                  "I32": torch.int32, "I64": torch.int64}


def _build_deepseek_v4(model_dir: Path, hf: dict, dtype: torch.dtype, device: torch.device,
                       max_positions: int | None, dummy: bool, ops: LayerOps,
                       parallel: ParallelContext) -> DeepseekV4ForCausalLM:
    """Quantized weights stay as published (FP8 block-scaled, MXFP4 experts): which modules hold them is
    read from the checkpoint's headers (or, for `dummy`, from the published layout), checked against the
    config and the model's shapes on the meta device, and only then is memory allocated."""
    cfg = DeepseekV4Config.from_hf(hf)
    scheme = QuantScheme.from_hf(hf)
    if parallel.tp_size > 1 and parallel.ep_size > 1:
        raise ValueError(V4_TP_WITH_EP)
    cfg.check_tensor_parallel(parallel.tp_size, scheme and scheme.block, scheme and scheme.expert_fmt)
    if max_positions is not None:
        cfg.max_position_embeddings = max(cfg.max_position_embeddings, max_positions)
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(cfg, ops, parallel).cast(dtype)   # cast first: memory is only taken in the final dtypes
    if dummy:
        formats = published_formats(model, scheme)
    else:
        headers = read_headers(model_dir)
        pairs = pair_quantized(headers, scheme, is_expert=lambda n: native_to_hf(n)[1] is not None)
        formats = {}
        for name, q in pairs.items():
            module = native_to_hf(name)[0].rsplit(".", 1)[0]
            if formats.setdefault(module, q.fmt) != q.fmt:
                raise ValueError(f"{module} mixes {formats[module]} and {q.fmt} weights ({name!r})")
        scale_names = {q.scale.name: q.weight.name + "_scale" for q in pairs.values()}
    if formats:
        model.quantize(formats, scheme.block)
    if not dummy:
        model.load_weights(((scale_names.get(t.name, t.name), torch.empty(t.shape, dtype=_stored_dtype(t), device="meta"))
                            for t in headers.values()), dry_run=True)
    model = materialize(model, device)
    for rope in model.ropes.values():
        rope.reset(device)
    if dummy:
        init_deepseek_v4_random(model, seed=0)
    else:
        model.load_weights((scale_names.get(n, n), t) for n, t in iter_safetensors(model_dir))
    return model.eval()


def _stored_dtype(t) -> torch.dtype:
    if t.dtype not in _STORED_DTYPES:
        raise ValueError(f"checkpoint tensor {t.name!r} is stored as {t.dtype}, which openinfer does not read")
    return _STORED_DTYPES[t.dtype]


def published_formats(model: DeepseekV4ForCausalLM, scheme: QuantScheme | None) -> dict[str, str]:
    """Module -> "fp8" | "mxfp4" for the weights DeepSeek publishes quantized under `scheme` (None: none)."""
    if scheme is None:
        return {}
    formats = {}
    for name, module in model.named_modules():
        if isinstance(module, Experts):
            formats[name] = scheme.expert_fmt
        elif isinstance(module, torch.nn.Linear) and published_dtype(hf_to_native(name + ".weight"), "fp8") == "fp8":
            formats[name] = "fp8"
    return formats


def init_deepseek_v4_random(model: DeepseekV4ForCausalLM, seed: int, std: float = 0.02) -> None:
    """Random weights of a working shape: normal(std) matrices, unit norms and mHC scales, small random
    biases/sinks, a random hash table (tid2eid), so every branch carries signal. Quantized weights get
    random stored values (FP8 values, E2M1 nibbles) with one power-of-two scale giving about the same std."""
    dev = next(model.parameters()).device
    gen = torch.Generator(device=dev).manual_seed(seed)   # drawn where the weights live (GB-sized on GPUs)
    n_experts = model.config.n_routed_experts
    fp8_std, e2m1_std = 16.0, 2.93     # of randn*16 cast to E4M3, and of uniformly random E2M1 codes
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_scale") and p.dtype == torch.float8_e8m0fnu:
                fmt = getattr(model.get_submodule(name.rsplit(".", 1)[0]), "fmt", "fp8")
                byte = float_to_e8m0(pow2_ceil(torch.tensor(std / (e2m1_std if fmt == "mxfp4" else fp8_std))))
                p.view(torch.uint8).fill_(int(byte.view(torch.uint8)))
            elif p.dtype == torch.uint8:          # packed E2M1
                p.copy_(torch.randint(0, 256, p.shape, generator=gen, device=dev, dtype=torch.uint8))
            elif p.dtype == torch.float8_e4m3fn:  # in slices: no full-size float temporary
                for i in range(0, p.shape[0], max(1, (64 << 20) // p[0].numel())):
                    part = p[i:i + max(1, (64 << 20) // p[0].numel())]
                    part.copy_((torch.randn(part.shape, generator=gen, device=dev, dtype=torch.bfloat16) * fp8_std)
                               .clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn))
            elif name.endswith("norm.weight") or name.endswith(("_hc.scale", "hc_head.hc_scale")):
                p.fill_(1.0)
            elif name.endswith(("sinks", "position_bias", "_hc.base", "hc_head.hc_base")):
                p.copy_(torch.randn(p.shape, generator=gen, device=dev) * 0.5)
            else:
                p.normal_(0.0, std, generator=gen)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):   # top_k distinct experts per token
                b.copy_(torch.rand(b.shape[0], n_experts, generator=gen, device=dev).argsort(-1)[:, :b.shape[1]])
            elif name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen, device=dev) * 0.01)
