"""How the registry finds, checks and builds an OLMo-2 model (models/interface.py: ModelFamily)."""

from __future__ import annotations

from openinfer.models.interface import ModelFamily
from openinfer.models.olmo2.model import Olmo2Config, Olmo2ForCausalLM


class Olmo2Family(ModelFamily):
    name = "OLMo-2"

    def matches(self, hf: dict) -> bool:
        return hf.get("model_type") == "olmo2"

    def parse_config(self, hf: dict) -> Olmo2Config:
        return Olmo2Config.from_hf(hf)

    def check_layout(self, cfg: Olmo2Config, hf: dict, config) -> None:
        super().check_layout(cfg, hf, config)
        if config.tensor_parallel_size > 1:
            raise ValueError("OLMo-2's q and k norms span every head: tensor_parallel_size > 1 is not wired for it "
                             "(use data_parallel_size)")

    def construct(self, cfg, model, config, backend, ops, parallel) -> Olmo2ForCausalLM:
        return Olmo2ForCausalLM(cfg, backend, ops, parallel).to(config.torch_dtype)

    def after_allocation(self, net: Olmo2ForCausalLM, device) -> None:
        net.rotary.reset_tables(device)
        if net.config.tie_word_embeddings:
            net.lm_head.weight = net.embed_tokens.weight


FAMILY = Olmo2Family()
