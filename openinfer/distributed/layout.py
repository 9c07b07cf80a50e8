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
        from openinfer.models.deepseek_v4 import V4_TP_WITH_EP, DeepseekV4Config
        from openinfer.quantization.checkpoint import QuantScheme

        cfg = DeepseekV4Config.from_hf(hf)
        if tp > 1 and config.enable_expert_parallel:
            raise ValueError(V4_TP_WITH_EP)
        scheme = QuantScheme.from_hf(hf)
        # heads, output groups, expert intermediate size, vocabulary; for a quantized checkpoint, whole
        # scale blocks per rank
        cfg.check_tensor_parallel(tp, scheme and scheme.block, scheme and scheme.expert_fmt)
        if config.enable_expert_parallel:
            from openinfer.distributed.eplb import num_physical_experts

            num_physical_experts(cfg.n_routed_experts, config.num_redundant_experts, world)
        return
    from openinfer.loader.deepseek_v41 import is_deepseek_v41

    if is_deepseek_v41(hf):
        from openinfer.models.deepseek_v41_config import DeepseekV41Config

        from openinfer.loader.deepseek_v41 import V41_NO_TP

        cfg = DeepseekV41Config.from_dict(hf)         # an inconsistent schedule fails here, not on every rank
        if tp > 1:
            raise ValueError(V41_NO_TP)
        if config.enable_expert_parallel:             # the backbone's experts; DSpark stages stay replicated
            from openinfer.distributed.eplb import num_physical_experts

            num_physical_experts(cfg.n_routed_experts, config.num_redundant_experts, world)
        return
    from openinfer.models.llama import LlamaConfig

    cfg = LlamaConfig.from_hf(hf)
    if config.enable_expert_parallel:
        raise ValueError(f"enable_expert_parallel: {hf.get('model_type')!r} models have no routed experts")
    if tp > 1:
        cfg.check_tensor_parallel(tp)
