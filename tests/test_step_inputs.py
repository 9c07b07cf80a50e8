"""A step's host-side inputs built the fast way equal the plain way: block tables padded through numpy equal the
row-by-row loop, ints through numpy equal torch.tensor of the list."""

import random

import numpy as np
import torch

from openinfer.device_io import host_longs
from openinfer.engine.cuda_graphs import pad_tables


def _pad_rows_one_by_one(tables, fill):
    width = max(len(t) for t in tables)
    out = np.full((len(tables), width), fill, dtype=np.int64)
    for i, t in enumerate(tables):
        out[i, :len(t)] = t
    return out


def test_padded_tables_equal_filling_row_by_row():
    rng = random.Random(0)
    cases = [[[3, 4, 5]] * 7, [[1], [2, 3], [], [4, 5, 6, 7]], [[9, 8]], [[0] * 40 for _ in range(128)]]
    for _ in range(300):    # ragged and equal lengths, empty rows among them
        n, same = rng.randint(1, 20), rng.random() < 0.3
        width = rng.randint(0, 6)
        cases.append([[rng.randint(0, 10**6) for _ in range(width if same else rng.randint(0, 6))] for _ in range(n)])
    for tables in cases:
        if not any(tables):
            continue
        for fill in (0, -1, 77):
            got, want = pad_tables(tables, fill), _pad_rows_one_by_one(tables, fill)
            assert got.dtype == want.dtype == np.int64 and got.shape == want.shape
            assert (got == want).all()


def test_host_longs_equal_torch_tensor_of_the_list():
    for values in ([], [0], [5, -3, 2**40], list(range(1000)), [np.int64(4), 7]):
        got, want = host_longs(values), torch.tensor([int(v) for v in values], dtype=torch.long)
        assert got.dtype == torch.long and got.device.type == "cpu" and torch.equal(got, want)


class _Graph:
    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


def _graphs_on_cpu(rows: int, width: int, window: bool, offsets: bool):
    """DecodeGraphs' replay-side state on the CPU (its captures need CUDA): a stand-in graph per (batch, context)
    bucket, the input buffers as __init__ makes them."""
    from types import SimpleNamespace

    from openinfer.engine.cuda_graphs import DecodeGraphs

    g = DecodeGraphs.__new__(DecodeGraphs)
    g.pool = SimpleNamespace(num_blocks=1000, num_window_blocks=500 if window else 0, num_state_slots=64,
                             scratch_slot=999 * 16, window_scratch_slot=499 * 16)
    g.sizes, g.lockstep, g.context_buckets, g.max_context, g.block_size = [1, 2, 4, 8], False, True, 4096, 16
    g.device, g.replays, g.max_rows, g._live, g._width = torch.device("cpu"), 0, 0, 0, 0
    g.graphs = {(b, c): (_Graph(), torch.zeros(b, 3), None) for b in g.sizes for c in g.context_sizes()}
    g.ids, g.pos, g.lens = (torch.zeros(rows, dtype=torch.long) for _ in range(3))
    g.slots = torch.full((rows,), g.pool.scratch_slot)
    g.tables = torch.full((rows, width), g.pool.num_blocks)
    g.state_slots = torch.full((rows,), 64)
    g.offsets = torch.zeros(rows, dtype=torch.long) if offsets else None
    if window:
        g.wslots = torch.full((rows,), g.pool.window_scratch_slot)
        g.wtables = torch.full((rows, width), 500)
    return g


def test_graph_replay_stages_every_input_into_its_buffer():
    """The replay copies its inputs through one staging buffer: each graph buffer gets exactly its input (padding
    rows and table columns past the step's as they were), over steps whose batch and table width shrink."""
    rng = random.Random(1)
    for window, offsets in ((False, False), (True, True)):
        g = _graphs_on_cpu(8, 12, window, offsets)
        for b, width in ((7, 9), (5, 4), (8, 6), (3, 2)):
            tables = [[rng.randrange(1000) for _ in range(rng.randint(1, width))] for _ in range(b)]
            tables[0] = tables[0] + [rng.randrange(1000) for _ in range(width - len(tables[0]))]
            ids = [rng.randrange(50000) for _ in range(b)]
            pos = torch.tensor([rng.randrange(16 * width) for _ in range(b)])
            slots = torch.tensor([rng.randrange(16000) for _ in range(b)])
            lens = [rng.randint(1, 16 * width) for _ in range(b)]
            state = [rng.randrange(64) for _ in range(b)]
            offs = [rng.randrange(3) for _ in range(b)]
            win = None
            if window:
                win = (np.array([rng.randrange(8000) for _ in range(b)], dtype=np.int64),
                       [[rng.randrange(500) for _ in range(len(t))] for t in tables])
            fix = (torch.tensor([1, b - 1]), torch.tensor([77, 78]))
            hidden, _ = g.replay(ids, pos, slots, tables, lens, fix, state, window=win, offsets=offs)
            assert hidden.shape[0] == b
            want_ids = torch.tensor(ids)
            want_ids[fix[0]] = fix[1]
            assert torch.equal(g.ids[:b], want_ids) and not g.ids[b:].any()
            assert torch.equal(g.pos[:b], pos) and torch.equal(g.slots[:b], slots)
            assert torch.equal(g.lens[:b], torch.tensor(lens)) and torch.equal(g.state_slots[:b], torch.tensor(state))
            assert torch.equal(g.tables[:b], torch.from_numpy(_pad_rows_one_by_one([t + [1000] * (12 - len(t))
                                                                                  for t in tables], 1000)))
            assert (g.tables[b:] == 1000).all() and (g.slots[b:] == g.pool.scratch_slot).all()
            if offsets:
                assert torch.equal(g.offsets[:b], torch.tensor(offs))
            if window:
                assert torch.equal(g.wslots[:b], torch.from_numpy(win[0]))
                assert torch.equal(g.wtables[:b], torch.from_numpy(_pad_rows_one_by_one(
                    [t + [500] * (12 - len(t)) for t in win[1]], 500)))
