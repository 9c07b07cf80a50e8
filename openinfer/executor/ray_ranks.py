"""Ranks as Ray actors (`distributed_executor_backend="ray"`): how the multi-process front end (`multiproc.py`)
starts, places, watches and stops its ranks on a Ray cluster. The front end is the same one: only the way ranks
start differs (processes it forks, `openinfer worker` commands on other hosts, or these actors).

Placement: one placement group per data-parallel group, one bundle per rank (`{"GPU": 1, "CPU": 1}` on CUDA,
`{"CPU": 1}` on CPU), `STRICT_PACK`: a tensor-parallel group all-reduces in every layer, so its ranks share a node
(NVLink); the DP groups, and the expert-parallel exchange that spans them, may sit on different nodes (NCCL over
the network), which is how vLLM places its DP ranks too.

The command channel: each actor connects back to the front end over TCP, authenticated with a random key made for
this engine and handed to the actors through Ray (the stdlib `multiprocessing.connection` HMAC challenge that
`openinfer worker` uses), then runs `worker.serve_front_end` like any remote rank: the same commands, replies,
tracebacks and failure attribution. Commands do not go through Ray actor calls because a step is one round trip to
every rank: through Ray that is ~0.9 ms, over the socket ~0.03 ms (measured on the 2-core development machine,
Ray 2.60).

Rendezvous: rank 0's actor reports its node's address and a free port there, and every rank joins torch.distributed
at `tcp://` that address (NCCL on GPUs, gloo on CPU), unless `distributed_init_method` is given.

The cluster: `ray.init()` as Ray resolves it: `$RAY_ADDRESS`, else a cluster `ray start` runs on this host, else a
new local one (which lives until this process exits). A driver that already called `ray.init` is used as it is.

Lifecycle: an actor that fails before it connects is reported with Ray's error for its `run` call (its traceback,
or why the actor died); a dead actor afterwards closes its connection, and the front end names its rank with
Ray's account of the death. `stop()` (the front end's shutdown, its finalizer, a failure) kills every actor and
removes the placement groups; if the front end's process dies instead, Ray ends the actors and groups it owns.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import uuid

from openinfer.config import EngineConfig
from openinfer.executor.worker import WorkerError

_WAIT_NOTE_S = 10.0       # while a placement group waits for resources, say so this often


class _RankActor:
    """One rank's process under Ray (made a Ray actor class by `ray.remote` when the backend starts, so this
    module imports without Ray)."""

    def where(self) -> tuple[str, int, int]:
        """(this node's address as Ray knows it, this process's pid, a free port on this node)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), os.getpid(), port

    def run(self, address: tuple[str, int], authkey: bytes, rank: int, local_index: int, ranks_on_host: int,
            connect_timeout_s: float) -> None:
        from openinfer.executor.worker import serve_front_end

        serve_front_end(address, authkey, rank, local_index, ranks_on_host, None, connect_timeout_s)


