"""Start-up checks of a parallel layout against the model, before any worker starts loading: every
constraint that would otherwise fail later on some rank (or silently mis-shard) is named here."""

from __future__ import annotations

from pathlib import Path

from openinfer.config import EngineConfig


def check_layout(config: EngineConfig, model_dir: Path) -> None:
    from openinfer.loader.weights import read_hf_config

    hf = read_hf_config(model_dir)
    tp, world = config.tensor_parallel_size, config.world_size
    if hf.get("model_type") == "deepseek_v4":
        from openinfer.models.deepseek_v4 import DeepseekV4Config

        cfg = DeepseekV4Config.from_hf(hf)
        if tp > 1:
            raise ValueError("tensor_parallel_size > 1 is not supported for DeepSeek-V4 yet: use "
                             "data_parallel_size with enable_expert_parallel (attention DP + expert parallelism)")
        if config.enable_expert_parallel:
            from openinfer.distributed.eplb import num_physical_experts

            num_physical_experts(cfg.n_routed_experts, config.num_redundant_experts, world)
        return
    from openinfer.models.llama import LlamaConfig

    cfg = LlamaConfig.from_hf(hf)
    if config.enable_expert_parallel:
        raise ValueError(f"enable_expert_parallel: {hf.get('model_type')!r} models have no routed experts")
    if tp > 1:
        cfg.check_tensor_parallel(tp)
