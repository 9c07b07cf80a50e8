"""One rank's process: an `LLMEngine` for its rank, driven by commands from the front end
(`executor.MultiprocEngine`) over a pipe (ranks the front end spawned) or a TCP connection
(`multiprocessing.connection.Client`, HMAC-authenticated: ranks on other hosts, started by `openinfer worker`, and
ranks Ray started as actors, `ray_ranks.py`). Both have the same send/recv API, so one command loop serves all.

Commands are handled strictly in arrival order (adds and aborts apply before the next step), which is what
keeps the TP ranks of a group scheduling identically. Every reply is `(kind, payload)`; an exception — at start,
in any command, or while stopping on `("shutdown",)` — is reported as `("error", traceback, time it failed)` and
ends the worker (a rank that failed mid-step may have left its peers inside a collective, so the front end stops
them all; the time lets it tell the rank that failed first from the peers that failed because of it).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback


class WorkerError(RuntimeError):
    """A worker (a rank's process or Ray actor) failed or died; the message names its rank and carries the error it
    sent, if it could."""


def rank_process_context():
    """The multiprocessing context the front end starts its ranks from: multiprocessing's fork server, which
    imports torch and the engine once (the first rank of the first engine) and then forks each rank from that
    state — a rank starts without paying the ~2-3 s torch import (docs/parallelism.md has the start-up times).
    Forking it is safe: the server only imported modules (no CUDA context, no thread pool, no user code).
    Ranks never run the front end's `__main__` (`rank_bootstrap`, preloaded here): a front end started from
    standard input (`python -`), a notebook or a script without a main guard starts its ranks like any other.
    Spawn where there is no fork server (Windows; there the main is re-run as multiprocessing does). The server
    starts with the front end's environment of that moment and exits with the front end."""
    import multiprocessing as mp

    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["openinfer.executor.rank_bootstrap", "torch", "openinfer.engine.llm_engine",
                                __name__])
    return ctx


def end_process(p) -> None:
    """A process that was asked to stop and did not: SIGTERM, then SIGKILL, waiting a little after each."""
    if p.is_alive():
        p.terminate()
        p.join(timeout=5)
    if p.is_alive():
        p.kill()
        p.join(timeout=5)


def _exit_with_parent(front_end_pid: int | None = None) -> None:
    """Exit as soon as the front end is gone, even if it was killed by SIGKILL, so no worker outlives it holding
    GPU memory: a daemon thread polls the parent pid — the front end's (spawn) or the fork server's, which exits
    with the front end — and the front end's own pid, in case it was gone before this thread started. (Not
    PR_SET_PDEATHSIG: the kernel sends that when the creating *thread* ends, which would kill the workers of an
    engine built in a short-lived thread.) An idle worker also ends on its closed pipe."""
    parent_pid = os.getppid()

    def gone(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid or (front_end_pid is not None and gone(front_end_pid)):
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="openinfer-parent-watch", daemon=True).start()


def worker_main(config, model, rank: int, init_method: str, conn, parent_pid: int | None = None) -> None:
    """A rank the front end spawned on its own host: uses GPU `rank`."""
    _exit_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C is the front end's to handle
    _run(config, model, rank, init_method, conn, local_index=rank, ranks_on_host=config.local_ranks)


def remote_worker_main(address: tuple[str, int], authkey: bytes, rank: int, local_index: int, ranks_on_host: int,
                       device: str | None, connect_timeout_s: float = 1800.0) -> None:
    """A rank on another host (`openinfer worker`): `serve_front_end` in a process that ends with the command that
    started it."""
    _exit_with_parent()                             # the `openinfer worker` command is the parent
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C is the command's to handle
    try:
        serve_front_end(address, authkey, rank, local_index, ranks_on_host, device, connect_timeout_s)
    except ConnectionError as e:
        raise SystemExit(f"openinfer worker {e}") from None


def serve_front_end(address: tuple[str, int], authkey: bytes, rank: int, local_index: int, ranks_on_host: int,
                    device: str | None, connect_timeout_s: float) -> None:
    """A rank the front end did not spawn (`openinfer worker` on another host, or a Ray actor: ray_ranks.py):
    connect to the front end, say which rank this is, receive the engine config and the rendezvous address, then
    serve commands exactly as a spawned rank does. Uses GPU `local_index` (its position among this host's ranks);
    `device`, when given, must match the front end's. The front end may not be listening yet: connecting is retried
    for `connect_timeout_s`. A front end that cannot be reached, refuses the key or this rank: ConnectionError."""
    import multiprocessing.connection as mpc

    deadline = time.monotonic() + connect_timeout_s
    while True:
        try:
            conn = mpc.Client(address, family="AF_INET", authkey=authkey)
            break
        except (ConnectionRefusedError, ConnectionResetError, TimeoutError) as e:
            if time.monotonic() > deadline:
                raise ConnectionError(f"rank {rank}: no front end at {address[0]}:{address[1]} within "
                                      f"{connect_timeout_s:g} s ({e})") from None
            time.sleep(0.2)
        except mpc.AuthenticationError as e:
            raise ConnectionError(f"rank {rank}: the front end at {address[0]}:{address[1]} rejected the authkey "
                                  f"({e}): is OPENINFER_WORKER_AUTHKEY the same on both hosts?") from None
    try:
        conn.send(("hello", rank))
        reply = conn.recv()
        if reply[0] != "config":
            raise ConnectionError(f"rank {rank}: the front end at {address[0]}:{address[1]} refused it: {reply[1]}")
        config, init_method, model = reply[1], reply[2], reply[3]
        if device is not None and device.split(":")[0] != config.device.split(":")[0]:
            conn.send(("error", f"rank {rank}: this host's --device {device} differs from the front end's "
                                f"device {config.device!r} (all ranks use one device type and backend)",
                       time.time()))
            raise SystemExit(1)
    except EOFError:
        raise ConnectionError(f"rank {rank}: the front end closed the connection") from None
    _run(config, model, rank, init_method, conn, local_index=local_index, ranks_on_host=ranks_on_host)
    conn.close()