class RayRanks:
    """The Ray side of one engine's ranks: its placement groups and actors, and what Ray knows about them.
    Construction places and creates the actors (and removes what it made if that fails); `start` makes them
    connect to the front end; `stop` removes everything."""

    def __init__(self, config: EngineConfig, deadline: float):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.config = config
        self.actors: list = []
        self.runs: list = []                  # each actor's `run` call: resolves when the rank ends
        self.groups: list = []
        if not ray.is_initialized():
            try:
                ray.init(logging_level="WARNING")
            except Exception as e:
                raise RuntimeError(f"distributed_executor_backend='ray': could not join or start a Ray cluster "
                                   f"(RAY_ADDRESS={os.environ.get('RAY_ADDRESS')!r}): {e}") from e
        print(f"[openinfer] {config.world_size} ranks as Ray actors on the Ray cluster at "
              f"{ray.get_runtime_context().gcs_address}", file=sys.stderr, flush=True)
        try:
            gpu = config.device.startswith("cuda")
            bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
            per_group = config.ranks_per_dp_group      # a DP group's TP x CP ranks, packed on one node
            tag = uuid.uuid4().hex[:8]
            self.groups = [placement_group([dict(bundle) for _ in range(per_group)], strategy="STRICT_PACK",
                                           name=f"openinfer-{tag}-dp{d}")
                           for d in range(config.data_parallel_size)]
            self._wait_placed(bundle, deadline)
            actor_class = ray.remote(_RankActor)
            for rank in range(config.world_size):
                group, index = divmod(rank, per_group)
                self.actors.append(actor_class.options(
                    name=f"openinfer-{tag}-rank{rank}", num_cpus=1, num_gpus=1 if gpu else 0, max_restarts=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self.groups[group], placement_group_bundle_index=index)).remote())
            self.places = self._get([a.where.remote() for a in self.actors], deadline, "start")
        except BaseException:
            self.stop()
            raise
        self.pids = [pid for _, pid, _ in self.places]
        ip0, _, port0 = self.places[0]
        self.rendezvous = f"tcp://{_host_for_url(ip0)}:{port0}"
        self.driver_ip = ray.util.get_node_ip_address()

    def _wait_placed(self, bundle: dict, deadline: float) -> None:
        import ray
        from ray.util.placement_group import placement_group_table

        pending = {g.ready(): g for g in self.groups}
        next_note = time.monotonic() + _WAIT_NOTE_S
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError(f"Ray could not place {len(pending)} of the {len(self.groups)} rank groups "
                                  f"({self.config.tensor_parallel_size} x {bundle} each, all on one node) within "
                                  f"{self.config.worker_start_timeout_s:g} s: the cluster has "
                                  f"{_devices(ray.cluster_resources())}, free {_devices(ray.available_resources())}")
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=min(left, 1.0))
            for ref in ready:
                del pending[ref]
            if pending and time.monotonic() > next_note:
                next_note += _WAIT_NOTE_S
                states = [placement_group_table(g)["stats"]["scheduling_state"] for g in pending.values()]
                print(f"[openinfer] waiting for Ray to place {len(pending)} rank group(s) of "
                      f"{self.config.tensor_parallel_size} x {bundle} on one node each ({', '.join(states)}); "
                      f"free: {_devices(ray.available_resources())}", file=sys.stderr, flush=True)

    def _get(self, refs, deadline: float, what: str) -> list:
        """ray.get of one call per actor, each failure named by its rank."""
        import ray

        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=max(0.0, deadline - time.monotonic()))
        out = []
        for rank, ref in enumerate(refs):
            if ref not in ready:
                raise WorkerError(f"worker rank {rank} (a Ray actor) did not {what} within "
                                  f"{self.config.worker_start_timeout_s:g} s")
            try:
                out.append(ray.get(ref))
            except Exception as e:
                raise WorkerError(f"worker rank {rank} (a Ray actor) failed to {what}: {_ray_error_text(e)}") \
                    from None
        return out

    def start(self, address: tuple[str, int], authkey: bytes, connect_timeout_s: float) -> None:
        """Each actor connects to the front end at `address` and serves it (until shutdown or failure)."""
        nodes = [ip for ip, _, _ in self.places]
        for rank, actor in enumerate(self.actors):
            same_node = [r for r, ip in enumerate(nodes) if ip == nodes[rank]]
            self.runs.append(actor.run.remote(address, authkey, rank, same_node.index(rank), len(same_node),
                                              connect_timeout_s))

    def ended_before_connecting(self, ranks) -> tuple[int, str] | None:
        """The first of `ranks` whose actor's `run` already ended, with why; None if all are running."""
        import ray

        refs = {self.runs[r]: r for r in ranks}
        if not refs:
            return None
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        for ref in ready:
            return refs[ref], self.outcome(refs[ref], 0.0)
        return None

    def describe(self, rank: int) -> str:
        ip, pid, _ = self.places[rank]
        return f"Ray actor on {ip}, pid {pid}"

    def outcome(self, rank: int, timeout_s: float = 5.0) -> str:
        """How rank's `run` ended, as Ray reports it: its exception's traceback, or why its actor died."""
        import ray

        try:
            ray.get(self.runs[rank], timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            return "its actor is still running"
        except Exception as e:
            return _ray_error_text(e)
        return "it returned"

    def stop(self) -> None:
        """Kill every actor and remove the placement groups. Idempotent; nothing to do once this process's
        connection to Ray is gone (interpreter exit: Ray then ends what this driver owned)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized():
            return
        actors, groups = self.actors, self.groups
        self.actors, self.groups = [], []
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        for group in groups:
            try:
                remove_placement_group(group)
            except Exception:
                pass


def _devices(resources: dict) -> dict:
    """A Ray resource table's CPUs and GPUs (not its per-node and placement-group bookkeeping)."""
    return {k: v for k, v in resources.items() if k in ("CPU", "GPU")}


def _host_for_url(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def _ray_error_text(e: Exception) -> str:
    """Ray's error without its boilerplate: a task's traceback as it was raised, or the sentence saying why an
    actor died."""
    import ray

    if isinstance(e, ray.exceptions.RayTaskError):
        return str(e).strip()
    text = str(e)
    for line in text.splitlines():
        if line.startswith("The actor is dead because"):
            return line.split(" Some common causes include")[0].strip()
    return f"{type(e).__name__}: {text.strip()}"
