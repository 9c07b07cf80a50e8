"""How the registry finds, checks and builds a DeepSeek-V4 model (models/interface.py: ModelFamily).

Quantized weights stay as published (FP8 block-scaled, MXFP4 experts): which modules hold them is read from the
checkpoint's headers (or, for dummy weights, from the published layout), checked against the config and the
model's shapes on the meta device, and only then is memory allocated."""

from __future__ import annotations

from pathlib import Path

from openinfer.config import DS_MLA_KV_CACHE_DTYPE
from openinfer.loader.weights import iter_safetensors
from openinfer.models.deepseek_v4.config import DeepseekV4Config
from openinfer.models.interface import ModelFamily, TinyModel
from openinfer.quantization.checkpoint import QuantScheme, pair_quantized, read_headers
from openinfer.quantization.kv_formats import Fp8DsMlaCodec

V4_TP_WITH_EP = ("DeepSeek-V4 does not combine tensor_parallel_size > 1 with enable_expert_parallel: use "
                 "data_parallel_size with enable_expert_parallel, or tensor_parallel_size without it")

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


class DeepseekV4Family(ModelFamily):
    name = "DeepSeek-V4"
    vocabulary = "deepseek-v4"
    tiny_models = {"deepseek-v4-tiny": TinyModel(DEEPSEEK_V4_TINY_CONFIG, "a tiny DeepSeek-V4", seed=0, version=2)}
    context_parallel = True    # attention over the whole step on every CP rank, the rest split (model.py)
    ds_mla_kv_cache = True     # kv_cache_dtype="fp8_ds_mla" (model.py: kv_codec)

    def matches(self, hf: dict) -> bool:
        return hf.get("model_type") == "deepseek_v4"

    def parse_config(self, hf: dict) -> DeepseekV4Config:
        return DeepseekV4Config.from_hf(hf)

    def routed_experts(self, cfg: DeepseekV4Config) -> int:
        return cfg.n_routed_experts

    def check_layout(self, cfg: DeepseekV4Config, hf: dict, config) -> None:
        tp = config.tensor_parallel_size
        if tp > 1 and config.enable_expert_parallel:
            raise ValueError(V4_TP_WITH_EP)
        scheme = QuantScheme.from_hf(hf)
        # heads, output groups, expert intermediate size, vocabulary; for a quantized checkpoint, whole scale
        # blocks per rank
        cfg.check_tensor_parallel(tp, scheme and scheme.block, scheme and scheme.expert_fmt)
        super().check_layout(cfg, hf, config)

    def construct(self, cfg, model, config, backend, ops, parallel):
        from openinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM

        codec = None
        if config.kv_cache_dtype == DS_MLA_KV_CACHE_DTYPE:
            codec = Fp8DsMlaCodec.for_head(cfg.head_dim, cfg.rope_head_dim)
        # cast first: memory is only taken in the final dtypes
        return DeepseekV4ForCausalLM(cfg, ops, parallel, codec).cast(config.torch_dtype)

    def stored_formats(self, net, model, dummy: bool) -> None:
        from openinfer.models.deepseek_v4.loader import load_weights, published_formats

        scheme = QuantScheme.from_hf(model.hf_config)
        if dummy:
            formats = published_formats(net, scheme)
        else:
            headers = read_headers(model.path)
            formats, scale_names = _stored_quantization(headers, scheme, dict(net.named_parameters()))
        if formats:
            net.quantize(formats, scheme.block)
        net.join_projections()          # q_a_proj and kv_proj in one GEMM where stored alike
        if not dummy:
            load_weights(net, ((scale_names.get(t.name, t.name), t.meta()) for t in headers.values()), dry_run=True)

    def after_allocation(self, net, device) -> None:
        for rope in net.ropes.values():
            rope.reset(device)

    def init_random(self, net) -> None:
        from openinfer.models.deepseek_v4.loader import init_random

        init_random(net, seed=0)

    def load(self, net, model, config) -> None:
        from openinfer.models.deepseek_v4.loader import load_weights

        scale_names = _stored_quantization(read_headers(model.path), QuantScheme.from_hf(model.hf_config))[1]
        load_weights(net, ((scale_names.get(n, n), t) for n, t in iter_safetensors(model.path)))

    def finish(self, net, model, config):
        from openinfer.models.deepseek_v4.model import expert_weights_loaded

        expert_weights_loaded(net)          # e.g. which MXFP4 experts the folded W4A8 kernel takes
        return net

    def write_random_checkpoint(self, hf_config: dict, out: Path, seed: int = 0, std: float = 0.02,
                                shard_bytes: int = 64 << 20, tokenizer_dir: Path | str | None = "own") -> None:
        from openinfer.models.deepseek_v4.writer import write_checkpoint

        write_checkpoint(hf_config, out, seed, std, shard_bytes, tokenizer_dir)

    def write_tiny_model(self, tiny: TinyModel, out: Path) -> None:
        from openinfer.models.deepseek_v4.writer import write_tiny

        write_tiny(tiny.config, out, tiny.seed)


def _stored_quantization(headers: dict, scheme: QuantScheme | None,
                         params=None) -> tuple[dict[str, str], dict[str, str]]:
    """(our module -> "fp8" | "mxfp4" for every module stored quantized, of a model with parameters `params` (as
    constructed: not yet joined), a stored scale's name -> the loader's canonical one `<weight>_scale`), checked: one
    format per module."""
    from openinfer.models.deepseek_v4.loader import native_to_hf, stacked_part

    pairs = pair_quantized(headers, scheme, is_expert=lambda n: native_to_hf(n)[1] is not None)
    formats = {}
    for name, q in pairs.items():
        ours = native_to_hf(name)[0]
        module = (stacked_part(ours, params) or (ours,))[0].rsplit(".", 1)[0]   # a stacked matrix: the stacking one
        if formats.setdefault(module, q.fmt) != q.fmt:
            raise ValueError(f"{module} mixes {formats[module]} and {q.fmt} weights ({name!r})")
    return formats, {q.scale.name: q.weight.name + "_scale" for q in pairs.values()}


FAMILY = DeepseekV4Family()
