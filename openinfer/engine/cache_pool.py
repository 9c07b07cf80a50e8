"""CachePool: the cache tensors of one rank, sized from the model's cache specs and the memory budget.

Paged kinds (kv_cache/spec.py) get one tensor per layer of [blocks + 1, *block shape] (the extra block is a scratch
page padded rows write to); per-request state kinds one of [state slots + 1, *state shape] (the extra slot is
scratch state). Sliding-window models' windowed kinds form the window group, with their own block count
(kv_cache/window_group.py; `_pool_sizes` splits the budget between the groups). State kinds needed at block
boundaries are also kept as snapshots for prefix hits (`snapshots`, copied to and from the live slots by
`copy_states`).
"""

from __future__ import annotations

import math
import mmap

import numpy as np
import torch
import torch.distributed as dist

from openinfer.config import EngineConfig
from openinfer.device_io import h2d, host_longs
from openinfer.distributed.parallel_state import ParallelContext
from openinfer.kv_cache.spec import CacheSpec, PagedCacheSpec, RequestStateSpec

_CPU_KV_BUDGET = 2 << 30


class CachePool:
    def __init__(self, config: EngineConfig, specs: list[CacheSpec], device: torch.device, parallel: ParallelContext,
                 per_request_state: bool, vocab_size: int, max_positions: int, scratch_bytes: int = 0):
        """`per_request_state`: the model keeps state per running request (one slot per running request);
        `vocab_size` sizes the logits reserve of the GPU budget; `max_positions` bounds a request's length when
        every layer is windowed; `scratch_bytes`: the model's prefill scratch (ModelTraits.prefill_scratch_bytes),
        kept back from the GPU budget too."""
        self.config, self.specs, self.device = config, specs, device
        self.block_size = config.block_size
        self.vocab_size, self.max_positions = vocab_size, max_positions
        self.scratch_bytes = scratch_bytes
        self.num_state_slots = config.max_num_seqs if per_request_state else 0
        if per_request_state != any(isinstance(s, RequestStateSpec) for s in specs):
            raise ValueError("the model's traits and cache specs disagree on per-request state (a model declaring "
                             "RequestStateSpec kinds must say per_request_state=True, and only then)")
        self.num_state_snapshots = 0
        if self.num_state_slots and config.enable_prefix_caching:
            self.num_state_snapshots = (config.num_state_snapshots if config.num_state_snapshots is not None
                                        else 2 * config.max_num_seqs)
        self.num_blocks, self.num_window_blocks = self._pool_sizes()
        if parallel.is_distributed:
            # every rank the same pool: TP ranks must make the same scheduling decisions (preemption, admission)
            # and DP ranks the same max_model_len, whatever memory each GPU happened to have free
            agreed = torch.tensor([self.num_blocks, self.num_window_blocks])
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=parallel.cpu_group)
            self.num_blocks, self.num_window_blocks = int(agreed[0]), int(agreed[1])
        self.scratch_slot = self.num_blocks * self.block_size    # the spare page padded rows write to
        self.window_scratch_slot = self.num_window_blocks * self.block_size   # the window group's
        self.caches = self._allocate_caches()
        # copies of per-request state at block boundaries, for prefix-cache hits (see KVCacheManager)
        self.snapshots = {s.name: [self._zeros((self.num_state_snapshots, *s.state_shape), s.dtype)
                                   for _ in range(s.num_layers)]
                          for s in self.snapshot_specs()}

    # ---- sizes ------------------------------------------------------------------------------------------------
    def bytes_per_block(self, window: bool | None = None) -> int:
        """Bytes of one block of tokens in every paged kind; `window` True / False: the window group's kinds /
        the others' only."""
        return sum(s.bytes_per_block(self.block_size) for s in self.specs if isinstance(s, PagedCacheSpec)
                   and (window is None or (s.window is not None) == window))

    def window_size(self) -> int | None:
        """W of the window group's kinds (None: no window group)."""
        return next((s.window for s in self.specs if isinstance(s, PagedCacheSpec) and s.window), None)

    def snapshot_specs(self) -> list[RequestStateSpec]:
        return [s for s in self.specs if isinstance(s, RequestStateSpec) and s.needed_at_block_boundary
                and self.num_state_snapshots]

    def state_bytes(self) -> int:
        live = sum(s.bytes_per_slot() for s in self.specs if isinstance(s, RequestStateSpec))
        return (self.num_state_slots + 1) * live + self.num_state_snapshots * sum(
            s.bytes_per_slot() for s in self.snapshot_specs())

    def state_snapshot_bytes(self) -> int:
        """Bytes of one request's state as kept at a block boundary (a snapshot; in the store, one entry)."""
        return sum(s.bytes_per_slot() for s in self.snapshot_specs())

    def pool_bytes(self) -> int:
        return (self.num_blocks * self.bytes_per_block(window=False)
                + self.num_window_blocks * self.bytes_per_block(window=True))

    def _kv_budget(self) -> int:
        """Bytes for the paged pools: kv_cache_memory_bytes, else 2 GiB on the CPU or what the GPU has left less a
        reserve (1 GiB of activations, the logits of a full step, the model's prefill scratch)."""
        budget = self.config.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cpu":
                budget = _CPU_KV_BUDGET
            else:
                free, total = torch.cuda.mem_get_info(self.device)
                # memory PyTorch caches but no tensor uses is ours too
                free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
                reserve = (1 << 30) + self.config.max_num_batched_tokens * self.vocab_size * 4 + self.scratch_bytes
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
        longest = c.max_model_len or self.max_positions
        concurrent = min(c.max_num_seqs, num_window // self._window_blocks_per_request(window))
        return max(1, concurrent) * -(-longest // bs) + num_window, num_window

    # ---- tensors ----------------------------------------------------------------------------------------------
    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # Zeroed, not empty: masked-out slots still enter the matmul and must not hold NaN/Inf bit patterns.
        # On the CPU, numpy's calloc gives zero pages lazily, so a large pool costs nothing until used.
        if self.device.type == "cpu":
            nbytes = math.prod(shape) * dtype.itemsize
            return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def touch_pages(self) -> None:
        """Write every page of the caches now. A CPU pool is handed out lazily (see _zeros), so a long-running
        server's memory would creep up as blocks are first used; a server calls this once to start at its
        steady-state size. One byte per memory page is rewritten with its own value: that faults the page in
        as zeroing the whole pool did, without writing every byte (the default 2 GiB pool: ~4x faster), and
        leaves the contents as they were."""
        for tensors in (*self.caches.values(), *self.snapshots.values()):
            for t in tensors:
                flat = t.view(-1).view(torch.uint8)
                if flat.numel():
                    flat[::mmap.PAGESIZE] = flat[::mmap.PAGESIZE].clone()
                    flat[-1:] = flat[-1:].clone()      # the page of the last bytes, past the last stride

    def _allocate_caches(self) -> dict[str, list[torch.Tensor]]:
        """Per declared cache kind, one tensor per layer: [num_blocks, *block_shape] for paged kinds,
        [num_state_slots, *state_shape] for per-request state."""
        caches = {}
        for spec in self.specs:
            if isinstance(spec, PagedCacheSpec):
                # one block more than the KV manager hands out: a scratch page for padded CUDA-graph rows (and
                # in the window group, for released table entries)
                blocks = self.num_window_blocks if spec.window is not None else self.num_blocks
                shape = (blocks + 1, *spec.block_shape(self.block_size))
            else:   # one slot more than the KV manager hands out: scratch state for padded CUDA-graph rows
                shape = (self.num_state_slots + 1, *spec.state_shape)
            caches[spec.name] = [self._zeros(shape, spec.dtype) for _ in range(spec.num_layers)]
        return caches

    def copy_states(self, pairs: list[tuple[int, int]], restore: bool) -> None:
        """Per-request state between live slots and snapshots: (snapshot, slot) pairs restored into the slots
        (`restore`), or (slot, snapshot) pairs saved."""
        if not pairs:
            return
        # (through pinned memory: a plain torch.tensor(..., device=cuda) would make the host wait for the step in
        # flight, and with prefix caching a wide batch has a request crossing a block boundary almost every step)
        src_idx = h2d(host_longs([a for a, _ in pairs]), self.device)
        dst_idx = h2d(host_longs([b for _, b in pairs]), self.device)
        for name, snaps in self.snapshots.items():
            for live, snap in zip(self.caches[name], snaps):
                src, dst = (snap, live) if restore else (live, snap)
                dst.index_copy_(0, dst_idx, src.index_select(0, src_idx))
