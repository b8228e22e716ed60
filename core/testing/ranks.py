"""Running a function on every rank of a real ``torch.distributed`` group, for the
conformance suite's distributed part (``--polyspec-world-size N``).

The test process hosts the rendezvous store and spawns ``N`` processes (``spawn`` start
method), rank ``i`` in process ``i``; each joins the group with the backend's declared
``distributed_backend``, binds its local rank and calls ``fn(tp, backend, *args)``. A rank that
raises fails the test with its traceback; ranks that outlive ``timeout_s`` are killed and the
test fails naming them.
"""

from __future__ import annotations

import datetime
import importlib
import time
from typing import Any

RANK_TIMEOUT_S = 240.0
"""The most one distributed conformance test may take (two ranks on two CPU cores load and
run tiny models in a few seconds; this bounds a hang, not a run)."""


def _entry(
    index: int,
    port: int,
    world_size: int,
    backend_name: str,
    timeout_s: float,
    fn_path: str,
    args: tuple[Any, ...],
) -> None:
    from polyspec.engine import ranks
    from polyspec.parallel.launch import join_spawned, leave
    from polyspec.plugins import create_backend

    backend = create_backend(backend_name)
    backend.bind_local_rank(index)
    backend.share_host(world_size)
    tp = join_spawned(index, world_size, port, backend.capabilities.distributed_backend, timeout_s)
    ranks._joined = tp  # an engine built in this process joins as this rank
    module, _, name = fn_path.partition(":")
    try:
        getattr(importlib.import_module(module), name)(tp, backend, *args)
    finally:
        leave()


def run_ranks(
    fn_path: str,
    world_size: int,
    backend_name: str,
    args: tuple[Any, ...] = (),
    timeout_s: float = RANK_TIMEOUT_S,
    collective_timeout_s: float = 60.0,
) -> None:
    """Run ``module:function`` on ``world_size`` ranks; raise if any rank raised or hung."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    store = dist.TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    context = mp.start_processes(
        _entry,
        args=(store.port, world_size, backend_name, collective_timeout_s, fn_path, args),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
            if time.monotonic() >= deadline:
                alive = [i for i, p in enumerate(context.processes) if p.is_alive()]
                raise TimeoutError(
                    f"{fn_path}: rank(s) {alive} still running after {timeout_s:.0f} s"
                )
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
                p.join(5.0)
    del store
