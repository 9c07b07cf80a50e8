"""How the registry finds, checks and builds a Gemma-3 model (models/interface.py: ModelFamily)."""

from __future__ import annotations

import sys

from openinfer.config import FP8_KV_CACHE_DTYPES
from openinfer.models.gemma3.model import SUPPORTED_MODEL_TYPES, Gemma3Config, Gemma3ForCausalLM
from openinfer.models.interface import ModelFamily


class Gemma3Family(ModelFamily):
    name = "Gemma-3"
    quantization_hint = " yet"
    fp8_kv_cache = True
    unit_norm = 0.0            # Gemma norms scale by (1 + w)

    def matches(self, hf: dict) -> bool:
        return hf.get("model_type") in SUPPORTED_MODEL_TYPES

    def parse_config(self, hf: dict) -> Gemma3Config:
        if hf.get("quantization_config") is not None:
            raise ValueError("quantized Gemma-3 checkpoints are not supported (config.json has a quantization_config)")
        return Gemma3Config.from_hf(hf)

    def check_layout(self, cfg: Gemma3Config, hf: dict, config) -> None:
        super().check_layout(cfg, hf, config)
        cfg.check_tensor_parallel(config.tensor_parallel_size)

    def check_options(self, cfg, model, config, backend) -> None:
        super().check_options(cfg, model, config, backend)
        if model.hf_config.get("model_type") == "gemma3":
            print(f"[openinfer] {model.path.name}: multimodal Gemma-3 checkpoint, loading the text model only "
                  f"(vision tower skipped)", file=sys.stderr, flush=True)

    def construct(self, cfg, model, config, backend, ops, parallel) -> Gemma3ForCausalLM:
        return Gemma3ForCausalLM(cfg, backend, ops, parallel, config.kv_cache_dtype in FP8_KV_CACHE_DTYPES
                                 ).to(config.torch_dtype)

    def after_allocation(self, net: Gemma3ForCausalLM, device) -> None:
        net.reset_rotary_tables(device)
        if net.config.tie_word_embeddings:
            net.lm_head.weight = net.embed_tokens.weight


FAMILY = Gemma3Family()
