"""The ranks of one tensor-parallel engine, as each rank sees them.

Two process groups over the same ranks:

- ``group``: the models' collectives (an all-reduce after each row-parallel layer and the
  embedding, an all-gather of the logits). Its timeout is bounded
  (``EngineConfig.distributed_timeout_s``): a rank stuck or gone makes the others' next
  collective fail within that time.
- ``control``: gloo, always, for rank 0's commands (one pickled call per worker method) and
  each call's agreement. Its timeout is unbounded on purpose: a follower waits there for the
  next request for as long as the server stays idle. A rank that dies closes its sockets,
  which fails the others' pending operations at once, timeout or not.

A rank that fails writes its error into the rendezvous store before it exits, under
``polyspec/failed/<rank>``, so that rank 0 can name it and its cause.

A rank whose call raised closes its part of the model group (:meth:`TPGroup.close_model_group`)
before it tells the others: a peer still waiting for it inside a forward's collective would
otherwise wait out the collective timeout. Where the model group is gloo, closing it closes
this rank's sockets, which fails that peer's collective at once.
"""

from __future__ import annotations

import datetime
import gc
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

STATUS_OK = 1
"""The call returned on this rank."""
STATUS_RAISED = 0
"""The call raised an ordinary exception on this rank (the same request error on every rank
is an ordinary failure of those requests)."""
STATUS_BROKEN = -1
"""A collective failed on this rank (a peer died, or a timeout): the engine cannot go on."""

_FAILED_KEY = "polyspec/failed/{}"

FOREVER = datetime.timedelta(days=365)
"""The control group's timeout: followers wait there for the next command while rank 0 idles."""


class TPGroup:
    """Rank ``rank`` of ``world_size``: collectives over the model group, the command channel
    over the control group, and the failure reports in the rendezvous store."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        local_rank: int,
        group: Any,
        control: Any,
        store: Any,
        dead_ranks: Callable[[], dict[int, str]] | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """``group`` / ``control``: ``torch.distributed`` process groups over all ranks;
        ``store``: the rendezvous store; ``dead_ranks``: for rank 0 when it spawned the
        others, ``{rank: how it ended}`` of those that have exited; ``timeout_s``: the model
        group's collective timeout (to open it again after :meth:`close_model_group`)."""
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.group = group
        self.control = control
        self.store = store
        self._dead_ranks = dead_ranks
        self._timeout_s = timeout_s
        self._closed = False

    @property
    def is_leader(self) -> bool:
        """Rank 0: owns the tokenizer, the scheduler and the HTTP side."""
        return self.rank == 0

    # -- model collectives ---------------------------------------------------------------------
    def _model_group(self) -> Any:
        if self._closed:  # group=None would mean the default group: never fall back on it
            raise RuntimeError(
                f"rank {self.rank}: the model group is closed after a failed call (gloo)"
            )
        return self.group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:  # [...] -> [...] summed over ranks
        """Sum ``x`` over the ranks, in place; returns it."""
        dist.all_reduce(x, group=self._model_group())
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:  # [n, c] -> [n, W * c]
        """Every rank's ``x`` side by side along the last dimension, in rank order (the
        vocabulary-parallel logits become the whole vocabulary's)."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self._model_group())
        return torch.cat(parts, dim=-1)

    def close_model_group(self) -> bool:
        """After a call failed on this rank: where the model group is gloo, destroy it, so
        that its sockets close and a peer waiting for this rank in a collective fails now
        rather than after the collective timeout. -> whether it was closed (other backends
        keep theirs: destroying a communicator with work in flight may block on the very
        peers that wait; their collective timeout bounds the wait).

        Exact, without a timing guess: a peer that completed every collective this rank did
        has already received this rank's data (gloo returns once its sends are written, and a
        closed socket delivers what was written before it), so only a peer waiting for a
        collective this rank never reached fails. A peer that raises alike (at the same point
        of the same call) fails alike, and :meth:`reopen_model_group` follows on every rank."""
        if self._closed or self.group is None or dist.get_backend(self.group) != "gloo":
            return False
        dist.destroy_process_group(self.group)
        self.group = None
        self._closed = True
        gc.collect()  # the process group closes its sockets when its last reference goes
        return True

    def reopen_model_group(self) -> None:
        """After a call that raised alike on every rank (each closed its model group): open a
        new one, on every rank in the same order (``new_group`` is collective)."""
        if not self._closed:
            return
        timeout = (
            FOREVER if self._timeout_s is None else datetime.timedelta(seconds=self._timeout_s)
        )
        self.group = dist.new_group(list(range(self.world_size)), timeout=timeout)
        self._closed = False

    # -- the command channel -------------------------------------------------------------------
    def send(self, obj: Any) -> None:
        """Rank 0: hand ``obj`` (picklable) to every other rank."""
        dist.broadcast_object_list([obj], src=0, group=self.control)

    def receive(self) -> Any:
        """A rank other than 0: wait (without limit) for rank 0's next :meth:`send`."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def agree(self, status: int, digest: int) -> list[tuple[int, int]]:
        """Every rank's (status, digest) of the call just made, in rank order: each rank
        learns whether all returned and decided the same."""
        mine = torch.tensor([status, digest], dtype=torch.int64)
        parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(parts, mine, group=self.control)
        return [(int(p[0]), int(p[1])) for p in parts]

    # -- failures ------------------------------------------------------------------------------
    def report_failure(self, text: str) -> None:
        """Record why this rank stops, for the others to name (best effort: the store may be
        gone with rank 0)."""
        try:
            self.store.set(_FAILED_KEY.format(self.rank), text)
        except Exception:  # rank 0 (the store's host) is gone too: nobody is left to tell
            pass

    def failures(self, ranks: Sequence[int] | None = None) -> dict[int, str]:
        """``{rank: cause}`` of the ranks (default: all others) known to have failed: their
        own reports, else, for ranks rank 0 spawned, how their process ended."""
        ranks = [r for r in range(self.world_size) if r != self.rank] if ranks is None else ranks
        out: dict[int, str] = {}
        for r in ranks:
            key = _FAILED_KEY.format(r)
            try:
                if self.store.check([key]):
                    out[r] = self.store.get(key).decode("utf-8", "replace")
            except Exception:  # the store's host is gone: fall back on the processes
                pass
        if self._dead_ranks is not None:
            for r, how in self._dead_ranks().items():
                if r in ranks:
                    out.setdefault(r, how)
        return out


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` came out of ``torch.distributed`` (a closed peer, a timeout) rather
    than out of the computation: the ranks can no longer be trusted to be in step."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "gloo" in text.lower()
        or "Connection closed by peer" in text
        or "timed out" in text.lower()
        or "NCCL" in text
        or "HCCL" in text
    )
