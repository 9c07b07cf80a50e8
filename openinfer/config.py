"""EngineConfig: the single source of engine knobs.

Every option `LLM(...)`, the CLI and (later) the server accept is a field here. Unknown options are an
error, never silently dropped. Environment variables are only documented aliases of fields
(`OPENINFER_CACHE` -> `cache_dir`, `OPENINFER_WORKER_AUTHKEY` -> `worker_authkey`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_MODEL = "smollm2-135m-instruct"

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


# kv_cache_dtype values for the FP8 KV cache of the Llama family and Gemma-3 (vLLM's names; docs/kv_cache_fp8.md)
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")
# DeepSeek-V4's own cache format as FlashMLA reads it (vLLM's name; quantization/kv_formats.py: Fp8DsMlaCodec)
DS_MLA_KV_CACHE_DTYPE = "fp8_ds_mla"

# ---- speculative decoding (spec_decode/, docs/spec_decode.md) ----------------------------------------------
SPECULATIVE_METHODS = ("ngram", "draft_head", "mtp", "dspark")
SPECULATIVE_POLICIES = ("fixed", "confidence")
MAX_NGRAM_DRAFTS = 16                # prompt lookup copies at most this many tokens per step


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    # "fixed": verify every draft; "confidence": DSpark's global budget split by the drafts' confidences
    # (spec_decode/policy.py)
    policy: str = "fixed"
    # "confidence": draft tokens verified per step over the whole batch (None: half of max_num_seqs x k)
    verify_budget: int | None = None
    # ngram (prompt lookup): the longest suffix n-gram in [min, max] that occurred earlier is matched
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # draft_head: the directory of a head trained by `python -m openinfer.tools.train_draft_head`
    draft_model: str | None = None

    @classmethod
    def from_value(cls, value: "SpeculativeConfig | dict | None") -> "SpeculativeConfig | None":
        """A dict (CLI JSON, LLM keyword) or an instance; unknown keys are refused by name."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or SpeculativeConfig, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {sorted(known)}")
        missing = [k for k in ("method", "num_speculative_tokens") if k not in value]
        if missing:
            raise ValueError(f"speculative_config needs {missing}")
        return cls(**value)

    def validate(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method {self.method!r} is not available; built: {list(SPECULATIVE_METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or k < 1 or k > MAX_NGRAM_DRAFTS:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, {MAX_NGRAM_DRAFTS}] for "
                             f"{self.method!r}, got {k!r}")
        if (self.method == "draft_head") != (self.draft_model is not None):
            raise ValueError("speculative_config: method 'draft_head' needs draft_model (a directory written by "
                             "python -m openinfer.tools.train_draft_head), and draft_model needs method 'draft_head'")
        if self.policy not in SPECULATIVE_POLICIES:
            raise ValueError(f"speculative_config policy must be one of {list(SPECULATIVE_POLICIES)}, got {self.policy!r}")
        if self.verify_budget is not None and self.verify_budget < 1:
            raise ValueError(f"verify_budget must be >= 1, got {self.verify_budget}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min}, "
                             f"{self.prompt_lookup_max}")


def default_cache_dir() -> Path:
    """`OPENINFER_CACHE` if set, else `~/.cache/openinfer`."""
    env = os.environ.get("OPENINFER_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "openinfer"


def parse_host_port(address: str, name: str) -> tuple[str, int]:
    """"host:port" (IPv6 as "[::1]:port") -> (host, port); a ValueError naming `name` otherwise."""
    host, sep, port = str(address).rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{name} must be 'host:port' with a port in 1..65535, got {address!r}")
    return host, int(port)


def _opt(default, help: str, **cli):
    """A field of EngineConfig with its one description: `help` is what the CLI shows (entrypoints/cli_args.py
    generates every engine flag from these), `cli` its extras: `aliases` (more flags), `choices`, `metavar`,
    `json` (the value is JSON on the command line), `cli=False` (no flag: a secret, or set another way)."""
    return dataclasses.field(default=default, metadata={"help": help, **cli})


@dataclass
class EngineConfig:
    """Every engine setting, declared once: `LLM(**options)`, the CLI flags (`--max-num-seqs`, ...) and the server
    take these fields and nothing else (unknown options are an error, never silently dropped)."""
    model: str = _opt(DEFAULT_MODEL, "short name, HF directory or .gguf file")
    device: str | None = _opt(None, "cpu | cuda | cuda:N (default: cuda if present)")
    dtype: str = _opt("auto", "auto (float32 on CPU, bfloat16 on CUDA) | float32 | bfloat16 | float16")
    max_model_len: int | None = _opt(None, "longest request in tokens (default: the model's, capped to the KV pool)")
    max_num_seqs: int = _opt(256, "running requests per step")
    max_num_batched_tokens: int = _opt(2048, "tokens per step (decodes + prefill chunks)")
    block_size: int = _opt(128, "tokens per KV page (DeepInfer's block size)")
    enable_prefix_caching: bool = _opt(True, "reuse the KV of cached prompt prefixes", aliases=["--no-prefix-caching"])
    kv_cache_memory_bytes: int | None = _opt(None, "KV pool budget in bytes (default: 2 GiB on CPU, else from "
                                                   "--gpu-memory-utilization)")
    gpu_memory_utilization: float = _opt(0.90, "CUDA: fraction of device memory the engine may use in total")
    num_kv_blocks: int | None = _opt(None, "exact KV pool size in blocks (overrides the byte budget)")
    num_window_kv_blocks: int | None = _opt(
        None, "sliding-window models: exact size of the window group's pool (default: sized from max_num_seqs, "
              "max_num_batched_tokens and the window; kv_cache/window_group.py)")
    num_state_snapshots: int | None = _opt(
        None, "models with per-request state (DeepSeek's windows and compressor rows): copies of that state kept at "
              "block boundaries for prefix hits (default: 2 x max_num_seqs)")
    seed: int = _opt(0, "engine RNG for requests without their own seed")
    logprobs_mode: str = _opt("raw_logprobs", "logprobs from the model (raw_logprobs) or after penalties, "
                                              "temperature, top-k/p (processed_logprobs)",
                              choices=["raw_logprobs", "processed_logprobs"])
    cache_dir: str | None = _opt(None, "converted weights and fetched models (default: $OPENINFER_CACHE or "
                                       "~/.cache/openinfer)")
    attention_backend: str = _opt("auto", "torch (reference) | triton (CUDA); auto: triton on CUDA",
                                  choices=["auto", "torch", "triton"])
    enforce_eager: bool = _opt(False, "CUDA: no CUDA graphs for decode steps")
    flash_mla: str = _opt(
        "auto", "CUDA, DeepSeek-V4 prefill attention through FlashMLA's SM90 sparse prefill (PyPI sgl-flash-mla, "
                "optional): auto (where it is installed, the GPU is SM90 and a layer's keys are bf16; else the Triton "
                "kernel) or off (the Triton kernel always; docs/deepseek_v4.md)", choices=["auto", "off"])
    cuda_graph_capture: str = _opt(
        "startup", "CUDA: when decode graphs of models with context buckets (DeepSeek-V4/V4.1) are captured: "
                   "startup (every batch x context bucket before the first request, so no step captures under "
                   "traffic) or first_use (each when a step first needs it: a faster start, stalls later)",
        choices=["startup", "first_use"])
    load_format: str = _opt("auto", "auto: weights from the checkpoint; dummy: random weights of its shape and "
                                    "formats (benchmarks)", choices=["auto", "dummy"])
    async_scheduling: bool | None = _opt(
        None, "queue step N+1 while the device runs N (default: on for CUDA, off for CPU; with speculation only "
              "when given: steps then start on the guess that all drafts in flight are kept)")
    speculative_config: object = _opt(
        None, 'speculative decoding, e.g. {"method": "ngram", "num_speculative_tokens": 4} (policy "fixed" | '
              '"confidence", verify_budget, prompt_lookup_min/max; docs/spec_decode.md)', json=True, metavar="JSON")
    quantization: str | None = _opt(None, "int4: weight-only int4 linears with bf16 activations (CPU)",
                                    choices=["int4"])
    quantize_activations: bool = _opt(
        True, "FP8 checkpoints: quantize the inputs of FP8 linears per token in groups of the weight block, as "
              "DeepSeek's inference code does (W8A8); off: dequantize the weights only (W8A16; docs/quantization.md)")
    kv_cache_dtype: str = _opt(
        "auto", "how caches store entries: auto (the model's own format: DeepSeek-V4.1 FP8/FP4 as DeepSeek stores "
                "them, else the model dtype); the model dtype (unquantized); fp8 or fp8_e4m3 (Llama family, Gemma-3: "
                "FP8 E4M3 K/V with a float32 scale per token and head; docs/kv_cache_fp8.md); fp8_ds_mla "
                "(DeepSeek-V4: window and compressed entries as FlashMLA reads them, FP8 with a power-of-two scale "
                "per 64 values and a bf16 RoPE part, 584 B at head_dim 512; docs/deepseek_v4.md)")
    v41_prefill_mode: str = _opt(
        "exact", "DeepSeek-V4.1 prefill: exact (every layer over every prompt token, DeepSeek's reference) or yoco "
                 "(decoder layers over the prompt's last v41_prefill_keep_tokens only; docs/deepseek_v41.md)",
        choices=["exact", "yoco"])
    engram_tables: str = _opt("device", "DeepSeek-V4.1 Engram tables in GPU memory or pinned host memory (read in "
                                        "place; CPU engines keep them in host memory either way)",
                              choices=["device", "host"])
    v41_prefill_keep_tokens: int = _opt(140, "DeepSeek-V4.1 YOCO: prompt tokens the decoder layers run over "
                                             "(prefix hits leave at least that many to compute)")
    structured_output_compile_threads: int = _opt(2, "structured output: threads compiling grammars")
    structured_output_compile_timeout_s: float = _opt(30.0, "structured output: the longest a request waits for its "
                                                            "grammar before it fails")
    structured_output_cache_size: int = _opt(256, "structured output: compiled grammars kept")
    structured_output_any_whitespace: bool = _opt(False, "structured output: JSON may hold free whitespace (off: "
                                                         "compact separators, which keeps small models from padding)")
    prefill_step_budget_ms: float | None = _opt(
        None, "size prefill chunks so each step's predicted time stays within this many ms (step cost fitted by "
              "`openinfer calibrate`, or at start if missing; engine/cost_model.py)", metavar="MS")
    batch_invariant: bool = _opt(False, "a request's logits and tokens are the same bits alone or in any batch, "
                                        "chunking and row position (slower; Llama family and Gemma-3, one process; "
                                        "docs/structured_output.md, Determinism)")
    kv_store_dir: str | None = _opt(
        None, "prefix-KV store directory (local disk or a shared mount): full KV blocks any process using it "
              "computed are hits for every other (docs/kv_cache.md)", metavar="DIR")
    kv_store_url: str | None = _opt(None, "prefix-KV store on a Redis server (redis://HOST:PORT/DB; needs the redis "
                                          "package)", metavar="URL")
    kv_host_cache_bytes: int | None = _opt(None, "prefix-KV store: host-RAM tier size (default 1 GiB with a store "
                                                 "directory or Redis, else none)", metavar="BYTES")
    kv_store_capacity_bytes: int | None = _opt(None, "prefix-KV store: cap of the directory tier (default: uncapped)",
                                               metavar="BYTES")
    kv_store_ttl_s: float = _opt(7 * 86400.0, "prefix-KV store: seconds a block is kept (a request's cache_ttl "
                                              "overrides it)", metavar="SECONDS")
    kv_store_write_buffer_bytes: int = _opt(
        1 << 30, "prefix-KV store: host bytes of blocks waiting for the store's writer thread; past it a write is "
                 "dropped (and counted), so a step never waits for the store", metavar="BYTES")
    swa_state_bytes: int | None = _opt(
        None, "sliding-window models with a store: host memory for the windowed layers' rows of ended requests' "
              "last windows (default 256 MiB with a store, 0: none; docs/kv_cache.md)", metavar="BYTES")
    encoder_cache_bytes: int = _opt(
        256 << 20, "vision models: memory for the image embeddings already computed, by image digest (least recently "
                   "used evicted first; 0: every chunk that reads an image encodes it again)", metavar="BYTES")
    max_images_per_prompt: int = _opt(8, "vision models: most images one request may hold (more: a 400)")
    max_image_bytes: int = _opt(20 << 20, "vision models: largest encoded image a request may send or point to "
                                          "(bytes; larger: a 400)", metavar="BYTES")
    image_fetch_timeout_s: float = _opt(10.0, "vision models: seconds to fetch and preprocess a request's images "
                                              "(http(s) URLs; past it: a 400)", metavar="SECONDS")
    swa_replay: str = _opt("bounded", "a prefix hit without its window state replays the last window with attention "
                                      "truncated to it (bounded, the spec's §5.4) or from the first missing block "
                                      "(exact)", choices=["bounded", "exact"])
    data_parallel_size: int = _opt(1, "DP ranks, each with its own requests and KV pool (one process per rank)",
                                   aliases=["-dp"])
    tensor_parallel_size: int = _opt(1, "TP ranks per DP group", aliases=["-tp"])
    context_parallel_size: int = _opt(1, "CP ranks per DP group: each step's prefill chunks are split over them "
                                         "(balanced: each rank a front and a back piece), K/V all-gathered per "
                                         "layer; decode runs whole on each (docs/parallelism.md)", aliases=["-cp"])
    enable_expert_parallel: bool = _opt(False, "MoE models: split the routed experts over all ranks (attention DP + "
                                               "EP, DeepInfer's layout)")
    enable_eplb: bool = _opt(False, "expert parallelism: rebalance experts by measured load (EPLB)")
    num_redundant_experts: int = _opt(0, "EPLB: extra expert slots (at least; rounded up so routed + redundant "
                                         "divide by the EP size)")
    eplb_window_steps: int = _opt(1000, "EPLB: steps of load statistics (the spec's decode value)")
    eplb_rebalance_interval_steps: int = _opt(10000, "EPLB: steps between rebalances")
    step_sync_channel: str = _opt(
        "auto", "expert parallelism: how ranks agree on each step's shape: shm (shared memory, every rank on this "
                "host), gloo (a host all-reduce over TCP) or auto (shm when every rank is local)",
        choices=["auto", "shm", "gloo"])
    moe_dispatch: str = _opt(
        "auto", "expert parallelism: the MoE token exchange: all_gather (every rank sees every token; "
                "reduce-scatter back), all_to_all (each token only to the ranks of its experts, fixed padded "
                "capacity per destination), all_to_all_exact (eager steps send only real rows, after exchanging "
                "counts; graph replays run all_to_all) or auto (the engine picks per EP size and step; "
                "docs/parallelism.md)",
        choices=["auto", "all_gather", "all_to_all", "all_to_all_exact"])
    two_batch_overlap: bool = _opt(False, "expert parallelism: split a step's rows into two micro-batches whose "
                                          "MoE exchanges overlap the other's compute (outputs identical)")
    two_batch_split: str = _opt(
        "rows", "expert parallelism, steps of >= 32 rows per rank: rows (the MoE exchange and experts run in two "
                "halves of the rows; two_batch_overlap overlaps them with each other) or requests (DeepSeek-V4: each "
                "layer runs on two micro-batches of whole requests, each with its own attention; two_batch_overlap "
                "staggers them so one's exchanges overlap the other's attention and experts; docs/parallelism.md)",
        choices=["rows", "requests"])
    distributed_executor_backend: str = _opt(
        "mp", "how the ranks of a multi-rank engine start: mp (one process per rank on this host, plus `openinfer "
              "worker` ranks on other hosts) or ray (one Ray actor per rank, placed by placement groups on the Ray "
              "cluster at $RAY_ADDRESS, the one `ray start` runs here, or a new local one; needs openinfer[ray]; "
              "docs/deployment.md)", choices=["mp", "ray"])
    distributed_init_method: str | None = _opt(
        None, "rendezvous of the worker processes: env:// (torchrun's MASTER_ADDR/MASTER_PORT) or tcp://host:port "
              "(default: a free local port; with ranks on other hosts required, reachable from every host)")
    num_local_ranks: int | None = _opt(None, "several hosts: ranks 0..N-1 run on this host (default: all); the "
                                             "others connect from `openinfer worker` on other hosts")
    worker_listen_address: str | None = _opt(None, "several hosts: where the other hosts' workers connect (authkey: "
                                                   "$OPENINFER_WORKER_AUTHKEY, the same on every host)",
                                             metavar="HOST:PORT")
    worker_authkey: str | None = _opt(None, "several hosts: the workers' shared HMAC key (alias: the environment "
                                            "variable OPENINFER_WORKER_AUTHKEY)", cli=False)
    worker_start_timeout_s: float = _opt(1800.0, "how long to wait for every rank to connect and load",
                                         aliases=["--worker-start-timeout"], metavar="SECONDS")

    def __post_init__(self) -> None:
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(f"distributed_executor_backend must be 'mp' or 'ray', got "
                             f"{self.distributed_executor_backend!r}")
        # under Ray the GPUs are the cluster's: the front end (the Ray driver) needs none of its own
        if self.device.startswith("cuda") and not torch.cuda.is_available() and not self.uses_ray:
            raise ValueError("device='cuda' requested but torch sees no CUDA device")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.num_window_kv_blocks is not None and self.num_window_kv_blocks < 1:
            raise ValueError(f"num_window_kv_blocks must be >= 1, got {self.num_window_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be 'auto', 'torch' or 'triton', got {self.attention_backend!r}")
        if self.flash_mla not in ("auto", "off"):
            raise ValueError(f"flash_mla must be 'auto' or 'off', got {self.flash_mla!r}")
        if self.cuda_graph_capture not in ("startup", "first_use"):
            raise ValueError(f"cuda_graph_capture must be 'startup' or 'first_use', got {self.cuda_graph_capture!r}")
        if self.attention_backend == "triton" and self.device == "cpu":
            raise ValueError("attention_backend='triton' needs device='cuda'")
        if self.engram_tables not in ("device", "host"):
            raise ValueError(f"engram_tables must be 'device' or 'host', got {self.engram_tables!r}")
        if self.v41_prefill_mode not in ("exact", "yoco"):
            raise ValueError(f"v41_prefill_mode must be 'exact' or 'yoco', got {self.v41_prefill_mode!r}")
        if not isinstance(self.v41_prefill_keep_tokens, int) or self.v41_prefill_keep_tokens < 1:
            raise ValueError(f"v41_prefill_keep_tokens must be an integer >= 1, got {self.v41_prefill_keep_tokens!r}")
        if self.kv_cache_dtype not in ("auto", *FP8_KV_CACHE_DTYPES, DS_MLA_KV_CACHE_DTYPE, *_DTYPES):
            raise ValueError(f"kv_cache_dtype must be 'auto', one of {list(FP8_KV_CACHE_DTYPES)}, "
                             f"{DS_MLA_KV_CACHE_DTYPE!r} or one of {sorted(_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.quantization not in (None, "int4"):
            raise ValueError(f"quantization must be None or 'int4', got {self.quantization!r}")
        if self.quantization == "int4":
            if self.device != "cpu":
                raise ValueError("quantization='int4' is a CPU path (torch's int4 CPU kernel); use device='cpu'")
            if self.dtype not in ("auto", "bfloat16", "bf16"):
                raise ValueError(f"quantization='int4' computes in bfloat16; dtype {self.dtype!r} is not possible")
        if self.structured_output_compile_threads < 1 or self.structured_output_cache_size < 1:
            raise ValueError("structured_output_compile_threads and structured_output_cache_size must be >= 1")
        if not self.structured_output_compile_timeout_s > 0:
            raise ValueError(f"structured_output_compile_timeout_s must be > 0, got "
                             f"{self.structured_output_compile_timeout_s}")
        if self.prefill_step_budget_ms is not None and not self.prefill_step_budget_ms > 0:
            raise ValueError(f"prefill_step_budget_ms must be > 0, got {self.prefill_step_budget_ms}")
        for name in ("data_parallel_size", "tensor_parallel_size", "context_parallel_size", "eplb_window_steps",
                     "eplb_rebalance_interval_steps"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.context_parallel_size > 1 and self.tensor_parallel_size > 1:
            raise ValueError("context_parallel_size > 1 does not combine with tensor_parallel_size > 1 yet: use "
                             "context_parallel_size with data_parallel_size (and enable_expert_parallel)")
        if self.context_parallel_size > 1 and self.v41_prefill_mode == "yoco":
            raise ValueError("context_parallel_size > 1 runs v41_prefill_mode='exact' only (YOCO's decoder rows "
                             "would need their own split)")
        if self.num_redundant_experts < 0:
            raise ValueError(f"num_redundant_experts must be >= 0, got {self.num_redundant_experts}")
        for name, allowed in (("step_sync_channel", ("auto", "shm", "gloo")),
                              ("moe_dispatch", ("auto", "all_gather", "all_to_all", "all_to_all_exact")),
                              ("two_batch_split", ("rows", "requests"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if not self.enable_expert_parallel:
            unused = [f"{name}={value!r}" for name, value, default in (
                ("two_batch_overlap", self.two_batch_overlap, False), ("moe_dispatch", self.moe_dispatch, "auto"),
                ("two_batch_split", self.two_batch_split, "rows"),
                ("step_sync_channel", self.step_sync_channel, "auto")) if value != default]
            if unused:
                raise ValueError(f"{', '.join(unused)} need enable_expert_parallel (they set the MoE exchanges and "
                                 f"the step agreement of expert-parallel ranks)")
        if self.two_batch_split == "requests" and self.context_parallel_size > 1:
            raise ValueError("two_batch_split='requests' does not combine with context_parallel_size > 1 (a chunk's "
                             "rows are spread over the CP ranks)")
        if self.enable_eplb and not self.enable_expert_parallel:
            raise ValueError("enable_eplb needs enable_expert_parallel (EPLB places experts across EP ranks)")
        if self.num_redundant_experts and not self.enable_eplb:
            raise ValueError("num_redundant_experts needs enable_eplb (replicas are placed by EPLB)")
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.from_value(self.speculative_config)
            self.speculative_config.validate()
            if self.world_size > 1:
                raise ValueError("speculative_config is not supported with tensor/data/expert parallelism yet")
            if self.speculative_config.method == "dspark" and self.v41_prefill_mode == "yoco":
                raise ValueError("speculative_config method 'dspark' needs every prompt row's features: it runs "
                                 "with v41_prefill_mode='exact' (YOCO skips the decoder layers for most rows)")
        if self.batch_invariant:
            if self.world_size > 1:
                raise ValueError("batch_invariant is a one-process mode for now (tensor-parallel all-reduces and "
                                 "expert exchanges are not batch-invariant)")
            if self.quantization is not None:
                raise ValueError(f"batch_invariant does not cover quantization={self.quantization!r} (its int4 "
                                 f"GEMMs choose kernels by batch size)")
            if self.device != "cpu" and self.attention_backend == "torch":
                raise ValueError("batch_invariant on CUDA needs the Triton attention backend "
                                 "(attention_backend='auto' or 'triton')")
        if self.kv_host_cache_bytes is not None and (not isinstance(self.kv_host_cache_bytes, int)
                                                     or self.kv_host_cache_bytes < 0):
            raise ValueError(f"kv_host_cache_bytes must be an integer >= 0, got {self.kv_host_cache_bytes!r}")
        if self.kv_store_capacity_bytes is not None and (not isinstance(self.kv_store_capacity_bytes, int)
                                                         or self.kv_store_capacity_bytes < 1):
            raise ValueError(f"kv_store_capacity_bytes must be an integer >= 1, got {self.kv_store_capacity_bytes!r}")
        if (not isinstance(self.kv_store_write_buffer_bytes, int) or isinstance(self.kv_store_write_buffer_bytes, bool)
                or self.kv_store_write_buffer_bytes < 1):
            raise ValueError(f"kv_store_write_buffer_bytes must be an integer >= 1, "
                             f"got {self.kv_store_write_buffer_bytes!r}")
        if not self.kv_store_ttl_s > 0:
            raise ValueError(f"kv_store_ttl_s must be > 0, got {self.kv_store_ttl_s}")
        if self.kv_store_url is not None and not str(self.kv_store_url).startswith(("redis://", "rediss://",
                                                                                     "unix://")):
            raise ValueError(f"kv_store_url must be a redis://, rediss:// or unix:// URL, got {self.kv_store_url!r}")
        for name in ("max_images_per_prompt", "max_image_bytes", "encoder_cache_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "encoder_cache_bytes" else 1):
                raise ValueError(f"{name} must be an integer >= {0 if name == 'encoder_cache_bytes' else 1}, "
                                 f"got {v!r}")
        if not self.image_fetch_timeout_s > 0:
            raise ValueError(f"image_fetch_timeout_s must be > 0, got {self.image_fetch_timeout_s}")
        if self.swa_replay not in ("bounded", "exact"):
            raise ValueError(f"swa_replay must be 'bounded' or 'exact', got {self.swa_replay!r}")
        if self.swa_state_bytes is not None and (not isinstance(self.swa_state_bytes, int)
                                                 or isinstance(self.swa_state_bytes, bool) or self.swa_state_bytes < 0):
            raise ValueError(f"swa_state_bytes must be an integer >= 0, got {self.swa_state_bytes!r}")
        if self.kv_store_capacity_bytes is not None and self.kv_store_dir is None:
            raise ValueError("kv_store_capacity_bytes caps the kv_store_dir tier: set kv_store_dir too")
        if self.kv_store_enabled:
            if not self.enable_prefix_caching:
                raise ValueError("the prefix-KV store (kv_store_dir / kv_store_url / kv_host_cache_bytes) is keyed "
                                 "by the prefix cache's block hashes: it needs enable_prefix_caching")
            if self.world_size > 1:
                raise ValueError("the prefix-KV store (kv_store_dir / kv_store_url / kv_host_cache_bytes) is a "
                                 "one-process feature for now (data_parallel_size x tensor_parallel_size = 1)")
        if self.enable_expert_parallel and self.world_size == 1:
            raise ValueError("enable_expert_parallel needs more than one rank: set data_parallel_size "
                             "(attention DP + EP) or tensor_parallel_size")
        if not self.worker_start_timeout_s > 0:
            raise ValueError(f"worker_start_timeout_s must be > 0, got {self.worker_start_timeout_s}")
        if self.uses_ray:
            self._check_ray()
        elif self.num_local_ranks is not None and (not isinstance(self.num_local_ranks, int)
                                                 or not 1 <= self.num_local_ranks <= self.world_size):
            raise ValueError(f"num_local_ranks must be an integer in 1..{self.world_size} (the world size, "
                             f"data_parallel_size x tensor_parallel_size), got {self.num_local_ranks!r}")
        if self.local_ranks < self.world_size and not self.uses_ray:     # ranks `openinfer worker` starts
            if self.worker_listen_address is None:
                raise ValueError(f"num_local_ranks={self.num_local_ranks} < world size {self.world_size}: set "
                                 f"worker_listen_address ('host:port' where the other hosts' workers connect)")
            parse_host_port(self.worker_listen_address, "worker_listen_address")
            if self.distributed_init_method is None:
                raise ValueError("with ranks on other hosts, distributed_init_method must be given: 'env://' or "
                                 "'tcp://host:port' reachable from every host (the default, a free port on "
                                 "127.0.0.1, cannot be reached from other hosts)")
            if not self.resolved_worker_authkey:
                raise ValueError("ranks on other hosts need an authkey: set worker_authkey or the environment "
                                 "variable OPENINFER_WORKER_AUTHKEY (the same on every host)")
        elif self.worker_listen_address is not None:
            raise ValueError("worker_listen_address is only used with ranks on other hosts "
                             f"(num_local_ranks < world size {self.world_size})")
        if self.step_sync_channel == "shm" and self.local_ranks < self.world_size:
            raise ValueError("step_sync_channel='shm' needs every rank on this host (shared memory); with ranks on "
                             "other hosts or under Ray use 'gloo' or 'auto'")
        if self.world_size > 1:
            if self.device.startswith("cuda") and self.local_ranks > torch.cuda.device_count():   # (none under Ray)
                raise ValueError(f"{self.local_ranks} ranks on this host need as many GPUs; torch sees "
                                 f"{torch.cuda.device_count()} (data_parallel_size x tensor_parallel_size = "
                                 f"{self.world_size}, num_local_ranks = {self.num_local_ranks})")
            if self.device.startswith("cuda:"):
                raise ValueError("with several ranks, device must be 'cuda' (rank r uses GPU r), not a single GPU")
            if self.quantization is not None:
                raise ValueError(f"quantization={self.quantization!r} is a one-process CPU path")
        if self.logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise ValueError(f"logprobs_mode must be 'raw_logprobs' or 'processed_logprobs', got {self.logprobs_mode!r}")

    def _check_ray(self) -> None:
        """What the Ray backend cannot take, refused by name before anything starts; and Ray itself, an extra."""
        if self.world_size == 1:
            raise ValueError("distributed_executor_backend='ray' starts one Ray actor per rank: it needs several "
                             "ranks (data_parallel_size x tensor_parallel_size > 1); one rank runs in this process")
        for name in ("num_local_ranks", "worker_listen_address", "worker_authkey"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} is for ranks started by `openinfer worker` "
                                 f"(distributed_executor_backend='mp'); under 'ray' Ray places every rank")
        try:
            import ray  # noqa: F401
        except ImportError as e:
            raise ValueError(f"distributed_executor_backend='ray' needs Ray, an optional extra: "
                             f"pip install 'openinfer[ray]' ({e})") from None

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; known options: {sorted(known)}")
        return cls(**kwargs)

    @property
    def world_size(self) -> int:
        return self.data_parallel_size * self.ranks_per_dp_group

    @property
    def ranks_per_dp_group(self) -> int:
        """Ranks sharing one DP group's requests and schedule: its TP ranks times its CP ranks."""
        return self.context_parallel_size * self.tensor_parallel_size

    @property
    def kv_store_enabled(self) -> bool:
        return bool(self.kv_store_dir or self.kv_store_url or self.kv_host_cache_bytes)

    @property
    def resolved_kv_host_cache_bytes(self) -> int:
        """The host tier's size: kv_host_cache_bytes, else 1 GiB when a directory or Redis tier is set."""
        if self.kv_host_cache_bytes is not None:
            return self.kv_host_cache_bytes
        return 1 << 30 if (self.kv_store_dir or self.kv_store_url) else 0

    @property
    def resolved_swa_state_bytes(self) -> int:
        """Host memory for sliding-window state: swa_state_bytes, else 256 MiB when a prefix-KV store is set."""
        if self.swa_state_bytes is not None:
            return self.swa_state_bytes
        return 256 << 20 if self.kv_store_enabled else 0

    @property
    def uses_ray(self) -> bool:
        return self.distributed_executor_backend == "ray"

    @property
    def local_ranks(self) -> int:
        """Ranks the front end spawns as processes of its own host (ranks 0..local_ranks-1; none under Ray)."""
        if self.uses_ray:
            return 0
        return self.world_size if self.num_local_ranks is None else self.num_local_ranks

    @property
    def resolved_step_sync_channel(self) -> str:
        """`step_sync_channel`, with auto resolved: shared memory when the front end spawns every rank here."""
        if self.step_sync_channel != "auto":
            return self.step_sync_channel
        return "shm" if self.local_ranks == self.world_size else "gloo"

    @property
    def resolved_worker_authkey(self) -> str | None:
        """`worker_authkey`, else the environment variable `OPENINFER_WORKER_AUTHKEY`."""
        return self.worker_authkey or os.environ.get("OPENINFER_WORKER_AUTHKEY") or None

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.float32 if self.device == "cpu" and self.quantization is None else torch.bfloat16
        return _DTYPES[self.dtype]

    @property
    def resolved_attention_backend(self) -> str:
        if self.attention_backend == "auto":
            return "torch" if self.device == "cpu" else "triton"
        return self.attention_backend

    @property
    def use_cuda_graphs(self) -> bool:
        return self.device != "cpu" and not self.enforce_eager and self.resolved_attention_backend == "triton"

    @property
    def use_async_scheduling(self) -> bool:
        """Asked for (or the device's default). With speculation the engine runs it only when asked for
        explicitly (LLMEngine.async_scheduling)."""
        return self.device != "cpu" if self.async_scheduling is None else self.async_scheduling

    @property
    def speculates_async(self) -> bool:
        """Speculation under async scheduling: the next step may be queued on the guess that the verify step in
        flight keeps all its drafts (docs/spec_decode.md, "Async scheduling")."""
        return self.speculative_config is not None and self.async_scheduling is True

    @property
    def rollback_rows(self) -> int:
        """Room per-request state rings keep past the last accepted position for rows a later step rolls back
        (docs/spec_decode.md, "Rolling back DeepSeek state"): a verify step's k drafts; under async scheduling
        also the 1 + k rows of a step queued on the guess that those drafts are kept (2k + 1). 0 without
        speculation: the layout is then what it always was."""
        if self.speculative_config is None:
            return 0
        k = self.speculative_config.num_speculative_tokens
        return 2 * k + 1 if self.speculates_async else k

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir).expanduser() if self.cache_dir else default_cache_dir()
