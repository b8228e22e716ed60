"""How a decode round runs: replayed from a graph captured per batch bucket, or eagerly at the
batch's exact size, and (overlap) queued on the device behind the round before it.

The executor is handed the round as a function and knows nothing of what it computes:

    fn(inputs, b, max_prefix, host) -> outputs

``inputs`` maps names to device tensors whose leading dimension is per request; ``b`` is the
number of rows the round computes (the batch, or the graph bucket it is padded to, whose
padding requests hold zeros); ``max_prefix`` is the graph's prefix bucket for a captured run
and None for an eager one (the forwards then build their attention metadata for the exact
batch); ``host`` is whatever host-side view of the batch the caller gave (lengths the eager
forwards hand to the backend), None in a captured run, which may read device tensors only.
The first output is the round's result for the host (one 1-D tensor: one device-to-host copy
a round); the others stay on the device (state the next round reads).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from polyspec.backend import Backend, HostRead
from polyspec.runtime.graphs import CapturedForwards

RoundFn = Callable[[Mapping[str, torch.Tensor], int, int | None, Any], tuple[torch.Tensor, ...]]


@dataclasses.dataclass
class Launched:
    """A round on the device queue whose result the host has not read yet."""

    key: tuple  # what the round was for (the caller's request ids), to match a queued round
    name: str  # the round function's name (its graphs' name)
    fn: RoundFn
    inputs: dict[str, torch.Tensor]  # [bs, ...] each
    outputs: tuple[torch.Tensor, ...]  # [b, ...] or the host vector; copies when ``read`` is set
    rows: int  # b: the rows the round computed (its graph bucket, or the batch when eager)
    captured: bool  # replayed from a graph
    read: HostRead | None  # ``outputs[0]`` on its way to the host (a round queued behind it)

    def result(self) -> torch.Tensor:
        """The host vector (waits for the device when it is still on its way)."""
        return self.read.wait() if self.read is not None else self.outputs[0]


class RoundExecutor:
    """Runs round functions under the backend's execution policy: captured and replayed when
    ``graphs`` is set and the batch fits a bucket, else eagerly with the exact batch."""

    def __init__(self, backend: Backend, graphs: CapturedForwards | None) -> None:
        self.backend = backend
        self.graphs = graphs

    def captures(self, bs: int, max_prefix: int) -> bool:
        """Whether a batch of ``bs`` requests with prefixes up to ``max_prefix`` replays."""
        return self.graphs is not None and self.graphs.fits(bs, max_prefix)

    def launch(
        self,
        key: tuple,
        name: str,
        fn: RoundFn,
        inputs: Mapping[str, torch.Tensor],
        max_prefix: int,
        host: Any,
        copy: bool = False,
        eager: bool = False,
    ) -> Launched:
        """Run ``fn`` over ``inputs`` (``bs`` rows each): replayed when the batch fits a graph
        bucket, else eagerly with ``host``. ``copy``: another round may be queued behind
        this one before its result is read, so a replay's outputs are copied out of the
        graph's buffers (the next replay overwrites them) and the host vector starts towards
        the host now. ``eager``: run it eagerly whatever the batch (a round that works with
        the host in the middle, as a constrained round does)."""
        bs = next(iter(inputs.values())).shape[0]
        launched = None
        if not eager:
            launched = self._replay(key, name, fn, inputs, max_prefix, copy, _host_params(host))
        if launched is not None:
            return launched
        # No bucket, or the backend's graph budget is spent: the exact batch, eagerly. Its
        # outputs are its own (no graph buffer to copy them from), and no round is queued
        # behind it (that one would need its lengths on the host).
        return self._launched(key, name, fn, inputs, fn(inputs, bs, None, host), bs, False, False)

    def queue_next(
        self,
        launched: Launched,
        inputs: Mapping[str, torch.Tensor],
        max_prefix: int,
        key: tuple | None = None,
    ) -> Launched | None:
        """Queue the round after ``launched`` with ``inputs`` computed on the device from its
        outputs, before the host has read them (``EngineConfig.overlap_rounds``), for ``key``
        (None: ``launched``'s; the caller's requests, fewer when some have left). Only a
        replayed round is queued (an eager one needs its lengths on the host): None when
        this batch does not replay, or when the backend's graphs need the replay's host
        lengths (``graph_needs_prepare``), which the host learns only from ``launched``."""
        if not launched.captured or self.graphs.needs_prepare:
            return None
        key = launched.key if key is None else key
        return self._replay(key, launched.name, launched.fn, inputs, max_prefix, True, None)

    def queue(
        self, key: tuple, name: str, fn: RoundFn, inputs: Mapping[str, torch.Tensor],
        max_prefix: int,
    ) -> Launched | None:  # fmt: skip
        """Replay ``fn`` over ``inputs`` computed on the device, before the host knows their
        lengths (part of a round queued behind the one before, as :meth:`queue_next` queues
        a whole one) -> None where it cannot replay: no bucket holds the batch, the backend's
        graph budget is spent, or its graphs need the replay's host lengths. Never eager."""
        if self.graphs is None or self.graphs.needs_prepare:
            return None
        return self._replay(key, name, fn, inputs, max_prefix, False, None)

    def _replay(
        self, key, name, fn, inputs, max_prefix: int, copy: bool, host_params
    ) -> Launched | None:
        bs = next(iter(inputs.values())).shape[0]
        if not self.captures(bs, max_prefix):
            return None
        out = self.graphs.run(name, bs, max_prefix, inputs, _captured(fn), host_params)
        if out is None:  # the backend's graph budget is spent
            return None
        b = self.graphs.buckets.batch_bucket(bs)
        return self._launched(key, name, fn, inputs, out, b, True, copy)

    def _launched(self, key, name, fn, inputs, out, rows: int, captured: bool, copy: bool):
        out, read = tuple(out), None
        if copy:
            out = tuple(t.clone() for t in out)
            read = self.backend.read_async(out[0])
        return Launched(tuple(key), name, fn, dict(inputs), out, rows, captured, read)


def _captured(fn: RoundFn) -> Callable[[Mapping[str, torch.Tensor], int, int], Any]:
    """``fn`` as a captured computation: device tensors only, no host view."""

    def computation(inputs: Mapping[str, torch.Tensor], b: int, max_prefix: int) -> Any:
        return fn(inputs, b, max_prefix, None)

    computation.__name__ = getattr(fn, "__name__", "round")
    return computation


def _host_params(host: Any) -> dict[str, list[int]] | None:
    """The ``GraphRunner.prepare`` lists of a round's host view: its committed lengths."""
    seq_lens = getattr(host, "seq_lens", None)
    return None if seq_lens is None else {"seq_lens": list(seq_lens)}
