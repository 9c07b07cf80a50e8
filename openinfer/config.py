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


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL
    device: str | None = None             # "cpu" / "cuda" / "cuda:N"; None: cuda if present
    dtype: str = "auto"                   # auto: float32 on CPU, bfloat16 on CUDA
    max_model_len: int | None = None      # None: the model's max_position_embeddings, capped to the KV pool
    max_num_seqs: int = 256               # running requests per step
    max_num_batched_tokens: int = 2048    # tokens per step (decodes + prefill chunks)
    block_size: int = 128                 # tokens per KV page (DeepInfer's block size)
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None  # KV pool budget; None: 2 GiB on CPU, see gpu_memory_utilization
    gpu_memory_utilization: float = 0.90  # CUDA: fraction of device memory the engine may use in total
    num_kv_blocks: int | None = None      # exact pool size (overrides the byte budget; tests use it)
    # sliding-window models: exact size of the window group's pool (kv_cache/window_group.py; None: sized by
    # ModelRunner._pool_sizes from max_num_seqs, max_num_batched_tokens and the window)
    num_window_kv_blocks: int | None = None
    # models with per-request state (DeepSeek-V4's sliding window, compressor rows): how many copies of that
    # state, taken at 128-token block boundaries, the prefix cache keeps (None: 2 x max_num_seqs)
    num_state_snapshots: int | None = None
    seed: int = 0                         # engine RNG for requests without their own seed
    logprobs_mode: str = "raw_logprobs"   # "raw_logprobs" (model) or "processed_logprobs" (after penalties/temperature/top-k/p)
    cache_dir: str | None = None          # converted weights and fetched models; alias: OPENINFER_CACHE
    attention_backend: str = "auto"       # "torch" (reference) | "triton" (CUDA); auto: triton on CUDA
    enforce_eager: bool = False           # CUDA: no CUDA graphs for decode steps
    load_format: str = "auto"             # "auto": weights from the checkpoint; "dummy": random (benchmarks)
    async_scheduling: bool | None = None  # schedule step N+1 while the GPU runs N; None: on for CUDA (off with
    #                                       speculation), off for CPU
    # speculative decoding (spec_decode/, docs/spec_decode.md): {"method": "ngram", "num_speculative_tokens": k,
    # "policy": "fixed" | "confidence", ...}; synchronous scheduling unless async_scheduling=True
    speculative_config: object = None
    quantization: str | None = None       # "int4": weight-only int4 linears, bf16 activations (CPU)
    # FP8 checkpoints (DeepSeek's published format): quantize the activations of FP8 linears per token in
    # groups of the weight block (E4M3, power-of-two scales), as DeepSeek's inference code does (W8A8);
    # False: dequantize the weights only (W8A16), exactly "dequantize, then multiply" (docs/quantization.md)
    quantize_activations: bool = True
    # how KV caches store their entries: "auto" = the model's own format (DeepSeek-V4.1: FP8 window keys, FP4
    # compressed entries and indexer keys, as DeepSeek stores them; other models: the model dtype); a dtype name
    # equal to the model dtype = unquantized (for V4.1: measuring what the cache formats cost, docs/deepseek_v41.md);
    # "fp8" (alias "fp8_e4m3"), Llama family and Gemma-3: K/V in FP8 E4M3 with a float32 scale per token, K/V and
    # KV head (docs/kv_cache_fp8.md)
    kv_cache_dtype: str = "auto"
    # DeepSeek-V4.1 prefill (docs/deepseek_v41.md): "exact" runs every layer over every prompt token (DeepSeek's
    # reference); "yoco" runs the encoder over every token and the decoder only over the last
    # v41_prefill_keep_tokens, its window attention truncated to them (DeepInfer's `compact` truncation, spec
    # 000 §5.5-5.6; prefix-cache hits then leave at least that many tokens to compute)
    v41_prefill_mode: str = "exact"
    # DeepSeek-V4.1 Engram tables: "device" (GPU memory) or "host" (pinned host memory, read by the GPU in place:
    # the released 2 x 98 GB tables; CPU engines keep them in host memory either way)
    engram_tables: str = "device"
    v41_prefill_keep_tokens: int = 140
    # Structured output (docs/structured_output.md): worker threads compiling grammars, the longest a request
    # waits for its grammar before it fails, compiled grammars kept, whether JSON may hold free whitespace
    # (off: compact separators, which keeps small models from padding with spaces)
    structured_output_compile_threads: int = 2
    structured_output_compile_timeout_s: float = 30.0
    structured_output_cache_size: int = 256
    structured_output_any_whitespace: bool = False
    # Time-budgeted chunked prefill (engine/cost_model.py): each step's prefill chunks are sized so the step's
    # predicted time (decodes first) stays within this many ms, from a step cost fitted on this model and
    # device (`openinfer calibrate`; calibrated at start if missing). None: the token budget only.
    prefill_step_budget_ms: float | None = None
    # Batch-invariant mode (layers/batch_invariant.py, docs/structured_output.md "Determinism"): a request's
    # logits and tokens are bitwise the same alone or in any batch, chunking and row position -- GEMMs, attention,
    # norms and the sampler reduce in orders that do not depend on the batch. Costs speed; see BENCHMARKS.md.
    batch_invariant: bool = False
    # Prefix-KV store (kv_cache/kv_store.py, docs/kv_cache.md): full KV blocks kept beyond the GPU pool, keyed by
    # the prefix hash chain, so a later request -- in this process, after a restart, or in any process sharing
    # the directory or Redis server -- skips recomputing a prefix it finds there. Tiers: host RAM
    # (kv_host_cache_bytes; None: 1 GiB when a directory or Redis is set, else none), a directory (local disk or
    # a shared mount: 3FS, NFS, Lustre; capped at kv_store_capacity_bytes, None: uncapped), a Redis server
    # ("redis://host:port/db"). Blocks are kept kv_store_ttl_s seconds (a request's cache_ttl overrides it).
    # Models without per-request state, one process (world size 1) for now.
    kv_store_dir: str | None = None
    kv_store_url: str | None = None
    kv_host_cache_bytes: int | None = None
    kv_store_capacity_bytes: int | None = None
    kv_store_ttl_s: float = 7 * 86400.0
    # host bytes of blocks waiting for the store's writer thread; past it a write is dropped (and counted), so a
    # step never waits for the store. A long prompt queues all its blocks at once: 1 GiB holds 8K tokens of a
    # Llama-3-8B-shaped KV
    kv_store_write_buffer_bytes: int = 1 << 30
    # Sliding-window models (Gemma-3) with a store (kv_cache/bounded_replay.py, docs/kv_cache.md): the store keeps
    # only the full-attention layers' rows; the windowed layers' rows of the last window before a request's
    # last block boundary go to host memory when it ends (swa_state_bytes; None: 256 MiB when a store is set).
    # A hit without them replays the end of the prefix: "bounded" (the last window, attention truncated to it;
    # the spec's §5.4, approximate) or "exact" (from the first missing block, full windows).
    swa_state_bytes: int | None = None
    swa_replay: str = "bounded"
    # Parallelism (docs/parallelism.md; vLLM's names). One worker process per rank, world = DP x TP ranks:
    # DP ranks own their requests and KV pools, TP ranks split each matrix; with expert parallelism the
    # routed experts of MoE models are split over all ranks (attention DP + EP, DeepInfer's layout).
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    # EPLB: redundant experts (a lower bound, rounded up so routed + redundant divide by the EP size), token
    # counts per expert over a window of steps, a new placement every interval, weights moved between ranks
    enable_eplb: bool = False
    num_redundant_experts: int = 0
    eplb_window_steps: int = 1000             # the spec's decode values (prefill: 100 / 1,000)
    eplb_rebalance_interval_steps: int = 10000
    # rendezvous of the worker processes: None = a free local TCP port; "env://" = torchrun's variables
    # (MASTER_ADDR, MASTER_PORT) for several hosts; or "tcp://host:port"
    distributed_init_method: str | None = None
    # Several hosts (docs/parallelism.md): the front end spawns ranks 0..num_local_ranks-1 on its host (None:
    # all of them); the others are `openinfer worker --connect` processes on other hosts, which connect to
    # worker_listen_address ("host:port") and authenticate with worker_authkey (HMAC; alias:
    # OPENINFER_WORKER_AUTHKEY). worker_start_timeout_s bounds the wait for every rank to connect and load.
    num_local_ranks: int | None = None
    worker_listen_address: str | None = None
    worker_authkey: str | None = None
    worker_start_timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
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
        if self.attention_backend == "triton" and self.device == "cpu":
            raise ValueError("attention_backend='triton' needs device='cuda'")
        if self.engram_tables not in ("device", "host"):
            raise ValueError(f"engram_tables must be 'device' or 'host', got {self.engram_tables!r}")
        if self.v41_prefill_mode not in ("exact", "yoco"):
            raise ValueError(f"v41_prefill_mode must be 'exact' or 'yoco', got {self.v41_prefill_mode!r}")
        if not isinstance(self.v41_prefill_keep_tokens, int) or self.v41_prefill_keep_tokens < 1:
            raise ValueError(f"v41_prefill_keep_tokens must be an integer >= 1, got {self.v41_prefill_keep_tokens!r}")
        if self.kv_cache_dtype not in ("auto", *FP8_KV_CACHE_DTYPES, *_DTYPES):
            raise ValueError(f"kv_cache_dtype must be 'auto', one of {list(FP8_KV_CACHE_DTYPES)} or one of "
                             f"{sorted(_DTYPES)}, got {self.kv_cache_dtype!r}")
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
        for name in ("data_parallel_size", "tensor_parallel_size", "eplb_window_steps",
                     "eplb_rebalance_interval_steps"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.num_redundant_experts < 0:
            raise ValueError(f"num_redundant_experts must be >= 0, got {self.num_redundant_experts}")
        if self.enable_eplb and not self.enable_expert_parallel:
            raise ValueError("enable_eplb needs enable_expert_parallel (EPLB places experts across EP ranks)")
        if self.num_redundant_experts and not self.enable_eplb:
            raise ValueError("num_redundant_experts needs enable_eplb (replicas are placed by EPLB)")
        if self.speculative_config is not None:
            from openinfer.spec_decode.config import SpeculativeConfig

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
        if self.num_local_ranks is not None and (not isinstance(self.num_local_ranks, int)
                                                 or not 1 <= self.num_local_ranks <= self.world_size):
            raise ValueError(f"num_local_ranks must be an integer in 1..{self.world_size} (the world size, "
                             f"data_parallel_size x tensor_parallel_size), got {self.num_local_ranks!r}")
        if self.local_ranks < self.world_size:
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
        if self.world_size > 1:
            if self.device.startswith("cuda") and self.local_ranks > torch.cuda.device_count():
                raise ValueError(f"{self.local_ranks} ranks on this host need as many GPUs; torch sees "
                                 f"{torch.cuda.device_count()} (data_parallel_size x tensor_parallel_size = "
                                 f"{self.world_size}, num_local_ranks = {self.num_local_ranks})")
            if self.device.startswith("cuda:"):
                raise ValueError("with several ranks, device must be 'cuda' (rank r uses GPU r), not a single GPU")
            if self.quantization is not None:
                raise ValueError(f"quantization={self.quantization!r} is a one-process CPU path")
        if self.logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise ValueError(f"logprobs_mode must be 'raw_logprobs' or 'processed_logprobs', got {self.logprobs_mode!r}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; known options: {sorted(known)}")
        return cls(**kwargs)

    @property
    def world_size(self) -> int:
        return self.data_parallel_size * self.tensor_parallel_size

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
    def local_ranks(self) -> int:
        """Ranks the front end spawns on its own host (ranks 0..local_ranks-1)."""
        return self.world_size if self.num_local_ranks is None else self.num_local_ranks

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
