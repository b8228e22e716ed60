"""Starting the ranks of a tensor-parallel engine: spawned by rank 0, or under ``torchrun``.

Spawned (``polyspec generate --tensor-parallel-size N``, ``LLM(tensor_parallel_size=N)``):
the calling process is rank 0. It hosts the rendezvous store on a free local port, starts
ranks 1..N-1 with ``torch.multiprocessing`` (the ``spawn`` start method: a fresh interpreter
each, no forked device state), and every rank joins the process groups. Under ``torchrun``
(``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` set) every
process is started by torchrun and joins through torchrun's store, on one node or several.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

from polyspec.errors import ConfigError
from polyspec.parallel.group import FOREVER, TPGroup

TORCHRUN_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun (and any ``env://`` launcher) sets in each rank's environment."""

STARTUP_TIMEOUT_S = 600.0
"""How long the ranks wait for each other to join (a rank imports torch and its backend
first): a rank that never joins fails the others after this."""


def under_torchrun(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process was started by torchrun (or another ``env://`` launcher)."""
    env = os.environ if env is None else env
    return all(env.get(k) for k in TORCHRUN_VARIABLES)


def check_distributed_backend(name: str | None, backend_name: str) -> str:
    """The ``torch.distributed`` backend ``name`` a backend declares, checked to exist in
    this torch; :class:`ConfigError` before anything starts otherwise."""
    if name is None:
        raise ConfigError(
            f"backend {backend_name!r} declares no torch.distributed backend "
            "(BackendCapabilities.distributed_backend is None): it cannot run tensor parallel; "
            "use tensor_parallel_size = 1"
        )
    if not dist.is_available() or not dist.is_backend_available(name):
        raise ConfigError(
            f"backend {backend_name!r} talks between ranks through torch.distributed backend "
            f"{name!r}, which this torch build does not provide; install a build with {name} "
            "or use tensor_parallel_size = 1"
        )
    return name


def check_devices(world_size: int, local_ranks: int, backend: Any) -> None:
    """:class:`ConfigError` when this host would run more ranks (``local_ranks`` of
    ``world_size``) than the backend has devices (:meth:`Backend.device_count`)."""
    devices = backend.device_count()
    if devices is not None and local_ranks > devices:
        raise ConfigError(
            f"tensor_parallel_size = {world_size} needs {local_ranks} {backend.device_type} "
            f"devices on this host, backend {backend.name!r} sees {devices}; use at most "
            f"{devices} ranks per host (torchrun starts ranks on several hosts)"
        )


def _join(
    rank: int,
    world_size: int,
    local_rank: int,
    store: Any,
    dist_backend: str,
    timeout_s: float,
    dead_ranks: Callable[[], dict[int, str]] | None = None,
) -> TPGroup:
    """Join the default (model) group and the gloo control group."""
    dist.init_process_group(
        dist_backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=max(timeout_s, STARTUP_TIMEOUT_S)),
    )
    ranks = list(range(world_size))
    group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s))
    control = dist.new_group(ranks, backend="gloo", timeout=FOREVER)
    return TPGroup(
        rank, world_size, local_rank, group, control, store, dead_ranks, timeout_s=timeout_s
    )


def join_spawned(
    rank: int, world_size: int, port: int, dist_backend: str, timeout_s: float
) -> TPGroup:
    """A rank rank 0 spawned: join through rank 0's store on ``port`` of this host."""
    store = dist.TCPStore(
        "127.0.0.1",
        port,
        world_size,
        is_master=False,
        timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S),
    )
    return _join(rank, world_size, rank, store, dist_backend, timeout_s)


class SpawnedRanks:
    """Rank 0's handle on the ranks it spawned: their processes, and how each ended."""

    def __init__(self, context: Any) -> None:
        self._context = context

    @property
    def processes(self) -> list[Any]:
        """The processes of ranks 1..N-1, in rank order."""
        return list(self._context.processes)

    def dead(self) -> dict[int, str]:
        """``{rank: how it ended}`` of the spawned ranks that have exited."""
        out = {}
        for i, p in enumerate(self._context.processes):
            if p.exitcode is not None:
                how = f"signal {-p.exitcode}" if p.exitcode < 0 else f"code {p.exitcode}"
                out[i + 1] = f"its process exited ({how}) without reporting an error"
        return out

    def join(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for every spawned rank to exit, then kill the rest."""
        for p in self._context.processes:
            p.join(timeout_s)
        for p in self._context.processes:
            if p.is_alive():
                p.terminate()
                p.join(5.0)
                if p.is_alive():
                    p.kill()


def spawn_ranks(
    world_size: int,
    dist_backend: str,
    timeout_s: float,
    follower: Callable[..., None],
    follower_args: tuple[Any, ...],
) -> tuple[TPGroup, SpawnedRanks]:
    """Rank 0: host the store, start ranks 1..N-1 as ``follower(i, port, *follower_args)``
    (``i`` = rank - 1, as ``torch.multiprocessing`` counts), and join them."""
    import torch.multiprocessing as mp

    store = dist.TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S),
        wait_for_workers=False,
    )
    context = mp.start_processes(
        follower,
        args=(store.port, *follower_args),
        nprocs=world_size - 1,
        join=False,
        start_method="spawn",
    )
    ranks = SpawnedRanks(context)
    try:
        group = _join(0, world_size, 0, store, dist_backend, timeout_s, ranks.dead)
    except BaseException:
        ranks.join(0.0)
        raise
    return group, ranks


def join_torchrun(
    world_size: int, dist_backend: str, timeout_s: float, env: Mapping[str, str] | None = None
) -> TPGroup:
    """A rank torchrun started: check its ``WORLD_SIZE`` against ``world_size`` and join
    through torchrun's store (``TORCHELASTIC_USE_AGENT_STORE``: the agent hosts it; else rank 0
    does)."""
    env = os.environ if env is None else env
    launched = int(env["WORLD_SIZE"])
    if launched != world_size:
        raise ConfigError(
            f"tensor_parallel_size = {world_size}, but torchrun started {launched} ranks "
            f"(WORLD_SIZE={launched}); start torchrun with --nproc-per-node (times nodes) = "
            f"{world_size}, or set tensor_parallel_size = {launched}"
        )
    rank, local_rank = int(env["RANK"]), int(env["LOCAL_RANK"])
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(
        env["MASTER_ADDR"],
        int(env["MASTER_PORT"]),
        world_size,
        is_master=rank == 0 and not agent,
        timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S),
        wait_for_workers=False,
    )
    # Each engine of the process joins under its own prefix: torchrun's store outlives it.
    global _torchrun_engines
    _torchrun_engines += 1
    prefixed = dist.PrefixStore(f"polyspec/{_torchrun_engines}", store)
    return _join(rank, world_size, local_rank, prefixed, dist_backend, timeout_s)


_torchrun_engines = 0
"""Engines this process has joined under torchrun (the same count on every rank)."""


def leave() -> None:
    """Tear the process groups down (this rank is done)."""
    if dist.is_initialized():
        dist.destroy_process_group()
