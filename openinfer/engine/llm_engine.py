"""LLMEngine: the engine core loop. add_request -> step() (schedule, execute, process outputs) -> outputs.

It wires the parts together and owns request bookkeeping; it holds no policy of its own: the scheduler
decides what runs, the KV manager where it lives, the runner how it runs, the output processor when a
request is done.
"""

from __future__ import annotations

import dataclasses

import threading
import time

import torch

from openinfer.config import EngineConfig
from openinfer.distributed.parallel_state import ParallelContext
from openinfer.engine.compile_watch import install_triton_compile_counter, triton_compiles
from openinfer.engine.model_runner import ModelRunner
from openinfer.engine.output_processor import OutputProcessor
from openinfer.engine.parallel_sampling import ParentRequest, child_params
from openinfer.engine.scheduler import Scheduler
from openinfer.kv_cache.kv_cache_manager import KVCacheManager
from openinfer.layers.attention import TorchPagedAttention
from openinfer.layers.basic import TORCH_OPS
from openinfer.models.interface import ResolvedModel
from openinfer.models.registry import resolve
from openinfer.multimodal import ImageSpan, check_spans
from openinfer.outputs import RequestMetrics, RequestOutput
from openinfer.quantization.reference import weight_only_fp8_linear
from openinfer.request import Request, RequestStatus
from openinfer.sampling_params import SamplingParams
from openinfer.tokenizer import Tokenizer


def make_kernels(config: EngineConfig):
    """(attention backend, layer ops), chosen once at start-up; models never branch on hardware."""
    if config.resolved_attention_backend == "triton":
        from openinfer.layers.triton_attention import TritonPagedAttention
        from openinfer.layers.triton_ops import TRITON_OPS

        backend, ops = TritonPagedAttention(), TRITON_OPS
        if config.flash_mla == "auto":
            from openinfer.layers import flash_mla_prefill

            if flash_mla_prefill.load_error() is None:      # else the Triton kernel, as with flash_mla="off"
                ops = dataclasses.replace(ops, sparse_prefill_attention=flash_mla_prefill.sparse_prefill_attention)
        if config.batch_invariant:
            from openinfer.layers.triton_batch_invariant import BatchInvariantTritonAttention

            backend = BatchInvariantTritonAttention()
    else:
        backend, ops = TorchPagedAttention(), TORCH_OPS
        if config.batch_invariant:
            from openinfer.layers.batch_invariant import BatchInvariantTorchAttention

            backend = BatchInvariantTorchAttention()
    if not config.quantize_activations:
        ops = dataclasses.replace(ops, fp8_linear=weight_only_fp8_linear(ops.grouped_gemm), quantize_activations=False)
    return backend, ops


def warm_up_token_counts(budget: int, longest: int) -> list[int]:
    """Prompt lengths whose prefill steps meet every kernel variant a step of up to `budget` tokens can: 1-3,
    and p, p + 1, p + 16 for each power of two p from 16 up to the budget, and the budget itself."""
    counts = {1, 2, 3, budget}
    p = 16
    while p <= budget:
        counts |= {p, p + 1, p + 16}
        p *= 2
    return sorted(n for n in counts if 1 <= n <= min(budget, longest))