def _run(config, model, rank: int, init_method: str, conn, local_index: int, ranks_on_host: int) -> None:
    """`model`: the model as the front end resolved it (models/interface.py: ResolvedModel)."""
    engine = None
    try:
        import torch

        from openinfer.distributed.parallel_state import destroy_parallel, init_parallel
        from openinfer.engine.llm_engine import LLMEngine

        if config.device == "cpu":
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, ranks_on_host)))
            device = torch.device("cpu")
        else:
            device = torch.device("cuda", local_index % max(1, torch.cuda.device_count()))
        ctx = init_parallel(config.data_parallel_size, config.tensor_parallel_size, config.enable_expert_parallel,
                            rank, device, init_method, num_redundant_experts=config.num_redundant_experts,
                            cp_size=config.context_parallel_size)
        engine = LLMEngine(config, parallel=ctx, model=model)
        conn.send(("ready", {"model_config": engine.model_config, "max_model_len": engine.max_model_len,
                             "num_blocks": engine.kv_manager.num_blocks, "stats": engine.stats()}))
        _serve(engine, ctx, conn)
        # the front end asked to stop: a failure here (queued store writes, say) is reported like any other
        stopping, engine = engine, None
        stopping.shutdown()
    except (EOFError, KeyboardInterrupt):
        if engine is not None:                      # the front end is gone: nobody to tell
            engine.shutdown()
    except BaseException:
        failed_at = time.time()
        try:
            conn.send(("error", f"rank {rank}: " + traceback.format_exc(), failed_at))
        except OSError:
            pass
        os._exit(1)     # skip process-group teardown: peers may be waiting in a collective
    try:
        destroy_parallel()
    except Exception:
        pass


def _serve(engine, ctx, conn) -> None:
    import torch

    step_s = 0.0      # host time inside engine.step(), reported with the stats (where a step's time goes)
    refused = []      # requests this rank could not take: reported (aborted, with the reason) at the next step
    while True:
        msg = conn.recv()
        kind = msg[0]
        if kind == "add":
            try:
                _add(engine, msg[1])
            except (ValueError, TypeError) as e:     # fails alone; the engine keeps serving
                if ctx.tp_size * ctx.cp_size > 1:
                    # the group's other TP (or CP) ranks may have taken it: their schedules would part (and their
                    # collectives with them), so this is fatal for the engine, named by rank
                    raise
                refused.append(_refusal(msg[1], e))
        elif kind == "abort":
            engine.abort_request(msg[1])
        elif kind == "step":
            t = time.perf_counter()
            outputs = engine.step() if ctx.is_driver else (engine.step(), [])[1]
            step_s += time.perf_counter() - t
            if ctx.is_driver:
                outputs += refused
            refused = []
            for out in outputs:            # the front end has the prompt; don't send it every step
                out.prompt_token_ids, out.prompt = None, None
            stats = engine.stats()
            stats["worker_step_s"] = step_s
            if engine.runner.step_sync is not None:
                stats["step_sync_s"] = engine.runner.step_sync.wait_s
                stats["step_sync_rounds"] = engine.runner.step_sync.rounds
                stats["two_batch_steps"] = engine.runner.two_batch_steps
            conn.send(("ok", (outputs, engine.has_unfinished_requests(), stats)))
        elif kind == "touch":
            engine.touch_cache_pages()
            conn.send(("ok", None))
        elif kind == "call":
            with torch.no_grad():     # a call may write weights (rebalance_experts); nothing here tracks gradients
                conn.send(("ok", getattr(engine, msg[1])(*msg[2])))
        elif kind == "shutdown":
            return
        else:
            raise ValueError(f"unknown command {kind!r}")


def _refusal(kwargs, error: Exception):
    from openinfer.outputs import CompletionOutput, RequestOutput

    return RequestOutput(kwargs["request_id"], None, [], None,
                         [CompletionOutput(0, "", [], None, None, finish_reason="abort", stop_reason=str(error))],
                         finished=True)


def _add(engine, kwargs) -> None:
    """Grammars compile before the request is queued, so TP ranks admit it at the same step (a request
    whose grammar is still compiling would be scheduled when each rank's compiler is done)."""
    spec = kwargs["params"].structured_outputs
    if spec is not None:
        engine.structured_output.pool.compile_blocking(spec)
    engine.add_request(**kwargs)
