"""Host<->device copies that never make the host wait for queued GPU work.

A plain `torch.tensor(..., device="cuda")` or `.tolist()` is a synchronous copy through pageable memory: it
waits for everything already queued on the stream, which would serialize the engine's CPU work with the
previous step's GPU work. These go through pinned memory with non-blocking copies instead; reading a
device result back waits on an event recorded right after it, not on later work.
"""

from __future__ import annotations

import numpy as np
import torch


def host_longs(values) -> torch.Tensor:
    """A CPU int64 tensor of a list of ints, through numpy: several times faster than `torch.tensor(list)`, which
    a wide step's per-row inputs (ids, lengths, slots) would otherwise pay each step."""
    return torch.from_numpy(np.fromiter(values, dtype=np.int64, count=len(values)))


def h2d(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a CPU tensor to `device` without blocking the host (a no-op on the CPU)."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class ReadOnce:
    """A device tensor's values on the host, read at the first `tolist()` (one sync: it waits for the GPU) and kept
    for the later calls: for consumers that need the same device values on the host (a MoE's two grouped GEMMs share
    their offsets), so that only the first of them waits."""

    def __init__(self, t: torch.Tensor):
        self.tensor, self._values = t, None

    def tolist(self) -> list:
        if self._values is None:
            self._values = self.tensor.tolist()
        return self._values


class D2HCopy:
    """Device tensors copied to pinned host buffers, readable once the GPU has produced them."""

    def __init__(self, tensors: dict[str, torch.Tensor | None]):
        self.host: dict[str, torch.Tensor | None] = {}
        self.event = None
        cuda = any(t is not None and t.is_cuda for t in tensors.values())
        for name, t in tensors.items():
            if t is None or not cuda:
                self.host[name] = t
            else:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                buf.copy_(t, non_blocking=True)
                self.host[name] = buf
        if cuda:
            self.event = torch.cuda.Event()
            self.event.record()

    def ready(self) -> bool:
        """Whether the copies are done (never waits)."""
        return self.event is None or self.event.query()

    def wait(self) -> dict[str, torch.Tensor | None]:
        if self.event is not None:
            self.event.synchronize()
        return self.host