class LLMEngine:
    def __init__(self, config: EngineConfig, parallel: ParallelContext | None = None,
                 model: ResolvedModel | None = None):
        """`parallel`: this process's ranks and groups when it is one worker of a multi-rank engine
        (`executor/multiproc.py` makes it); None for the one-process engine. `model`: the model as the front end
        resolved it (its directory, config and family: read once per start); None: resolved here."""
        self.config = config
        self.parallel = parallel or ParallelContext.single(config.device)
        self.model_source = model or resolve(config)
        self.model_dir = self.model_source.path
        family = self.model_source.family
        self.tokenizer = Tokenizer.from_dir(self.model_dir, family.vocabulary, self.model_source.hf_config)
        backend, ops = make_kernels(config)
        model = family.build(self.model_source, config, backend, ops, self.parallel)
        if config.batch_invariant:
            from openinfer.layers.batch_invariant import make_batch_invariant

            if not model.traits.batch_invariant:
                raise ValueError(f"batch_invariant supports the Llama family and Gemma-3; {family.name} models are "
                                 f"not covered yet (their MoE/grouped GEMMs and compressed attention reduce across "
                                 f"the batch)")
            make_batch_invariant(model)
        self.model_config = model.config
        self.runner = ModelRunner(config, model, vocab_size=model.config.vocab_size, parallel=self.parallel)
        self.max_model_len = self._resolve_max_model_len()
        yoco = config.v41_prefill_mode == "yoco"     # the family checked the model runs it (ModelFamily.build)
        self.kv_store = self._make_kv_store(model) if config.kv_store_enabled else None
        self.runner.store.kv_store = self.kv_store
        # models with per-request state: the state at a stored block boundary, in the same tiers
        self.state_store = None
        if self.kv_store is not None and self.runner.num_state_slots:
            from openinfer.kv_cache.kv_store import TieredKVStore

            self.state_store = TieredKVStore(self.kv_store.tiers, self.runner.pool.state_snapshot_bytes(),
                                             config.kv_store_ttl_s, queue_bytes=config.kv_store_write_buffer_bytes)
        self.runner.store.state_store = self.state_store
        # sliding-window models with a store: window state in host memory (kv_cache/bounded_replay.py)
        self.swa_state = None
        if self.kv_store is not None and self.runner.swa_layout is not None and config.resolved_swa_state_bytes:
            from openinfer.kv_cache.tiers import DeferredPutTier, HostMemoryTier

            self.swa_state = DeferredPutTier(HostMemoryTier(config.resolved_swa_state_bytes))
            self.swa_state.name = "swa_state"
        self.runner.store.swa_state = self.swa_state
        self.kv_manager = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                         num_state_slots=self.runner.num_state_slots,
                                         num_state_snapshots=self.runner.num_state_snapshots,
                                         min_uncached_tokens=config.v41_prefill_keep_tokens if yoco else 1,
                                         store=self.kv_store, state_store=self.state_store,
                                         swa=self.runner.swa_layout, swa_state=self.swa_state,
                                         swa_replay=config.swa_replay,
                                         num_window_blocks=self.runner.num_window_blocks)
        self.scheduler = Scheduler(self.kv_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len)
        self.output_processor = OutputProcessor(self.tokenizer, self.max_model_len)
        self.speculator = None
        if config.speculative_config is not None:
            from openinfer.spec_decode.speculator import Speculator

            self.speculator = Speculator(config.speculative_config, self.max_model_len, config.max_num_seqs,
                                         self.runner, async_scheduling=config.speculates_async)
            self.kv_manager.min_uncached_tokens = max(self.kv_manager.min_uncached_tokens,
                                                      self.speculator.context_tokens_after_hit)
        self.async_scheduling = self._resolve_async_scheduling()
        if self.runner.device.type == "cuda":
            install_triton_compile_counter()
        if config.use_cuda_graphs and model.traits.cuda_graph_decode:
            self.runner.capture_decode_graphs(self.max_model_len)
        self.requests: dict[str, Request] = {}
        # what the engine did, for stats(): steps, their host wall time (with async scheduling, a step's time
        # includes waiting for the one before it on the device), steps that ran a prefill chunk
        self.num_steps, self.step_time_s, self.num_prefill_steps = 0, 0.0, 0
        # parallel sampling (n > 1, parallel_sampling.py): request id -> its ParentRequest, and each child's id -> it
        self._parents: dict[str, ParentRequest] = {}
        self._child_parent: dict[str, ParentRequest] = {}
        self._next_id = 0
        self._in_flight = None   # the step queued on the device and not yet read back (async scheduling)
        self._structured = None  # StructuredOutputManager, made with the first constrained request
        self._structured_lock = threading.Lock()   # servers reach the compiler pool from their own thread
        self._compiling: dict[str, Request] = {}   # requests whose grammar was not compiled when they arrived
        self.cost_model_path = None
        if config.prefill_step_budget_ms is not None:   # calibrated with the token budget, then time-budgeted
            from openinfer.engine.cost_model import load_or_calibrate

            self.scheduler.cost_model, self.cost_model_path = load_or_calibrate(self)
            self.scheduler.step_budget_ms = config.prefill_step_budget_ms

    def _make_kv_store(self, model):
        """The prefix-KV store's tiers (kv_cache/kv_store.py), under a namespace of everything that makes a
        block's bytes differ for the same tokens: the model (directory name and config.json), dtypes,
        quantization, block size, the cache kinds' layouts and this rank's place in the TP/DP layout."""
        import hashlib

        from openinfer.kv_cache.kv_store import TieredKVStore, namespace_digest
        from openinfer.kv_cache.spec import PagedCacheSpec
        from openinfer.kv_cache.tiers import DirectoryTier, HostMemoryTier, RedisTier

        c, runner = self.config, self.runner
        if runner.num_state_slots and not runner.num_state_snapshots:
            raise ValueError(f"kv_store_dir / kv_store_url / kv_host_cache_bytes: {type(model).__name__} keeps "
                             f"per-request state, which a stored prefix needs as of its last block: that state is "
                             f"kept with prefix caching (enable_prefix_caching and num_state_snapshots > 0)")
        if runner.swa_layout is not None and runner.store.block_bytes() == 0:
            raise ValueError(f"kv_store_dir / kv_store_url / kv_host_cache_bytes: every layer of this "
                             f"{type(model).__name__} attends through a sliding window, and a stored block holds "
                             f"only full-attention layers' rows, so the store would keep nothing; prefix hits come "
                             f"from the window pool on the device (leave the store off for this model)")
        config_json = self.model_dir / "config.json"
        namespace = namespace_digest(
            model=self.model_dir.name, model_class=type(model).__name__,
            model_config=hashlib.sha256(config_json.read_bytes()).hexdigest() if config_json.is_file() else None,
            dtype=str(c.torch_dtype), kv_cache_dtype=c.kv_cache_dtype, quantization=c.quantization,
            load_format=c.load_format, block_size=c.block_size,
            caches=[(s.name, s.num_layers, tuple(s.entry_shape), str(s.dtype), s.tokens_per_entry)
                    for s in runner.cache_specs if isinstance(s, PagedCacheSpec)],
            # per-request state stored at block boundaries (DeepSeek-V4/V4.1): its layout, rollback room included
            state=[(s.name, s.num_layers, tuple(s.state_shape), str(s.dtype)) for s in runner.pool.snapshot_specs()],
            ranks=(self.parallel.dp_size, self.parallel.dp_rank, self.parallel.tp_size, self.parallel.tp_rank),
            # sliding-window models: entries hold the full-attention layers' rows only
            windowed_layers_left_out=runner.swa_layout.window_layers if runner.swa_layout is not None else ())
        tiers = []
        if c.resolved_kv_host_cache_bytes:
            tiers.append(HostMemoryTier(c.resolved_kv_host_cache_bytes))
        if c.kv_store_dir:
            tiers.append(DirectoryTier(c.kv_store_dir, namespace, c.kv_store_capacity_bytes))
        if c.kv_store_url:
            tiers.append(RedisTier(c.kv_store_url, namespace))
        return TieredKVStore(tiers, runner.store.block_bytes(), c.kv_store_ttl_s,
                             queue_bytes=c.kv_store_write_buffer_bytes)

    def _resolve_async_scheduling(self) -> bool:
        """Async scheduling as configured, with speculation only when asked for explicitly: the next step is then
        scheduled on the guess that the verify step in flight keeps all its drafts (docs/spec_decode.md, "Async
        scheduling"); measured on the H200 (BENCHMARKS.md) it lowers TPOT at low concurrency but costs throughput
        and TTFT at 16-64 requests, so the device default stays synchronous. Models with per-request state
        (DeepSeek's rings) then keep 2k + 1 rows of rollback room instead of k (`EngineConfig.rollback_rows`), and
        a sliding-window group releases blocks only past what the verify step in flight could roll back to."""
        if not self.config.use_async_scheduling or self.speculator is None:
            return self.config.use_async_scheduling
        return self.config.speculates_async

    def _resolve_max_model_len(self) -> int:
        model_max = self.model_config.max_position_embeddings
        capacity = self.runner.num_blocks * self.config.block_size
        wanted = self.config.max_model_len
        if wanted is not None:
            if wanted > capacity:
                raise ValueError(f"max_model_len {wanted} does not fit the KV pool ({self.runner.num_blocks} blocks "
                                 f"x {self.config.block_size} = {capacity} tokens); raise the KV budget")
            return wanted
        return min(model_max, capacity)

    # ---- requests ---------------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    images: tuple[ImageSpan, ...] = ()) -> str:
        """Validate and queue one request; raises ValueError (engine state untouched) on bad input. With
        `params.n` > 1 the request runs as n sequences sharing its prompt's prefill (parallel_sampling.py).
        `images`: the prompt's image spans (multimodal.py), for a model with the `vision` trait."""
        if request_id is None:
            request_id = str(self._next_id)
            self._next_id += 1
        if request_id in self.requests or request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        self.validate_prompt(prompt_token_ids)
        images = tuple(images)
        if images:
            self.validate_images(prompt_token_ids, images)
        arrival_time = arrival_time or time.time()
        if params.n == 1:
            self._queue(self._make_request(request_id, prompt_token_ids, params, prompt, arrival_time, images))
            return request_id
        parent = ParentRequest(request_id, params.n, params.output_kind)
        taken = next((c for c in parent.child_ids if c in self.requests or c in self._parents), None)
        if taken is not None:
            raise ValueError(f"request_id {taken!r} (sequence of request {request_id!r}) is already in use")
        children = [self._make_request(cid, prompt_token_ids, child_params(params, i), prompt, arrival_time, images)
                    for i, cid in enumerate(parent.child_ids)]
        if self.config.enable_prefix_caching:       # the others wait for child 0's prompt blocks
            for child in children[1:]:
                child.prefix_leader = children[0]
        self._parents[request_id] = parent
        for child in children:
            self._child_parent[child.request_id] = parent
            self._queue(child)
        return request_id

    def _make_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      prompt: str | None, arrival_time: float, images: tuple[ImageSpan, ...] = ()) -> Request:
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.runner.device)
            generator.manual_seed(params.seed)
        req = Request(request_id=request_id, prompt_token_ids=list(prompt_token_ids), sampling_params=params,
                      metrics=RequestMetrics(arrival_time), prompt=prompt,
                      eos_token_ids=self.tokenizer.eos_token_ids, generator=generator, images=images)
        if params.structured_outputs is not None:
            # compiles in the pool (or comes from its cache); the scheduler admits the request once it is ready
            req.grammar = self.structured_output.new_state(params.structured_outputs)
            if req.grammar.ready and req.grammar.error() is not None:
                raise ValueError(req.grammar.error())
        return req

    def _queue(self, req: Request) -> None:
        if req.grammar is not None and not req.grammar.ready:
            self._compiling[req.request_id] = req
        self.requests[req.request_id] = req
        self.scheduler.add(req)

    @property
    def structured_output(self):
        """The grammar compiler pool and bitmask builder (xgrammar is imported on first use)."""
        with self._structured_lock:
            if self._structured is None:
                self._structured = self._make_structured_output()
        return self._structured

    def _make_structured_output(self):
        from openinfer.structured_output.compiler import GrammarCompilerPool
        from openinfer.structured_output.manager import StructuredOutputManager

        c = self.config
        pool = GrammarCompilerPool(self.tokenizer.hf, self.model_config.vocab_size, self.tokenizer.eos_token_ids,
                                   num_threads=c.structured_output_compile_threads,
                                   timeout_s=c.structured_output_compile_timeout_s,
                                   cache_size=c.structured_output_cache_size,
                                   any_whitespace=c.structured_output_any_whitespace)
        return StructuredOutputManager(pool)

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raise ValueError naming the problem if this prompt can't be served (read-only: thread-safe)."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt is empty: at least one token is needed")
        if n > self.max_model_len:
            raise ValueError(f"prompt has {n} tokens, more than max_model_len={self.max_model_len}")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")

    def validate_images(self, prompt_token_ids: list[int], images: tuple[ImageSpan, ...]) -> None:
        """Raise ValueError naming the problem unless the model reads images and each span is one it reads."""
        model = self.runner.model
        if not model.traits.vision:
            raise ValueError(f"this model ({self.config.model}) does not take images: it has no vision encoder")
        check_spans(images, len(prompt_token_ids))
        for image in images:
            model.check_image(image, prompt_token_ids)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; unknown or finished ids are ignored. A request with n > 1
        stops every sequence (so does the id of one of its sequences)."""
        parent = self._parents.get(request_id) or self._child_parent.get(request_id)
        if parent is not None:
            outs = [out for out in (self._abort_one(cid) for cid in parent.child_ids) if out is not None]
            return self._merge(parent, outs)
        return self._abort_one(request_id)

    def _abort_one(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        self._compiling.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        self._keep_window_state()
        req.metrics.finished_time = time.time()
        return self.output_processor.make_output(req)

    def shutdown(self) -> None:
        """Abort every request, stop the grammar-compile threads and drop the model, its caches and CUDA graphs.
        The engine's objects refer to each other (cycles), so without this, memory comes back only when
        Python's collector next runs; `LLM.shutdown()` calls this and then collects."""
        for rid in list(self.requests):
            self.abort_request(rid)
        self._in_flight = None
        if self._structured is not None:
            self._structured.pool.shutdown()
            self._structured = None
        if self.kv_store is not None:
            self.kv_store.close()        # the queued writes finish first
        if self.state_store is not None:
            self.state_store.close()
        self.runner = None

    def memory_stats(self) -> dict:
        """Where this rank's memory goes: weights as stored, the KV pool, per-request state (bytes)."""
        model, runner = self.runner.model, self.runner
        seen, weights = set(), 0
        for t in (*model.parameters(), *model.buffers()):
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                weights += t.numel() * t.element_size()
        return {"weight_bytes": weights, "kv_blocks": runner.num_blocks, "block_size": self.config.block_size,
                "kv_pool_bytes": runner.pool.pool_bytes(),
                "kv_window_blocks": runner.num_window_blocks, "state_bytes": runner.pool.state_bytes(),
                "kv_capacity_tokens": runner.num_blocks * self.config.block_size,
                "device_allocated_bytes": torch.cuda.memory_allocated(runner.device) if runner.device.type == "cuda"
                else None}

    def warm_up(self) -> float:
        """Run what the first requests would compile (Triton kernels JIT-compile on first use, per shape class)
        before any request arrives: a few prompts of different lengths, prefilled whole and in chunks beside
        decodes, then decoded; then one prompt per step over the token counts of warm_up_token_counts; then leave no trace (prefix cache emptied, counters back to zero). Returns its
        seconds. CUDA graphs of decode were captured already, every (batch, context) bucket (cuda_graphs.py); from here
        on `stats()["jit_compiles"]` and `["graph_captures"]` should not move under traffic (compile_watch.py)."""
        start = time.perf_counter()
        budget = self.config.max_num_batched_tokens
        lengths = sorted({1, 17, min(budget, 512) // 2 + 3, max(1, min(budget + 5, self.max_model_len - 4))})
        g = torch.Generator().manual_seed(0)
        params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
        for i, n in enumerate(lengths):
            self.add_request(torch.randint(0, self.model_config.vocab_size, (n,), generator=g).tolist(), params,
                             request_id=f"openinfer-warm-up-{i}")
        while self.has_unfinished_requests():
            self.step()
        # then a wave as wide as the batch, prompts of many lengths: steps with many chunks and decode rows (the
        # attention kernels' split counts follow the number of rows and tiles)
        wave = min(self.config.max_num_seqs, 64)
        for i in range(wave):
            n = max(1, min(1 + (i * 37) % max(1, min(budget, 300)), self.max_model_len - 4))
            self.add_request(torch.randint(0, self.model_config.vocab_size, (n,), generator=g).tolist(),
                             SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0),
                             request_id=f"openinfer-warm-up-w{i}")
        while self.has_unfinished_requests():
            self.step()
        # then steps of one prompt each, whose token counts cover every class the GEMM launchers pick a kernel
        # variant by (tile sizes switch at powers of two; Triton specializes integers equal to 1 or divisible by 16)
        lengths = warm_up_token_counts(budget, self.max_model_len - 2)
        for i, n in enumerate(lengths):
            self.add_request(torch.randint(0, self.model_config.vocab_size, (n,), generator=g).tolist(),
                             SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0),
                             request_id=f"openinfer-warm-up-m{i}")
            while self.has_unfinished_requests():
                self.step()
        self.kv_manager.reset_prefix_cache()
        self.kv_manager.prefix_stats = type(self.kv_manager.prefix_stats)()
        self.scheduler.num_preemptions = self.scheduler.num_prompt_tokens_computed = 0
        self.num_steps, self.step_time_s, self.num_prefill_steps = 0, 0.0, 0
        return time.perf_counter() - start

    def flush_kv_store(self, timeout_s: float | None = None) -> bool:
        """Wait until the store holds every block queued so far (a prefill instance before it answers); True if
        so, False if `timeout_s` passed first (the writes go on). No store: True."""
        return self.kv_store is None or self.kv_store.flush(timeout_s)

    def kv_store_namespace(self) -> str | None:
        """The shared store tier's namespace (None: no directory or Redis tier): instances that hand KV over
        through the store must report the same one (serving/load.py)."""
        if self.kv_store is None:
            return None
        return next((t.namespace.hex()[:32] for t in self.kv_store.tiers if t.namespace is not None), None)

    def touch_cache_pages(self) -> None:
        self.runner.pool.touch_pages()

    def has_unfinished_requests(self) -> bool:
        # A step still in flight whose requests all finished holds nothing: the next step() reads it back.
        return self.scheduler.has_unfinished()

    # ---- the loop ---------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, queue the step on the device, report what finished computing.

        With async scheduling (`003_…txt` §5) the previous step is read back only after this step's device
        work is queued, so host bookkeeping (detokenization, stop checks, scheduling) overlaps device
        compute. A request's newest token may still be on the device when the next step is scheduled: the
        runner feeds it from there. Stops are therefore found one step late; the extra token computed for a
        finished request is discarded, and its blocks are freed when the stop is found (the late write lands
        in a block no other request can hit yet). Requests whose sampling reads their output history
        (penalties) or whose grammar mask depends on their last token (structured output) wait for it: such
        a step reads back first. Requests whose grammar is still compiling wait in the queue (the scheduler
        skips them); a grammar that fails or times out aborts its request with the reason in stop_reason."""
        start = time.perf_counter()
        try:
            return self._step()
        finally:
            self.num_steps += 1
            self.step_time_s += time.perf_counter() - start

    def _step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        if self.swa_state is not None:
            self.swa_state.settle()          # window state copies (CUDA) that are done go into the tier
        if self._compiling:
            outputs += self._retire_failed_grammars()
        prev, self._in_flight = self._in_flight, None
        if prev is not None and (not self.async_scheduling or self._reads_history(prev)):
            outputs += self._process(prev)
            prev = None
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        current = None
        if sched.empty and self._compiling and prev is None:
            next(iter(self._compiling.values())).grammar.wait(0.005)   # nothing to run until a grammar is ready
        if sched.empty and prev is None:
            self.kv_manager.wait_for_store_reads(0.005)        # nor until a prefix read from the store is done
        if not sched.empty:
            prefill, sampling_steps = False, []
            for s in sched.scheduled:
                prefill = prefill or s.request.num_computed_tokens < len(s.request.prompt_token_ids)
                if s.samples:
                    sampling_steps.append(s)
            self.num_prefill_steps += prefill
            sampling = [s.request for s in sampling_steps]
            bitmask = None
            if self._structured is not None:
                bitmask = self._structured.bitmask(sampling, {s.request.request_id: s.draft_token_ids
                                                              for s in sched.scheduled if s.draft_token_ids})
            try:
                current = self.runner.execute(sched, prev, bitmask)
            except BaseException:
                self._in_flight = prev   # still to be read back; the failed step left no trace but its blocks
                raise
            self.scheduler.update_after_step(sched.scheduled)
            for s in sampling_steps:          # its sample, and its drafts as if all were kept
                req = s.request
                if req.num_pending and req.pending_drafts:
                    req.metrics.num_guessed_steps += 1      # its verify step is still on the device
                req.num_pending += 1 + len(s.draft_token_ids)
                req.pending_drafts = s.draft_token_ids
        elif self.runner.step_sync is not None:
            self.runner.execute_idle()       # expert parallelism: the other ranks' MoE layers need this one
        if prev is not None:
            outputs += self._process(prev, following=current)
        if current is not None:
            if self.async_scheduling and not current.prompt_logprobs:
                self._in_flight = current
            else:
                outputs += self._process(current)
        return outputs

    def _reads_history(self, runner_out) -> bool:
        """Whether the next step needs this step's tokens on the host: penalties count them, and a grammar's
        next mask depends on them (structured output waits for the previous step instead of overlapping)."""
        for rid in runner_out.sample_index:
            req = self.requests.get(rid)
            if req is None:
                continue
            p = req.sampling_params
            if req.grammar is not None or p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:
                return True
        return False

    def _retire_failed_grammars(self) -> list[RequestOutput]:
        """Requests whose grammar failed to compile (or timed out) finish as aborted, the reason in
        `stop_reason` (every sequence of a request with n > 1: they share the grammar); those compiled go on to be
        scheduled."""
        outputs = []
        for rid, req in list(self._compiling.items()):
            error = req.grammar.error()
            if error is None and not req.grammar.ready:
                continue
            self._compiling.pop(rid, None)
            if error is not None and rid in self.requests:
                parent = self._child_parent.get(rid)
                for cid in parent.child_ids if parent is not None else (rid,):
                    if cid in self.requests:
                        self.requests[cid].stop_reason = error
                out = self.abort_request(rid)
                if out is not None:
                    outputs.append(out)
        return outputs

    def _process(self, runner_out, following=None) -> list[RequestOutput]:
        """Apply a step read back from the device; `following`: the step queued after it (async scheduling),
        whose rows of a request that rejected drafts here were computed on the guess that all were kept."""
        outputs = []
        for req, finish in self.output_processor.process(runner_out, self.requests, following):
            if finish is not None:
                self.scheduler.finish(req, finish)
                req.metrics.finished_time = time.time()
                del self.requests[req.request_id]
            out = self.output_processor.make_output(req)
            if out is not None:
                outputs.append(out)
        if self.speculator is not None:
            self.speculator.after_step(runner_out, self.requests)
        self._keep_window_state()
        return self._fold(outputs) if self._child_parent else outputs

    def _fold(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Children's outputs (n > 1) become their request's: one output per request and step."""
        result: list[RequestOutput | ParentRequest] = []
        groups: dict[str, list[RequestOutput]] = {}
        for out in outputs:
            parent = self._child_parent.get(out.request_id)
            if parent is None:
                result.append(out)
                continue
            if parent.request_id not in groups:
                groups[parent.request_id] = []
                result.append(parent)
            groups[parent.request_id].append(out)
        folded = []
        for item in result:
            if isinstance(item, ParentRequest):
                item = self._merge(item, groups[item.request_id])
            if item is not None:
                folded.append(item)
        return folded

    def _merge(self, parent: ParentRequest, outs: list[RequestOutput]) -> RequestOutput | None:
        out = parent.merge(outs)
        if parent.finished:
            self._parents.pop(parent.request_id, None)
            for cid in parent.child_ids:
                self._child_parent.pop(cid, None)
        return out

    def _keep_window_state(self) -> None:
        """Copy ended requests' window state into host memory now, before their blocks can be reused and before
        the next lookup (kv_cache/bounded_replay.py; on CUDA the copy waits for the queued step)."""
        saves = self.kv_manager.state_copies.swa_saves
        if saves:
            self.runner.store.save_window_state(saves)
            saves.clear()

    # ---- introspection ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def rebalance_experts(self) -> tuple[float, float, bool]:
        """EPLB now rather than at its next interval (every EP rank at once, between steps, as `call_ranks` runs
        it: tests, benchmarks, an operator): (moe_lb before, moe_lb after, whether experts moved); NaN before any
        step. Moves weights in place, so it runs in inference mode, as a step's automatic rebalance does."""
        eplb = self.runner.eplb
        if eplb is None:
            raise ValueError("rebalance_experts needs enable_expert_parallel")
        before = eplb.measure()
        moved = eplb.rebalance()
        return before, eplb.measure(), moved

    def stats(self) -> dict:
        kv, graphs = self.kv_manager, self.runner.decode_graphs
        return {
            "num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
            "kv_blocks_total": kv.num_blocks, "kv_blocks_free": kv.num_free_blocks, "kv_usage": kv.usage(),
            "prefix_cache_hit_rate": kv.prefix_stats.hit_rate, "prefix_cache_hit_tokens": kv.prefix_stats.hit_tokens,
            "prefix_cache_queried_tokens": kv.prefix_stats.queried_tokens,
            "prefix_cache_store_hit_tokens": kv.prefix_stats.store_hit_tokens,
            **({"swa_state_hits": kv.prefix_stats.swa_state_hits, "swa_replays": kv.prefix_stats.swa_replays,
                "swa_replayed_tokens": kv.prefix_stats.swa_replayed_tokens,
                "swa_state_tier": self.swa_state.stats.as_dict() if self.swa_state is not None else None,
                "kv_window_blocks_total": kv.window.pool.num_blocks,
                "kv_window_blocks_free": kv.window.pool.num_free_blocks}
               if kv.swa is not None else {}),
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens_computed": self.scheduler.num_prompt_tokens_computed,
            "num_steps": self.num_steps, "step_time_s": self.step_time_s, "num_prefill_steps": self.num_prefill_steps,
            # what stalls a step under traffic: after warm_up both stay where start-up left them (compile_watch.py)
            "graph_captures": graphs.captures if graphs is not None else 0,
            "graph_capture_s": graphs.capture_s if graphs is not None else 0.0,
            "jit_compiles": triton_compiles(),
            **({"images_encoded": self.runner.images_encoded, "images_given": self.runner.images_given,
                "encoder_cache_hits": self.runner.encoder_cache.hits}
               if self.runner.encoder_cache is not None else {}),
            **(self.runner.eplb.stats() if self.runner.eplb is not None else {}),
            **(self.kv_store.stats() if self.kv_store is not None else {}),
        }
