"""Ranks start without running the front end's `__main__`.

multiprocessing prepares every child it starts (spawn and the fork server alike) by running the parent's main file
again as `__mp_main__` (or importing its main module), so that functions defined there can be unpickled. A rank
needs nothing from there — it receives an `EngineConfig`, a resolved model and a pipe, all openinfer objects — and
running it fails or misbehaves where the main is not a file to re-run: a front end started from standard input
(`python - <<EOF`: its main file is `<stdin>`, which the child cannot open, so every rank died at start), a
script without a main guard (the rank would build a second engine while it bootstraps), and costs the script's
imports where it works.

This module is imported by the fork server only (`worker.rank_process_context` preloads it): there it wraps
`multiprocessing.spawn.prepare` so that a child whose process name starts with `openinfer-` (ranks, the engine
core) skips the main entries of its preparation data; every other child the server forks is prepared as before.
The wrapper is installed once, at import, in the fork server's process; a fork server started earlier by other
code without this preload does not have it (multiprocessing keeps one fork server per process).
"""

from __future__ import annotations

import multiprocessing.spawn as _spawn

PROCESS_PREFIX = "openinfer-"
_MAIN_ENTRIES = ("init_main_from_path", "init_main_from_name")


def prepare_without_main(data: dict, _prepare=_spawn.prepare) -> None:
    """`spawn.prepare`, minus re-running the parent's main for openinfer's own processes."""
    if str(data.get("name", "")).startswith(PROCESS_PREFIX):
        data = {k: v for k, v in data.items() if k not in _MAIN_ENTRIES}
    _prepare(data)


if _spawn.prepare.__name__ != prepare_without_main.__name__:     # once, even if this module loads twice
    _spawn.prepare = prepare_without_main
