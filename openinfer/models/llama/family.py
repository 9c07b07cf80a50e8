"""How the registry finds, checks and builds a Llama-family model (models/interface.py: ModelFamily)."""

from __future__ import annotations

import torch

from openinfer.config import FP8_KV_CACHE_DTYPES
from openinfer.loader.weights import iter_safetensors
from openinfer.models.interface import ModelFamily
from openinfer.models.llama.model import SUPPORTED_MODEL_TYPES, LlamaConfig, LlamaForCausalLM


class LlamaFamily(ModelFamily):
    name = "Llama-family"
    takes_int4 = True          # weight-only int4 linears on the CPU; a Q4_1 GGUF keeps its 4-bit grid
    fp8_kv_cache = True
    context_parallel = True    # attention through layers.attention.attend (its K/V exchange), no windows

    def matches(self, hf: dict) -> bool:
        return hf.get("model_type", "llama") in SUPPORTED_MODEL_TYPES

    def parse_config(self, hf: dict) -> LlamaConfig:
        q = hf.get("quantization_config")
        if q is not None:
            raise ValueError(f"quantized checkpoints (quantization_config {q.get('quant_method')!r}) are supported "
                             f"for DeepSeek-V4 only")
        return LlamaConfig.from_hf(hf)

    def check_layout(self, cfg: LlamaConfig, hf: dict, config) -> None:
        super().check_layout(cfg, hf, config)
        cfg.check_tensor_parallel(config.tensor_parallel_size)   # whole heads, equal MLP and vocabulary slices
        if config.context_parallel_size > 1 and any(cfg.window_layers):
            raise ValueError(f"context_parallel_size={config.context_parallel_size}: sliding-window layers "
                             f"({hf.get('model_type')!r}, sliding_window={cfg.sliding_window}) are not wired for "
                             f"context parallelism (their window group has its own slots)")

    @staticmethod
    def _load_dtype(config) -> torch.dtype:
        """int4: linears are quantized from the float32 checkpoint weights, the rest cast afterwards."""
        return torch.float32 if config.quantization else config.torch_dtype

    def construct(self, cfg, model, config, backend, ops, parallel) -> LlamaForCausalLM:
        return LlamaForCausalLM(cfg, backend, ops, parallel, config.kv_cache_dtype in FP8_KV_CACHE_DTYPES
                                ).to(self._load_dtype(config))

    def after_allocation(self, net: LlamaForCausalLM, device) -> None:
        net.rotary.reset_tables(device)   # buffers made on "meta" are recomputed for real, in float32
        if net.config.tie_word_embeddings:
            net.lm_head.weight = net.embed_tokens.weight

    def load(self, net: LlamaForCausalLM, model, config) -> None:
        net.load_weights(iter_safetensors(model.path, self._load_dtype(config)))

    def write_random_checkpoint(self, hf_config: dict, out, seed: int = 0, std: float = 0.02,
                                shard_bytes: int | None = None, tokenizer_dir=None) -> None:
        """One float32 safetensors file under HF's names (`shard_bytes` is not used: one file)."""
        from openinfer.models.llama.writer import write_checkpoint

        write_checkpoint(hf_config, out, seed, std, tokenizer_dir)

    def finish(self, net: LlamaForCausalLM, model, config) -> LlamaForCausalLM:
        if config.quantization == "int4":
            from openinfer.layers.quantized import quantize_linears

            quantize_linears(net)
            net.to(config.torch_dtype)
            net.rotary.reset_tables(net.embed_tokens.weight.device)
        return net


FAMILY = LlamaFamily()
