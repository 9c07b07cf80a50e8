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
