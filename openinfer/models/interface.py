"""The model interface: what the engine, the runner and the drafters may ask of a model, and what a model family
provides to the registry (docs/architecture.md, "Adding a model family").

- `CausalLM`: the protocol every model object follows (cache specs, forward, logits, feature taps for drafters).
- `ModelTraits`: what a model can do, declared by the model itself and read once at start-up. The engine never
  probes a model with `getattr`/`hasattr`: a capability is a trait, and the code that needs it reads the trait.
- `ModelFamily`: one per family package (`models/<family>/`): which configs it matches, the parallel layouts it
  accepts, how it is built (the recipe below is written once; a family overrides its hooks), its tokenizer
  vocabulary, the generated tiny models it offers, and a writer of random checkpoints in its published layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from openinfer.config import DS_MLA_KV_CACHE_DTYPE, FP8_KV_CACHE_DTYPES, EngineConfig
from openinfer.distributed.parallel_state import ParallelContext
from openinfer.kv_cache.bounded_replay import SlidingWindowLayout
from openinfer.kv_cache.spec import CacheSpec
from openinfer.layers.attention import AttentionBackend, AttentionMetadata
from openinfer.layers.basic import LayerOps
from openinfer.loader.weights import iter_safetensors, materialize

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class ModelTraits:
    """What a model can do. Every field has the value of a plain decoder-only model; a model states the rest."""
    # decode's forward has no host syncs and may be captured in a CUDA graph
    cuda_graph_decode: bool = True
    # decode reads a gather sized by the context (DeepSeek's compressed entries): one graph per (batch bucket,
    # power-of-two context bucket) instead of one per batch bucket at max_model_len
    context_bucketed_graphs: bool = False
    # which layers attend through a sliding window (None: none); the runner gives their kinds the window group
    sliding_window: SlidingWindowLayout | None = None
    # fixed-size state per running request (RequestStateSpec kinds: DeepSeek's rings and compressor rows)
    per_request_state: bool = False
    # prefill modes beside "exact" the model runs (EngineConfig.v41_prefill_mode: DeepSeek-V4.1's "yoco")
    prefill_modes: tuple[str, ...] = ("exact",)
    # speculative-decoding drafters that read this model (`ngram` reads only tokens and runs on any model):
    # "draft_head" (the target's layer inputs, its embedding and head), "mtp" (V4's MTP heads), "dspark" (V4.1)
    drafters: frozenset[str] = frozenset()
    # layers whose inputs `forward` can keep in `captured` (the feature taps drafters read; 0: none)
    feature_layers: int = 0
    # caches in FP8 with per-row scales (EngineConfig.kv_cache_dtype="fp8"), where the backend reads them
    fp8_kv_cache: bool = False
    # every reduction is one that batch-invariant mode covers (layers/batch_invariant.py)
    batch_invariant: bool = False
    # decoder layers split at the MoE exchange (`attend` / `finish`), so expert-parallel steps can run as two
    # micro-batches of whole requests (EngineConfig.two_batch_split="requests", distributed/two_batch.py)
    two_batch_layers: bool = False
    # images in prompts (docs/vision.md): the model checks image spans (`check_image`), embeds them
    # (`embed_image`) and its `forward` takes the step's image rows (`images=ImageRows`)
    vision: bool = False
    # GPU memory a prefill step may take beyond its activations, which the KV budget keeps back (DeepSeek's quantized
    # experts dequantized to bf16 in bounded chunks at large steps: quantization/dequant_gemm.py)
    prefill_scratch_bytes: int = 0


@dataclass
class ImageRows:
    """A step's rows inside image spans (vision models): their indices among the step's rows and the embeddings
    they take instead of their token's (model dtype, on the model's device)."""
    rows: torch.Tensor          # [k] long
    embeds: torch.Tensor        # [k, dim]


@runtime_checkable
class CausalLM(Protocol):
    """A model as the engine sees it. `forward` returns hidden rows; `compute_logits` turns chosen rows into
    logits (the runner computes logits only for rows that sample or score)."""
    config: Any                     # at least vocab_size and max_position_embeddings
    parallel: ParallelContext       # this rank's place (one process: ParallelContext.single())
    # feature taps for drafters: layer keys whose inputs `forward` keeps in `captured` (empty: nothing kept)
    capture_layers: tuple
    captured: dict

    @property
    def traits(self) -> ModelTraits: ...

    def cache_specs(self, dtype: torch.dtype, rollback_rows: int = 0) -> list[CacheSpec]:
        """The cache kinds to allocate: paged kinds grow with the sequence, state kinds are per request (their
        `needed_at_block_boundary` ones are snapshotted for prefix hits). `rollback_rows`: room per-request rings
        keep for rows a later step rolls back (speculative decoding)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: dict[str, list[torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor:
        """(A model with the `vision` trait also takes `images: ImageRows | None`.)"""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class TinyModel:
    """A generated random-weights model of a family (`LLM("deepseek-v4-tiny")`), written once into the cache by
    the family's `write_random_checkpoint` under `generated/<name>-v<version>`."""
    config: dict
    description: str
    seed: int = 0
    version: int = 1       # bump when what is written changes (the cache keeps one directory per version)


@dataclass(frozen=True)
class ResolvedModel:
    """A model to load: its directory (fetched, converted or generated once), its `config.json` (read once per
    start) and the family that claimed it. Picklable: ranks of a multi-process engine receive it as it is."""
    path: Path
    hf_config: dict
    family: "ModelFamily"
    name: str                     # as the user gave it (short name, directory or file)


class ModelFamily:
    """One model family. Subclasses set the class attributes and override the hooks they need; `build` is the
    one recipe every family runs: parse the config and check the layout, refuse options the family does not
    take, construct on the meta device, give quantized modules their stored formats (checked against the
    checkpoint's headers before anything is allocated), allocate, then load or initialize, then finish."""
    name: str = ""                               # the family's name in messages ("DeepSeek-V4")
    vocabulary: str = "hf"                       # one of tokenizer.VOCABULARIES (Tokenizer.from_dir)
    tiny_models: dict[str, TinyModel] = {}       # generated models this family offers, by short name
    takes_int4: bool = False                     # EngineConfig.quantization="int4" (CPU weight-only int4)
    quantization_hint: str = ""                  # appended to the refusal of quantization=...

    # ---- what the registry asks -----------------------------------------------------------------------------
    def matches(self, hf: dict) -> bool:
        raise NotImplementedError

    def parse_config(self, hf: dict):
        """The family's config object; an inconsistent config is a ValueError naming the field."""
        raise NotImplementedError

    def check_layout(self, cfg, hf: dict, config: EngineConfig) -> None:
        """Raise ValueError naming the constraint if the parallel layout of `config` cannot run this model (before
        any rank starts loading). The base refuses expert parallelism for models without routed experts and
        checks the expert count for those with them (`routed_experts`), and refuses context parallelism for
        families that do not declare it (`context_parallel`)."""
        if config.context_parallel_size > 1 and not self.context_parallel:
            raise ValueError(f"context_parallel_size={config.context_parallel_size}: {self.name} models do not run "
                             f"context parallelism (Llama-family and DeepSeek-V4/V4.1 do)")
        if config.enable_expert_parallel:
            experts = self.routed_experts(cfg)
            if experts is None:
                raise ValueError(f"enable_expert_parallel: {hf.get('model_type')!r} models have no routed experts")
            from openinfer.distributed.eplb import num_physical_experts

            num_physical_experts(experts, config.num_redundant_experts, config.world_size)

    def routed_experts(self, cfg) -> int | None:
        """Routed experts per MoE layer (None: not an MoE model)."""
        return None

    def write_random_checkpoint(self, hf_config: dict, out: Path, seed: int = 0, std: float = 0.02,
                                shard_bytes: int | None = 64 << 20, tokenizer_dir: Path | str | None = "own") -> None:
        """Random weights of `hf_config`'s shape in the family's published layout (names, dtypes, files) with
        `config.json`; `tokenizer_dir`: tokenizer files to copy beside them ("own": the family's; None: none)."""
        raise ValueError(f"the {self.name} family writes no random checkpoints")

    def image_processor(self, hf: dict):
        """What turns a request's preprocessed images into the model's image spans (`expand(prompt_token_ids,
        pixels) -> (prompt_token_ids, spans)`) and checks a span without the model (`check(span, prompt_token_ids)`,
        ValueError naming the problem, as the model's `check_image`), for models that take images; None for those
        that do not."""
        return None

    def build_image_encoder(self, model: ResolvedModel, config: EngineConfig, device: torch.device):
        """The model's vision tower alone, for a vision-encoder instance (`openinfer serve --role encoder`, EPD:
        docs/vision.md): an `nn.Module` with `check_image(span)` (ValueError naming the problem) and
        `embed_image(span) -> [num_tokens, dim]` (the rows the whole model would compute), reading only the tower's
        tensors from the checkpoint; None for models that take no images."""
        return None

    def write_tiny_model(self, tiny: TinyModel, out: Path) -> None:
        """One of `tiny_models` into `out` (default: as a random checkpoint in the published layout)."""
        self.write_random_checkpoint(tiny.config, out, tiny.seed)

    # ---- the build recipe -----------------------------------------------------------------------------------
    def build(self, model: ResolvedModel, config: EngineConfig, backend: AttentionBackend, ops: LayerOps,
              parallel: ParallelContext) -> "nn.Module":
        hf, device = model.hf_config, parallel.device
        cfg = self.parse_config(hf)
        self.check_layout(cfg, hf, config)
        self.check_options(cfg, model, config, backend)
        if config.max_model_len is not None:
            cfg.max_position_embeddings = max(cfg.max_position_embeddings, config.max_model_len)
        dummy = config.load_format == "dummy"
        with torch.device("meta"):
            net = self.construct(cfg, model, config, backend, ops, parallel)
        self.stored_formats(net, model, dummy)
        net = self.allocate(net, device, config)
        self.after_allocation(net, device)
        if dummy:
            self.init_random(net)
        else:
            self.load(net, model, config)
        net = self.finish(net, model, config)
        for p in net.parameters():          # inference only: no parameter tracks gradients
            p.requires_grad_(False)
        return net.eval()

    def check_options(self, cfg, model: ResolvedModel, config: EngineConfig, backend: AttentionBackend) -> None:
        """Refuse engine options this family does not take, naming them."""
        if config.quantization is not None and not self.takes_int4:
            raise ValueError(f"quantization={config.quantization!r} is not supported for {self.name} models"
                             f"{self.quantization_hint}")
        if config.v41_prefill_mode != "exact" and config.v41_prefill_mode not in self.prefill_modes:
            raise ValueError(f"v41_prefill_mode={config.v41_prefill_mode!r} applies to DeepSeek-V4.1 models only")
        kv = config.kv_cache_dtype
        if kv in FP8_KV_CACHE_DTYPES:
            if not self.fp8_kv_cache:
                raise ValueError(f"kv_cache_dtype={kv!r} (FP8 KV cache) is supported for Llama-family and Gemma-3 "
                                 f"models, not for this {self.name} model{self.fp8_kv_hint}")
            if not getattr(backend, "supports_fp8_kv", False):     # a backend's capability, chosen at start-up
                raise ValueError(f"kv_cache_dtype={kv!r}: the {type(backend).__name__} attention backend does "
                                 f"not read FP8 KV caches yet; use attention_backend='torch' (works on CPU and CUDA)")
        elif kv == DS_MLA_KV_CACHE_DTYPE:
            if not self.ds_mla_kv_cache:
                raise ValueError(f"kv_cache_dtype={kv!r} (DeepSeek-V4's FlashMLA cache rows) is supported for "
                                 f"DeepSeek-V4 models only, not for this {self.name} model")
        elif kv != "auto" and getattr(torch, kv, None) != config.torch_dtype:
            raise ValueError(f"kv_cache_dtype={kv!r}: caches store entries either in the model's own format "
                             f"('auto') or unquantized in the model dtype "
                             f"({str(config.torch_dtype).removeprefix('torch.')})")

    # what check_options reads (a family's traits that hold before a model exists)
    context_parallel: bool = False    # splits prefill chunks over context_parallel_size ranks (check_layout)
    prefill_modes: tuple[str, ...] = ("exact",)
    fp8_kv_cache: bool = False
    fp8_kv_hint: str = ""
    ds_mla_kv_cache: bool = False     # kv_cache_dtype="fp8_ds_mla": DeepSeek-V4's FlashMLA cache rows

    def construct(self, cfg, model: ResolvedModel, config: EngineConfig, backend: AttentionBackend, ops: LayerOps,
                  parallel: ParallelContext) -> "nn.Module":
        """The model on the meta device, in its final dtypes (memory is taken only by `materialize`)."""
        raise NotImplementedError

    def stored_formats(self, net: "nn.Module", model: ResolvedModel, dummy: bool) -> None:
        """Give quantized modules their stored formats (from the checkpoint's headers, or the published layout
        for dummy weights) and check every stored tensor's name, shape and format, still on the meta device."""

    def allocate(self, net: "nn.Module", device: torch.device, config: EngineConfig) -> "nn.Module":
        """Take memory for every tensor of the meta model on `device` (uninitialized)."""
        return materialize(net, device)

    def after_allocation(self, net: "nn.Module", device: torch.device) -> None:
        """Recompute buffers made on the meta device (RoPE tables) for real; tie shared weights again."""

    def init_random(self, net: "nn.Module") -> None:
        """Random weights of a working shape (`load_format="dummy"`): normal(0.02) matrices, unit norms."""
        gen = torch.Generator(device=next(net.parameters()).device).manual_seed(0)
        with torch.no_grad():
            for name, p in net.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(self.unit_norm)
                else:
                    p.normal_(0.0, 0.02, generator=gen)

    unit_norm: float = 1.0          # the value of a norm weight that scales by one (Gemma: 0, it scales by 1 + w)

    def load(self, net: "nn.Module", model: ResolvedModel, config: EngineConfig) -> None:
        """Read the checkpoint into the allocated model (default: the model's `load_weights` over every
        safetensors tensor, cast to the model dtype)."""
        net.load_weights(iter_safetensors(model.path, config.torch_dtype))

    def finish(self, net: "nn.Module", model: ResolvedModel, config: EngineConfig) -> "nn.Module":
        """After the weights: anything the loaded model still needs (default: nothing)."""
        return net

