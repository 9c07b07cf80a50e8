"""How the registry finds, checks and builds a DeepSeek-V4.1 model (models/interface.py: ModelFamily): `config.json`
in DeepSeek's inference form or HF release form (`model_type: deepseek_v41`), weights as `loader.py` reads them."""

from __future__ import annotations

from pathlib import Path

import torch

from openinfer.layers.engram import EngramLayout
from openinfer.models.deepseek_v41.config import INFERENCE_FORM_KEYS, DeepseekV41Config
from openinfer.models.interface import ModelFamily, TinyModel

V41_NO_TP = ("DeepSeek-V4.1 runs with data_parallel_size (attention DP), optionally with enable_expert_parallel; "
             "tensor_parallel_size > 1 is not wired for it yet")


def _engram_rows(engram_layer_ids: list[int], engram_max_ngram_size: int, engram_n_heads: int,
                 engram_head_dim: int, engram_vocab_size: int) -> list[int]:
    """Engram table rows per layer: the summed prime bucket ranges of its n-gram sizes and heads (as released)."""
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
    dtype="fp8", expert_dtype="fp4", compress_rope_theta=160000,
    # a two-block vision tower with the release's patch size and 3x3 Aligner (docs/vision.md)
    vision_n_layers=2, vision_dim=64, vision_n_heads=4, vision_inter_dim=128, vision_patch_size=14,
    vision_rope_theta=10000.0, vision_downsample_ratio=3, image_token_id=129264)


class DeepseekV41Family(ModelFamily):
    name = "DeepSeek-V4.1"
    vocabulary = "deepseek-v4.1"
    tiny_models = {"deepseek-v41-tiny": TinyModel(DEEPSEEK_V41_TINY_CONFIG, "a tiny DeepSeek-V4.1 in DeepSeek's "
                                                  "published formats", seed=0, version=3)}
    quantization_hint = " (their published FP8/MXFP4 formats load as they are)"
    prefill_modes = ("exact", "yoco")
    context_parallel = True    # attention over the whole step on every CP rank, the rest split (model.py)
    fp8_kv_hint = (" (DeepSeek-V4.1: kv_cache_dtype='auto' keeps its own FP8/FP4 cache formats, the model dtype "
                   "keeps its caches unquantized)")

    def matches(self, hf: dict) -> bool:
        return hf.get("model_type") == "deepseek_v41" or all(k in hf for k in INFERENCE_FORM_KEYS)

    def parse_config(self, hf: dict) -> DeepseekV41Config:
        return DeepseekV41Config.from_dict(hf)      # an inconsistent schedule fails here, not on every rank

    def routed_experts(self, cfg: DeepseekV41Config) -> int:
        return cfg.n_routed_experts                 # the backbone's; DSpark stages stay replicated

    def check_layout(self, cfg: DeepseekV41Config, hf: dict, config) -> None:
        if config.tensor_parallel_size > 1:
            raise ValueError(V41_NO_TP)
        super().check_layout(cfg, hf, config)

    def check_options(self, cfg: DeepseekV41Config, model, config, backend) -> None:
        super().check_options(cfg, model, config, backend)
        if config.v41_prefill_mode == "yoco":
            keep = config.v41_prefill_keep_tokens
            if cfg.yoco_split is None:
                raise ValueError("v41_prefill_mode='yoco' needs the CED split: every compressed layer after the last "
                                 "KV source reading its entries and index keys; this config's schedule has none")
            if keep < cfg.window_size:
                raise ValueError(f"v41_prefill_keep_tokens {keep} is below the sliding window ({cfg.window_size}): "
                                 f"decode would read decoder window keys that were never computed")

    def construct(self, cfg, model, config, backend, ops, parallel):
        from openinfer.models.deepseek_v41.loader import engram_hasher
        from openinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM

        with torch.device("cpu"):        # (construct runs on the meta device; the hasher's map is real)
            engram = engram_hasher(cfg, model.path)
        return DeepseekV41ForCausalLM(cfg, ops, engram and engram[0], config.kv_cache_dtype == "auto",
                                      parallel).cast(config.torch_dtype)

    def stored_formats(self, net, model, dummy: bool) -> None:
        from openinfer.models.deepseek_v41.loader import load_weights, published_modules, quant_scheme, stored_modules
        from openinfer.quantization.checkpoint import read_headers

        scheme = quant_scheme(model.hf_config, net.config)
        headers = None if dummy else read_headers(model.path)
        fp8, experts = published_modules(net, scheme) if dummy else stored_modules(headers, scheme)
        if fp8 or experts:
            net.quantize(fp8, scheme.block, experts)
        net.join_projections()          # wq_a and wkv in one GEMM where stored alike
        if headers is not None:
            load_weights(net, ((n, t.meta()) for n, t in headers.items()), dry_run=True)

    def allocate(self, net, device, config):
        """`engram_tables="host"` on CUDA: the Engram tables in pinned host memory (CUDA reads them in place), never
        allocated on the GPU, not even briefly; the rest on `device`."""
        from openinfer.layers.engram import EngramTable

        host_tables = []
        if config.engram_tables == "host" and device.type == "cuda":
            for layer in net.layers:
                if layer.engram is not None:
                    host_tables.append((layer.engram, *layer.engram.embed.weight.shape))
                    del layer.engram.embed
        net = super().allocate(net, device, config)
        for module, rows, head_dim in host_tables:
            module.embed = EngramTable(rows, head_dim, device="cpu", pin_memory=True)
        return net

    def after_allocation(self, net, device) -> None:
        for rope in net.ropes.values():
            rope.reset(device)

    def init_random(self, net) -> None:
        from openinfer.models.deepseek_v41.loader import init_random

        init_random(net, seed=0)

    def load(self, net, model, config) -> None:
        from openinfer.loader.weights import iter_safetensors
        from openinfer.models.deepseek_v41.loader import load_weights, model_keeps

        load_weights(net, iter_safetensors(model.path, keep=model_keeps(net)))

    def finish(self, net, model, config):
        from openinfer.models.deepseek_v4.model import expert_weights_loaded
        from openinfer.models.deepseek_v41.loader import engram_hasher

        expert_weights_loaded(net)
        engram = engram_hasher(net.config, model.path)
        if engram is not None:
            net.attach_hasher(engram[1].to(net.embed.weight.device))
        return net

    def image_processor(self, hf: dict):
        cfg = self.parse_config(hf)
        if not cfg.vision_n_layers:
            return None
        from openinfer.models.deepseek_v41.image_processor import ImageProcessor

        return ImageProcessor(cfg)

    def build_image_encoder(self, model, config, device):
        cfg = self.parse_config(model.hf_config)
        if not cfg.vision_n_layers:
            return None
        if config.load_format == "dummy":
            raise ValueError("a vision-encoder instance with load_format='dummy' (random weights) would return "
                             "embeddings no prefill instance's tower gives: load the checkpoint")
        from openinfer.models.deepseek_v41.image_encoder import load_image_encoder

        return load_image_encoder(cfg, model.path, config.torch_dtype, device)

    def write_random_checkpoint(self, hf_config: dict, out: Path, seed: int = 0, std: float = 0.02,
                                shard_bytes: int | None = 64 << 20, tokenizer_dir: Path | str | None = "own") -> None:
        from openinfer.models.deepseek_v41.writer import write_checkpoint

        write_checkpoint(hf_config, out, seed, std, shard_bytes, tokenizer_dir)

    def write_tiny_model(self, tiny: TinyModel, out: Path) -> None:
        self.write_random_checkpoint(tiny.config, out, tiny.seed, shard_bytes=None)


FAMILY = DeepseekV41Family()
