"""ModelRunner: executes one prepared step; owns the model, the cache tensors and the sampler.

It turns a SchedulerOutput into flat tensors (input ids, positions, cache slots, attention metadata), runs
the model, computes logits only for the rows that need them (the last token of each request that samples,
plus prompt positions of requests asking for prompt logprobs), and samples. It never decides what runs
or where cache lives: block ids arrive in the SchedulerOutput.

Sliding-window models: paged kinds with a `window` (kv_cache/spec.py) form the window group, with their own
tensors and block ids (kv_cache/window_group.py); `_pool_sizes` splits the KV budget between the groups, and the
windowed layers read the window group's tables and slots through the step's second view
(`AttentionMetadata.layer_views`).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from openinfer.config import EngineConfig
from openinfer.device_io import D2HCopy, h2d
from openinfer.distributed.parallel_state import ParallelContext
from openinfer.distributed.step_sync import StepSync
from openinfer.engine.scheduler import SchedulerOutput
from openinfer.kv_cache.bounded_replay import replay_slot_mappings, window_layer_chunk
from openinfer.kv_cache.spec import PagedCacheSpec, RequestStateSpec
from openinfer.layers.attention import AttentionMetadata, PrefillChunk
from openinfer.sampling.sampler import Sampler, SamplerOutput, SamplingMetadata
from openinfer.structured_output.bitmask import GrammarBitmask

_CPU_KV_BUDGET = 2 << 30


@dataclass
class PromptLogprobsChunk:
    first_token_index: int        # index in the prompt of the token the first row predicts
    logprobs: torch.Tensor        # [n, V] log-softmax rows
    token_ids: list[int]          # the actual prompt tokens predicted by those rows


@dataclass
class RunnerOutput:
    # request_id -> index into `sampled` for requests that produced a token this step
    sample_index: dict[str, int] = field(default_factory=dict)
    sampled: SamplerOutput | None = None   # on the device (the next step reads pending tokens from it)
    logits: torch.Tensor | None = None     # the rows the sampler got, aligned with `sampled`
    host_copy: D2HCopy | None = None       # `sampled` on its way to pinned host memory
    # speculative decoding: request_id -> the drafts its rows verified (rows sample_index .. + len(drafts))
    drafts: dict[str, list[int]] = field(default_factory=dict)
    # drafters that read the target's hidden features (spec_decode/feature_proposer.py): request_id -> (first
    # row, first position, rows, state slot) of its rows in this forward, and the features the model kept
    rows: dict[str, tuple[int, int, int, int | None]] = field(default_factory=dict)
    captured: dict[int, torch.Tensor] | None = None

    def sampled_on_host(self) -> dict[str, torch.Tensor | None]:
        """The sampler's outputs on the host; waits only for this step's GPU work."""
        return self.host_copy.wait() if self.host_copy is not None else {}
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, vocab_size: int,
                 parallel: ParallelContext | None = None):
        self.config = config
        self.device = torch.device(config.device)
        self.parallel = parallel or ParallelContext.single(self.device)
        if self.parallel.is_distributed:
            self.device = self.parallel.device
        self.dtype = config.torch_dtype
        self.model = model
        self.vocab_size = vocab_size
        self.block_size = config.block_size
        self.yoco_keep = config.v41_prefill_keep_tokens if config.v41_prefill_mode == "yoco" else None
        self.sampler = Sampler(config.logprobs_mode)
        self.generator = torch.Generator(device=self.device)
        # DP groups draw different noise (else the same prompt on two groups samples the same text); the TP
        # ranks of a group share it, so they sample the same tokens from the same logits
        self.generator.manual_seed(config.seed + self.parallel.dp_rank)
        # per-request rings keep room for the rows a verify step (and a step guessed on it) may write, then reject
        self.cache_specs = model.cache_specs(self.dtype, rollback_rows=config.rollback_rows)
        # one state slot per running request when the model declares per-request state
        self.num_state_slots = config.max_num_seqs if any(
            isinstance(s, RequestStateSpec) for s in self.cache_specs) else 0
        self.num_state_snapshots = 0
        if self.num_state_slots and config.enable_prefix_caching:
            self.num_state_snapshots = (config.num_state_snapshots if config.num_state_snapshots is not None
                                        else 2 * config.max_num_seqs)
        self.num_blocks, self.num_window_blocks = self._pool_sizes()
        if self.parallel.is_distributed:
            # every rank the same pool: TP ranks must make the same scheduling decisions (preemption, admission)
            # and DP ranks the same max_model_len, whatever memory each GPU happened to have free
            agreed = torch.tensor([self.num_blocks, self.num_window_blocks])
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.parallel.cpu_group)
            self.num_blocks, self.num_window_blocks = int(agreed[0]), int(agreed[1])
        self.scratch_slot = self.num_blocks * self.block_size    # the spare page padded rows write to
        self.window_scratch_slot = self.num_window_blocks * self.block_size   # the window group's
        self.caches = self._allocate_caches()
        # expert parallelism: forwards run in lockstep with the other EP ranks, EPLB moves experts
        self.step_sync = StepSync(self.parallel) if self.parallel.ep_size > 1 else None
        self.eplb = None
        if self.step_sync is not None:
            from openinfer.distributed.eplb_controller import EplbController

            self.eplb = EplbController(model, self.parallel, config)
        # copies of per-request state at block boundaries, for prefix-cache hits (see KVCacheManager)
        self.snapshots = {s.name: [self._zeros((self.num_state_snapshots, *s.state_shape), s.dtype)
                                   for _ in range(s.num_layers)]
                          for s in self._snapshot_specs()}
        # the prefix-KV store blocks are saved to (the engine sets it; kv_cache/kv_store.py), and where the
        # per-request state at a stored block boundary goes (models with state slots)
        self.kv_store = None
        self.state_store = None
        # sliding-window models: which layers have a window (the store keeps the others' rows only), and the
        # host-memory tier their window state goes to (the engine sets it; kv_cache/bounded_replay.py)
        self.swa_layout = model.swa_layout() if hasattr(model, "swa_layout") else None
        self.swa_state = None
        # (decode batch bucket, context the graph was captured for) -> (graph, its output)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    # ---- cache allocation -------------------------------------------------------------------------------
    def bytes_per_block(self, window: bool | None = None) -> int:
        """Bytes of one block of tokens in every paged kind; `window` True / False: the window group's kinds /
        the others' only."""
        return sum(s.bytes_per_block(self.block_size) for s in self.cache_specs if isinstance(s, PagedCacheSpec)
                   and (window is None or (s.window is not None) == window))

    def window_size(self) -> int | None:
        """W of the window group's kinds (None: no window group)."""
        return next((s.window for s in self.cache_specs if isinstance(s, PagedCacheSpec) and s.window), None)

    def _snapshot_specs(self) -> list[RequestStateSpec]:
        return [s for s in self.cache_specs if isinstance(s, RequestStateSpec) and s.needed_at_block_boundary
                and self.num_state_snapshots]

    def state_bytes(self) -> int:
        live = sum(s.bytes_per_slot() for s in self.cache_specs if isinstance(s, RequestStateSpec))
        return (self.num_state_slots + 1) * live + self.num_state_snapshots * sum(
            s.bytes_per_slot() for s in self._snapshot_specs())

    def state_snapshot_bytes(self) -> int:
        """Bytes of one request's state as kept at a block boundary (a snapshot; in the store, one entry)."""
        return sum(s.bytes_per_slot() for s in self._snapshot_specs())

    def _load_states(self, loads: list[tuple[int, bytes]]) -> None:
        """State read from the store into request slots, before the forward (the layout of `_save_states`)."""
        for slot, payload in loads:
            buf = payload if not memoryview(payload).readonly else bytearray(payload)
            flat = h2d(torch.frombuffer(buf, dtype=torch.uint8), self.device)
            offset = 0
            for name in self.snapshots:
                for live in self.caches[name]:
                    row = live[slot]
                    n = row.numel() * row.element_size()
                    part = flat[offset:offset + n]
                    if offset % row.element_size():
                        part = part.clone()
                    row.copy_(part.view(row.dtype).view(row.shape))
                    offset += n

    def _save_states(self, saves: list[tuple[int, bytes, float]]) -> None:
        """Snapshots keyed this step into the store (after the step's slot -> snapshot copies)."""
        for snap, key, ttl in saves:
            if not self.state_store.can_accept():
                self.state_store.dropped_writes += 1
                continue
            flat = torch.cat([t[snap].reshape(-1).view(torch.uint8) for snaps in self.snapshots.values()
                              for t in snaps])
            self._queue_store_write(self.state_store, flat, key, ttl)

    def _queue_store_write(self, store, flat: torch.Tensor, key: bytes, ttl: float) -> None:
        """Hand bytes to the store's writer thread (`read` runs there)."""
        store.put(key, self._to_host(flat)[1], ttl)

    def _to_host(self, flat: torch.Tensor):
        """(ready, read) for a uint8 tensor's bytes: on the CPU a copy now; on CUDA a copy queued on the stream into
        pinned memory (it reads the tensor before any later step changes it), `read` waits for it."""
        if self.device.type == "cpu":
            payload = flat.numpy().tobytes()
            return (lambda: True), (lambda: payload)
        host = torch.empty(flat.shape, dtype=torch.uint8, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        event = torch.cuda.Event()
        event.record()

        def read() -> bytes:
            event.synchronize()
            return host.numpy().tobytes()
        return event.query, read

    def _copy_states(self, pairs: list[tuple[int, int]], restore: bool) -> None:
        if not pairs:
            return
        src_idx = torch.tensor([a for a, _ in pairs], device=self.device)
        dst_idx = torch.tensor([b for _, b in pairs], device=self.device)
        for name, snaps in self.snapshots.items():
            for live, snap in zip(self.caches[name], snaps):
                src, dst = (snap, live) if restore else (live, snap)
                dst.index_copy_(0, dst_idx, src.index_select(0, src_idx))

    # ---- prefix-KV store: a block's bytes are every paged cache's rows for it, layer by layer ------------------
    # (sliding-window models: the full-attention layers' only; the windowed layers' travel as window state)
    def _block_rows(self, block_id: int, window_layers: bool = False) -> list[torch.Tensor]:
        """A block's rows in the full group's kinds, or (`window_layers`) in the window group's (block ids of
        that group)."""
        return [t[block_id] for s in self.cache_specs if isinstance(s, PagedCacheSpec)
                and (s.window is not None) == window_layers for t in self.caches[s.name]]

    def store_block_bytes(self) -> int:
        """Bytes of one block in the prefix-KV store."""
        return sum(r.numel() * r.element_size() for r in self._block_rows(0))

    def _load_blocks(self, loads: list[tuple[int, bytes]], window_layers: bool = False) -> None:
        """Write blocks read from the store into their (freshly allocated) pool blocks, before the forward."""
        for block_id, payload in loads:
            buf = payload if not memoryview(payload).readonly else bytearray(payload)
            flat = h2d(torch.frombuffer(buf, dtype=torch.uint8), self.device)
            offset = 0
            for row in self._block_rows(block_id, window_layers):
                n = row.numel() * row.element_size()
                part = flat[offset:offset + n]
                if offset % row.element_size():
                    part = part.clone()          # a view as a wider dtype needs an aligned start
                row.copy_(part.view(row.dtype).view(row.shape))
                offset += n

    def _load_window_state(self, loads: list[tuple[list[int | None], bytes]]) -> None:
        """Window state from host memory into the hit's blocks that lack their windowed rows (None: keeps its own)."""
        for block_ids, payload in loads:
            per_block = len(payload) // len(block_ids)
            self._load_blocks([(b, memoryview(payload)[i * per_block:(i + 1) * per_block])
                               for i, b in enumerate(block_ids) if b is not None], window_layers=True)

    def save_window_state(self, saves: list[tuple[list[int], bytes]]) -> None:
        """The windowed rows of ended requests' last windows into the host-memory tier, when they end (the engine
        calls it before the next schedule can reuse their blocks). On CUDA the copy is queued on the stream into
        pinned memory (it reads the blocks before any later step can write them) and stored once it is done
        (`DeferredPutTier`): no wait for the step in flight."""
        ttl = self.config.kv_store_ttl_s
        for block_ids, key in saves:
            rows = [r.reshape(-1).view(torch.uint8) for b in block_ids for r in self._block_rows(b, window_layers=True)]
            ready, read = self._to_host(torch.cat(rows))
            if self.device.type == "cpu" or not hasattr(self.swa_state, "put_later"):
                self.swa_state.put(key, read(), ttl)
            else:
                self.swa_state.put_later(key, ready, read, ttl)

    def _save_blocks(self, saves: list[tuple[int, bytes, float]]) -> None:
        """Copy blocks this step completed to host memory for the store's writer thread, after the forward.
        On the CPU the copy is made now; on CUDA it is queued on the stream (so it reads the block before any
        later step can reuse it) into pinned memory, and the writer waits for its event."""
        store = self.kv_store
        for block_id, key, ttl in saves:
            if not store.can_accept():
                store.dropped_writes += 1      # the writer is behind: drop rather than make the step wait
                continue
            flat = torch.cat([row.reshape(-1).view(torch.uint8) for row in self._block_rows(block_id)])
            self._queue_store_write(store, flat, key, ttl)

    def _kv_budget(self) -> int:
        """Bytes for the paged pools: kv_cache_memory_bytes, else 2 GiB on the CPU or what the GPU has left."""
        budget = self.config.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cpu":
                budget = _CPU_KV_BUDGET
            else:
                free, total = torch.cuda.mem_get_info(self.device)
                # memory PyTorch caches but no tensor uses is ours too
                free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
                reserve = (1 << 30) + self.config.max_num_batched_tokens * self.vocab_size * 4
                budget = int(total * self.config.gpu_memory_utilization) - (total - free) - reserve
        return budget - self.state_bytes()

    def _pool_sizes(self) -> tuple[int, int]:
        """(full-group blocks, window-group blocks); the latter 0 without sliding-window kinds.

        The window group (kv_cache/window_group.py) needs, per running request, its window's blocks
        (ceil((W-1)/B) + 1, one more at a block edge) and for the whole step the blocks of its tokens
        (ceil(max_num_batched_tokens/B)): `running`. It gets twice that, the second half keeping the last windows
        of ended requests for prefix hits (a hit needs only its last window's blocks), and the full group the rest
        of the budget. When the budget cannot hold that beside as many full blocks, both groups get the same count
        (a request can then hold its whole length in either, as without the window group). Running dry in the
        window group preempts like the full one. `num_kv_blocks` fixes the full group (the window group then
        gets min(num_kv_blocks, 2 x running)); `num_window_kv_blocks` fixes the window group.

        Every layer windowed (Mistral): the full group holds no rows, its blocks are only the table that hashes
        prefixes and bounds a request's length. The window group then gets the whole budget (`num_kv_blocks`
        or `num_window_kv_blocks` fix it), and the full group as many table entries as the requests the window
        group can run hold at the longest length, plus one per window block for ended requests' prefixes."""
        c, bs = self.config, self.block_size
        window = self.window_size()
        full_bytes, window_bytes = self.bytes_per_block(window=False), self.bytes_per_block(window=True)
        if window is not None and full_bytes == 0:
            return self._window_only_pool_sizes(window, window_bytes)
        if window is None:
            num_window = 0
        else:
            running = c.max_num_seqs * self._window_blocks_per_request(window) + -(-c.max_num_batched_tokens // bs)
            num_window = c.num_window_kv_blocks or 2 * running
            least = self._least_window_blocks(window)
            if num_window < least:
                raise ValueError(f"num_window_kv_blocks={num_window} cannot hold one request's window and step "
                                 f"({least} blocks of {bs} tokens for window {window} and max_num_batched_tokens="
                                 f"{c.max_num_batched_tokens})")
        if c.num_kv_blocks is not None:
            if window is not None and c.num_window_kv_blocks is None:
                num_window = min(num_window, c.num_kv_blocks)
            return c.num_kv_blocks, num_window
        budget = self._kv_budget()
        if window is not None and c.num_window_kv_blocks is None and \
                num_window * (window_bytes + full_bytes) >= budget:
            num_window = budget // (window_bytes + full_bytes)
        num = (budget - num_window * window_bytes) // full_bytes
        if num < 1 or (window is not None and num_window < 1):
            raise ValueError(f"KV budget of {budget + self.state_bytes()} bytes holds no block of "
                             f"{self.bytes_per_block()} bytes (block_size={self.block_size}) beside "
                             f"{self.state_bytes()} bytes of per-request state; raise kv_cache_memory_bytes")
        return int(num), int(num_window)

    def _window_blocks_per_request(self, window: int) -> int:
        """Window blocks a decoding request holds at most: its window, one more at a block edge, one for its token."""
        return -(-(window - 1) // self.block_size) + 2

    def _least_window_blocks(self, window: int) -> int:
        """Window blocks one request's full step needs: its window and the step's tokens."""
        return self._window_blocks_per_request(window) + -(-self.config.max_num_batched_tokens // self.block_size)

    def _window_only_pool_sizes(self, window: int, window_bytes: int) -> tuple[int, int]:
        c, bs = self.config, self.block_size
        num_window = c.num_window_kv_blocks or c.num_kv_blocks
        if num_window is None:
            budget = self._kv_budget()
            num_window = budget // window_bytes
            if num_window < 1:
                raise ValueError(f"KV budget of {budget + self.state_bytes()} bytes holds no block of {window_bytes} "
                                 f"bytes (block_size={bs}) beside {self.state_bytes()} bytes of per-request state; "
                                 f"raise kv_cache_memory_bytes")
        least = self._least_window_blocks(window)
        if num_window < least:
            raise ValueError(f"the window group's {num_window} blocks cannot hold one request's window and step "
                             f"({least} blocks of {bs} tokens for window {window} and max_num_batched_tokens="
                             f"{c.max_num_batched_tokens}); raise num_kv_blocks or kv_cache_memory_bytes")
        longest = c.max_model_len or self.model.config.max_position_embeddings
        concurrent = min(c.max_num_seqs, num_window // self._window_blocks_per_request(window))
        return max(1, concurrent) * -(-longest // bs) + num_window, num_window

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # Zeroed, not empty: masked-out slots still enter the matmul and must not hold NaN/Inf bit patterns.
        # On the CPU, numpy's calloc gives zero pages lazily, so a large pool costs nothing until used.
        if self.device.type == "cpu":
            nbytes = math.prod(shape) * dtype.itemsize
            return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def touch_cache_pages(self) -> None:
        """Write every page of the caches now. A CPU pool is handed out lazily (see _zeros), so a long-running
        server's memory would creep up as blocks are first used; a server calls this once to start at its
        steady-state size."""
        for tensors in (*self.caches.values(), *self.snapshots.values()):
            for t in tensors:
                t.zero_()

    def _allocate_caches(self) -> dict[str, list[torch.Tensor]]:
        """Per declared cache kind, one tensor per layer: [num_blocks, *block_shape] for paged kinds,
        [num_state_slots, *state_shape] for per-request state."""
        caches = {}
        for spec in self.cache_specs:
            if isinstance(spec, PagedCacheSpec):
                # one block more than the KV manager hands out: a scratch page for padded CUDA-graph rows (and
                # in the window group, for released table entries)
                blocks = self.num_window_blocks if spec.window is not None else self.num_blocks
                shape = (blocks + 1, *spec.block_shape(self.block_size))
            else:   # one slot more than the KV manager hands out: scratch state for padded CUDA-graph rows
                shape = (self.num_state_slots + 1, *spec.state_shape)
            caches[spec.name] = [self._zeros(shape, spec.dtype) for _ in range(spec.num_layers)]
        return caches

    # ---- CUDA graphs for decode steps --------------------------------------------------------------------
    @torch.inference_mode()
    def capture_decode_graphs(self, max_model_len: int) -> None:
        """Capture the model forward for decode-only batches of bucketed sizes. Padded rows attend to one
        token of the scratch page and write their KV (and state) there, so they touch no real block or slot.

        Models whose decode reads a context-sized gather (DeepSeek-V4's compressed entries:
        `decode_graph_context_buckets`) get one graph per (batch bucket, power-of-two context bucket),
        captured the first time a step needs it; the others, one per batch bucket at max_model_len, now.

        With speculative decoding a verify step runs 1 + k decode rows per request (`_as_decode_rows`): the
        buckets then reach max_num_seqs * (1 + k) rows (at most max_num_batched_tokens)."""
        rows = self.config.max_num_seqs
        spec = self.config.speculative_config
        if spec is not None:
            rows = max(rows, min(rows * (1 + spec.num_speculative_tokens), self.config.max_num_batched_tokens))
        buckets = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512,
                   *range(640, 1025, 128), *range(1280, 4097, 256))
        sizes = [b for b in buckets if b <= rows] or [1]
        if sizes[-1] < rows:
            sizes.append(rows)
        dev, bs, n = self.device, self.block_size, sizes[-1]
        self.graph_sizes, self.max_graph_context = sizes, max_model_len
        self.graph_replays = self.max_graph_rows = 0    # steps replayed with real rows, the most rows in one
        self.context_buckets = getattr(self.model, "decode_graph_context_buckets", False)
        self.g_valid = torch.zeros((), dtype=torch.long, device=dev)   # EP: rows of the bucket that are real
        self._g_live = 0      # rows holding a real request since the last replay (the rest are padding)
        self._g_width = 0     # table columns those rows used
        width = -(-max_model_len // bs)
        self.g_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.g_pos = torch.zeros(n, dtype=torch.long, device=dev)
        self.g_slots = torch.full((n,), self.scratch_slot, dtype=torch.long, device=dev)
        self.g_tables = torch.full((n, width), self.num_blocks, dtype=torch.long, device=dev)
        self.g_lens = torch.ones(n, dtype=torch.long, device=dev)
        self.g_state_slots = torch.full((n,), self.num_state_slots, dtype=torch.long, device=dev)   # scratch slot
        # a verify step's rows on a model with per-request state: each row's offset in its request's rows
        self.g_offsets = (torch.zeros(n, dtype=torch.long, device=dev)
                          if spec is not None and self.num_state_slots else None)
        if self.num_window_blocks:   # the windowed layers' slots and tables (kv_cache/window_group.py)
            self.g_wslots = torch.full((n,), self.window_scratch_slot, dtype=torch.long, device=dev)
            self.g_wtables = torch.full((n, width), self.num_window_blocks, dtype=torch.long, device=dev)
        self.graph_pool = torch.cuda.graph_pool_handle()
        if self.context_buckets:
            print("[openinfer] CUDA graphs for decode are captured on first use per (batch, context) bucket",
                  file=sys.stderr, flush=True)
            return
        t0 = time.perf_counter()
        for b in reversed(sizes):
            self._capture(b, max_model_len)
        torch.cuda.synchronize(dev)
        print(f"[openinfer] captured CUDA graphs for decode batch sizes {sizes} in {time.perf_counter() - t0:.1f}s",
              file=sys.stderr, flush=True)

    def _capture(self, b: int, context: int) -> None:
        """Warm up (kernel compiles) and capture one bucket. With expert parallelism the warm-up runs without
        collectives (same shapes): a capture is one rank's affair, the others are not waiting for it."""
        bs = self.block_size

        def meta_for(communicate: bool) -> AttentionMetadata:
            lockstep = self.step_sync is not None
            meta = AttentionMetadata(block_size=bs, slot_mapping=self.g_slots[:b], num_decode_tokens=b,
                                     decode_block_tables=self.g_tables[:b, :-(-context // bs)],
                                     decode_context_lens=self.g_lens[:b], max_decode_context_len=context,
                                     decode_state_slots=self.g_state_slots[:b] if self.num_state_slots else None,
                                     decode_row_offsets=None if self.g_offsets is None else self.g_offsets[:b],
                                     moe_rows_per_rank=b if lockstep else None,
                                     moe_valid_rows=self.g_valid if lockstep else None, moe_communicate=communicate)
            if self.num_window_blocks:
                meta.layer_views = (dataclasses.replace(meta), dataclasses.replace(
                    meta, slot_mapping=self.g_wslots[:b], decode_block_tables=self.g_wtables[:b, :-(-context // bs)]))
            return meta

        # Rows left from the last replay may address more context than this bucket covers: start every row
        # as a padding row (scratch page, scratch state slot); the step's inputs are copied in after capture.
        self._pad_rows(0, max(b, self._g_live))
        self._g_live = self._g_width = 0
        valid = int(self.g_valid)
        self.g_valid.fill_(0)      # the warm-up's rows count as padding (no EPLB load)
        self.model(self.g_ids[:b], self.g_pos[:b], self.caches, meta_for(False))
        self.g_valid.fill_(valid)
        torch.cuda.synchronize(self.device)
        meta = meta_for(True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            hidden = self.model(self.g_ids[:b], self.g_pos[:b], self.caches, meta)
        # a drafter reading the target's features (spec_decode/feature_proposer.py): the graph's own copies,
        # rewritten by each replay
        captured = dict(self.model.captured) if getattr(self.model, "capture_layers", ()) else None
        self.graphs[(b, context)] = (graph, hidden, captured)

    def _pad_rows(self, start: int, end: int) -> None:
        """Make graph rows [start, end) padding rows: they read and write only the scratch page and slot."""
        self.g_ids[start:end].zero_()
        self.g_pos[start:end].zero_()
        self.g_slots[start:end].fill_(self.scratch_slot)
        self.g_tables[start:end].fill_(self.num_blocks)
        self.g_lens[start:end].fill_(1)
        self.g_state_slots[start:end].fill_(self.num_state_slots)
        if self.g_offsets is not None:
            self.g_offsets[start:end].zero_()
        if self.num_window_blocks:
            self.g_wslots[start:end].fill_(self.window_scratch_slot)
            self.g_wtables[start:end].fill_(self.num_window_blocks)

    def _graph_forward(self, ids: list[int], pos: torch.Tensor, slots: torch.Tensor,
                       tables: list[list[int]], lens: list[int], fixups=None, state_slots=None,
                       min_batch: int = 0, window=None, offsets: list[int] | None = None
                       ) -> tuple[torch.Tensor | None, dict[int, torch.Tensor] | None]:
        """Replay the graph of the smallest bucket holding max(len(ids), min_batch) rows (expert parallelism:
        the bucket all ranks agreed on; an idle rank replays it with padding rows only). Returns the hidden
        rows and the features the model kept for a drafter (None: no bucket / none kept)."""
        b = len(ids)
        bucket = next((s for s in self.graph_sizes if s >= max(b, min_batch)), None)
        if bucket is None:
            return None, None
        if self.step_sync is not None:
            self.g_valid.fill_(b)
        context = self.max_graph_context
        if self.context_buckets:
            longest = max(lens) if lens else 1
            context = min(max(self.block_size, 1 << (longest - 1).bit_length()), self.max_graph_context)
            if (bucket, context) not in self.graphs:
                self._capture(bucket, context)
        # Rows of the bucket past b must be padding rows (scratch page, scratch state slot, position 0): rows
        # that held real requests in an earlier replay would otherwise write into those requests' slots
        # and state (and address context the graph's tables may not cover).
        if self._g_live > b:
            self._pad_rows(b, self._g_live)
        self._g_live = b
        graph, hidden, captured = self.graphs[(bucket, context)]
        if b == 0:
            graph.replay()
            return hidden[:0], None
        host_tables = _pad_tables(tables, fill=self.num_blocks)
        width = host_tables.shape[1]
        dev = self.device
        if self._g_width > width:
            self.g_tables[:b, width:self._g_width].fill_(self.num_blocks)
            if window is not None:
                self.g_wtables[:b, width:self._g_width].fill_(self.num_window_blocks)
        self._g_width = width
        if window is not None:   # window tables have the full tables' lengths (kv_cache/window_group.py)
            self.g_wslots[:b].copy_(h2d(torch.from_numpy(window[0]), dev))
            self.g_wtables[:b, :width].copy_(h2d(torch.from_numpy(_pad_tables(window[1], fill=self.num_window_blocks)),
                                                 dev))
        self.g_ids[:b].copy_(h2d(torch.tensor(ids, dtype=torch.long), dev))
        if fixups is not None:
            self.g_ids[fixups[0]] = fixups[1]
        self.g_pos[:b].copy_(h2d(pos, dev))
        self.g_slots[:b].copy_(h2d(slots, dev))
        self.g_tables[:b, :width].copy_(h2d(torch.from_numpy(host_tables), dev))
        self.g_lens[:b].copy_(h2d(torch.tensor(lens, dtype=torch.long), dev))
        if state_slots is not None and self.num_state_slots:
            self.g_state_slots[:b].copy_(h2d(torch.tensor(state_slots, dtype=torch.long), dev))
        if self.g_offsets is not None:
            self.g_offsets[:b].copy_(h2d(torch.tensor(offsets or [0] * b, dtype=torch.long), dev))
        graph.replay()
        self.graph_replays += 1
        self.max_graph_rows = max(self.max_graph_rows, b)
        if captured is not None:
            # the graph's own buffers, rewritten by the next replay: under async scheduling the next step is
            # queued before the drafter reads this one's features, so they are copied out
            captured = {k: v[:b].clone() if self.config.speculates_async else v[:b] for k, v in captured.items()}
        return hidden[:b], captured

    # ---- one step ---------------------------------------------------------------------------------------
    def _as_decode_rows(self, s) -> bool:
        """Whether a scheduled request runs as decode rows (one query each, attending to the keys up to its own
        position) rather than as a prefill chunk: a decode, and a verify step's token + drafts — its rows are then
        decode rows too, so verify steps replay the decode CUDA graphs (bucketed by rows) instead of running eager.
        On a model with per-request state (DeepSeek's rings) each row also carries its offset among its request's
        rows (`AttentionMetadata.decode_row_offsets`): the rings are read after the step's writes, which the k
        rows of rollback room make safe, and the recurrences (V4's HCA running state, V4.1's Engram look-back)
        take the step's earlier rows from the step itself."""
        if _replaying(s):      # a replay chunk needs the prefill path's per-layer views, even of one token
            return False
        return s.num_new_tokens == 1 or bool(s.draft_token_ids)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, prev: RunnerOutput | None = None,
                grammar_bitmask: GrammarBitmask | None = None) -> RunnerOutput:
        """Queue one step on the device; nothing here waits for the GPU. A request whose newest token is still
        on the device (sampled by `prev`, async scheduling) gets it from there, by a device-side copy.
        `grammar_bitmask` (structured output) holds the allowed tokens of constrained requests; the sampler
        applies it to the logits after the forward (so CUDA graphs of the forward are unaffected)."""
        dev, bs = self.device, self.block_size
        copies = sched.state_copies
        self._load_blocks(copies.kv_loads)
        self._load_window_state(copies.swa_loads)
        self._copy_states(sched.state_copies.restores, restore=True)
        self._load_states(copies.state_loads)
        # decode rows first: they share one batched attention call (and the decode CUDA graphs)
        order = sorted(sched.scheduled, key=lambda s: not self._as_decode_rows(s))
        ids: list[int] = []
        dec_pos, dec_slots = [], []             # decode rows: plain ints (most of a big batch)
        pre_pos, pre_slots = [], []             # prefill chunks: numpy ranges
        prefills: list[PrefillChunk] = []
        decode_tables, decode_lens, decode_state_slots, decode_offsets = [], [], [], []
        logit_rows: list[int] = []
        out = RunnerOutput()
        sampling_reqs = []
        plp_spans = []   # (request, first row, n rows, first token index)
        fix_rows, fix_src = [], []               # rows whose input token is prev's sample
        replays = []                             # (prefill chunk index, plan): chunks replaying a prefix's end
        row = 0
        sample_rows: list[Request] = []         # the sampler's rows: a request verifying drafts fills several
        capture = bool(getattr(self.model, "capture_layers", ()))
        row_drafts: list[list[int]] = []        # the drafts each row comes after
        for s in order:
            req, start, n, table = s.request, s.start, s.num_new_tokens, s.block_ids
            drafts = s.draft_token_ids
            if start >= req.num_tokens:          # the token is pending on the device
                assert n == 1 + len(drafts) and prev is not None, "only a decode can start from a pending token"
                # (after a verify step still on the device: the sample after its last draft, the guess being
                # that all its drafts are kept — the output processor drops these rows if not)
                ids.append(0)
                ids.extend(drafts)
                fix_rows.append(row)
                fix_src.append(prev.sample_index[req.request_id] + len(prev.drafts.get(req.request_id, ())))
            else:
                ids.extend(req.token_ids_slice(start, start + n - len(drafts)))
                ids.extend(drafts)
            replaying = _replaying(s)
            if self._as_decode_rows(s):
                for p in range(start, start + n):     # a verify step's rows: each sees the keys up to its own
                    dec_pos.append(p)
                    dec_slots.append(table[p // bs] * bs + p % bs)
                    decode_tables.append(table)
                    decode_lens.append(p + 1)
                    decode_state_slots.append(s.state_slot)
                    decode_offsets.append(p - start)
            else:
                positions = np.arange(start, start + n)
                np_table = np.asarray(table, dtype=np.int64)
                pre_pos.append(positions)
                pre_slots.append(np_table[positions // bs] * bs + positions % bs)
                decoder_start = None
                if self.yoco_keep is not None and req.sampling_params.prompt_logprobs is None:
                    # YOCO: the decoder runs over the sequence's last `keep` tokens only (every prompt position
                    # needs its logits when prompt logprobs are asked for: those requests run exact)
                    # (kept also for chunks wholly inside the tail: their decoder windows start there too)
                    decoder_start = req.num_tokens - self.yoco_keep if req.num_tokens > self.yoco_keep else None
                prefills.append(PrefillChunk(row, n, start + n, h2d(torch.from_numpy(np_table), dev), bs,
                                             s.state_slot, decoder_start))
                if replaying:
                    replays.append((len(prefills) - 1, s.replay))
            if req.sampling_params.prompt_logprobs is not None and start < req.num_prompt_tokens - 1:
                # from the row predicting prompt_logprobs_start on (a replay may compute earlier rows)
                first = max(start, req.sampling_params.prompt_logprobs_start - 1)
                end = min(start + n, req.num_prompt_tokens - 1)
                if first < end:
                    plp_spans.append((req, row + first - start, end - first, first + 1))
            if capture:
                out.rows[req.request_id] = (row, start, n, s.state_slot)
            if s.samples:
                # the last token's row, then one row per draft: row j samples the token after draft j
                sampling_reqs.append(req)
                out.sample_index[req.request_id] = len(sample_rows)
                first = row + n - 1 - len(drafts)
                logit_rows.extend(range(first, row + n))
                sample_rows.extend([req] * (1 + len(drafts)))
                row_drafts.extend(drafts[:j] for j in range(1 + len(drafts)))
                if drafts:
                    out.drafts[req.request_id] = drafts
            row += n
        # Host-to-device copies first: made after the forward is queued, each would wait for it.
        if sampling_reqs:
            meta_s = SamplingMetadata.from_requests(sample_rows, self.vocab_size, dev,
                                                    row_drafts if out.drafts else None)
            if grammar_bitmask is not None:   # row j of a request: its grammar after its first j drafts
                meta_s.token_bitmask = h2d(grammar_bitmask.for_batch(
                    [(r.request_id, len(d)) for r, d in zip(sample_rows, row_drafts)]), dev)
            logit_index = h2d(torch.tensor(logit_rows), dev)
        fixups = None
        if fix_rows:
            fixups = (h2d(torch.tensor(fix_rows), dev), prev.sampled.token_ids[h2d(torch.tensor(fix_src), dev)])
        pos = torch.from_numpy(np.concatenate([np.asarray(dec_pos, dtype=np.int64), *pre_pos]))
        slots = torch.from_numpy(np.concatenate([np.asarray(dec_slots, dtype=np.int64), *pre_slots]))
        window = self._window_inputs(order, prefills) if self.num_window_blocks else None
        hidden, plan = None, None
        graphable = not prefills and hasattr(self, "graph_sizes") and len(ids) <= self.graph_sizes[-1]
        if self.step_sync is not None:
            plan = self.step_sync.exchange(len(ids), len(ids) if graphable else None)
            graphable = plan.graph_batch > 0
        captured = None
        if graphable:
            hidden, captured = self._graph_forward(ids, pos, slots, decode_tables, decode_lens, fixups,
                                                   decode_state_slots, min_batch=plan.graph_batch if plan else 0,
                                                   window=window, offsets=decode_offsets)
        if hidden is None:
            views = self._layer_views(slots, pos, prefills, replays, window) if window is not None else None
            hidden = self._eager_forward(ids, pos, slots, decode_tables, decode_lens, prefills, fixups,
                                         decode_state_slots, moe_rows=plan.max_tokens if plan else None,
                                         layer_views=views, offsets=decode_offsets)
        if self.eplb is not None:
            self.eplb.after_forward()
        if capture:
            out.captured = self.model.captured if captured is None else captured

        self._copy_states(sched.state_copies.saves, restore=False)
        if copies.state_saves and self.state_store is not None:
            self._save_states(copies.state_saves)
        if sched.state_copies.kv_saves and self.kv_store is not None:
            self._save_blocks(sched.state_copies.kv_saves)
        if plp_spans:
            for req, first, n, tok_index in plp_spans:
                lp = self.model.compute_logits(hidden[first:first + n]).float().log_softmax(-1)
                out.prompt_logprobs[req.request_id] = PromptLogprobsChunk(
                    tok_index, lp, req.prompt_token_ids[tok_index:tok_index + n])
        if sampling_reqs:
            logits = self.model.compute_logits(hidden[logit_index])
            out.sampled = self.sampler(logits, meta_s, self.generator)
            out.logits = logits
            smp = out.sampled
            out.host_copy = D2HCopy({"token_ids": smp.token_ids, "logprobs": smp.logprobs, "ranks": smp.ranks,
                                     "top_ids": smp.top_ids, "top_logprobs": smp.top_logprobs})
        return out

    @torch.inference_mode()
    def execute_idle(self) -> None:
        """Expert parallelism, a step with nothing scheduled here: join the other ranks' forward (their MoE
        exchanges wait for this rank) with padding rows that touch only the scratch page; nothing if no
        rank has work."""
        plan = self.step_sync.exchange(0, 0)
        if not plan.any_work:
            return
        if plan.graph_batch and hasattr(self, "graph_sizes"):
            self._graph_forward([], torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), [], [],
                                min_batch=plan.graph_batch)
        else:
            self._eager_forward([0], torch.zeros(1, dtype=torch.long), torch.tensor([self.scratch_slot]),
                                [[self.num_blocks]], [1], [], None, [self.num_state_slots],
                                moe_rows=plan.max_tokens, moe_valid=torch.zeros((), dtype=torch.long,
                                                                                device=self.device))
        self.eplb.after_forward()

    def _window_inputs(self, order, prefills: list[PrefillChunk]):
        """The windowed layers' inputs (kv_cache/window_group.py): slots, decode tables and prefill chunks from the
        window group's tables, rows in the step's order (decode rows first, as `execute` lays them out)."""
        bs, dev = self.block_size, self.device
        dec_slots, pre_slots, dec_tables, chunks = [], [], [], []
        for s in order:
            table, start, n = s.window_block_ids, s.start, s.num_new_tokens
            if self._as_decode_rows(s):          # (a verify step: one decode row per token, as `execute`)
                for p in range(start, start + n):
                    dec_slots.append(table[p // bs] * bs + p % bs)
                    dec_tables.append(table)
            else:
                positions = np.arange(start, start + n)
                np_table = np.asarray(table, dtype=np.int64)
                pre_slots.append(np_table[positions // bs] * bs + positions % bs)
                chunks.append(dataclasses.replace(prefills[len(chunks)],
                                                  block_ids=h2d(torch.from_numpy(np_table), dev)))
        return np.concatenate([np.asarray(dec_slots, dtype=np.int64), *pre_slots]), dec_tables, chunks

    def _layer_views(self, slots: torch.Tensor, pos: torch.Tensor, prefills: list[PrefillChunk], replays, window):
        """(full-attention slots, windowed slots, windowed prefill chunks, windowed decode tables) of a step of a
        model with a window group. Replaying chunks (kv_cache/bounded_replay.py): replayed rows leave the full
        layers' block KV and the kept windowed rows untouched (they write to the scratch slots), and windowed
        chunks start at the replay's window floor."""
        full = slots.numpy().copy()
        window_slots, window_tables, window_prefills = window[0].copy(), window[1], list(window[2])
        for index, plan in replays:
            chunk = prefills[index]
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            full[rows] = replay_slot_mappings(pos.numpy()[rows], full[rows], plan, self.block_size,
                                              self.scratch_slot)[0]
            window_slots[rows] = replay_slot_mappings(pos.numpy()[rows], window_slots[rows], plan, self.block_size,
                                                      self.window_scratch_slot)[1]
            window_prefills[index] = window_layer_chunk(window_prefills[index], plan)
        return torch.from_numpy(full), torch.from_numpy(window_slots), window_prefills, window_tables

    def _eager_forward(self, ids, pos, slots, decode_tables, decode_lens, prefills, fixups=None,
                       decode_state_slots=None, moe_rows: int | None = None,
                       moe_valid: torch.Tensor | None = None, layer_views=None,
                       offsets: list[int] | None = None) -> torch.Tensor:
        dev = self.device
        meta = AttentionMetadata(block_size=self.block_size, slot_mapping=h2d(slots, dev),
                                 num_decode_tokens=len(decode_tables), prefills=prefills,
                                 moe_rows_per_rank=moe_rows, moe_valid_rows=moe_valid)
        if decode_tables:
            meta.decode_block_tables = h2d(torch.from_numpy(_pad_tables(decode_tables, fill=0)), dev)
            meta.decode_context_lens = h2d(torch.tensor(decode_lens), dev)
            meta.max_decode_context_len = max(decode_lens)
            if self.num_state_slots:
                meta.decode_state_slots = h2d(torch.tensor(decode_state_slots), dev)
                if offsets and any(offsets):
                    meta.decode_row_offsets = h2d(torch.tensor(offsets), dev)
        if layer_views is not None:
            full_slots, window_slots, window_prefills, window_tables = layer_views
            windowed = dataclasses.replace(meta, slot_mapping=h2d(window_slots, dev), prefills=window_prefills)
            if decode_tables:
                windowed.decode_block_tables = h2d(torch.from_numpy(_pad_tables(window_tables, fill=0)), dev)
            meta.layer_views = (dataclasses.replace(meta, slot_mapping=h2d(full_slots, dev)), windowed)
        input_ids = h2d(torch.tensor(ids, dtype=torch.long), dev)
        if fixups is not None:
            input_ids[fixups[0]] = fixups[1]
        return self.model(input_ids, h2d(pos, dev), self.caches, meta)


def _replaying(s) -> bool:
    """Whether this scheduled chunk replays the end of a prefix hit (kv_cache/bounded_replay.py): it runs as a
    prefill chunk, whatever its length, since its layers see the step through different views."""
    return s.replay is not None and s.start < s.replay.end


def _pad_tables(tables: list[list[int]], fill: int) -> np.ndarray:
    """Block tables as one [rows, longest] int64 array, short rows padded with `fill`."""
    width = max(len(t) for t in tables)
    out = np.full((len(tables), width), fill, dtype=np.int64)
    for i, t in enumerate(tables):
        out[i, :len(t)] = t
    return out
