"""CUDA graph runner: ``torch.cuda.CUDAGraph`` capture and replay, one memory pool for all graphs.

``capture`` warms ``fn`` up on a side stream (so lazy initialisation, Triton compilation and the
caching allocator's first allocations happen outside the graph), records it into a graph that
allocates from the runner's private pool (shared by every key: graphs replay one at a time, so
their intermediates may alias), then replays it once so the returned static outputs already hold
the values for the current static inputs, as with the eager runner. ``replay`` applies the same
input rules as every runner (:mod:`polyspec.backends.common.graph`: unknown names, dtype, rank,
trailing dims and leading dims larger than captured are refused before anything is copied).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from polyspec.backend import GraphRunner
from polyspec.backends.common.graph import (
    check_inputs,
    checked_static_inputs,
    copy_inputs,
    never_captured,
    no_collection,
)


@dataclasses.dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: Mapping[str, torch.Tensor]  # read-only view of the static buffers
    outputs: Any


class CUDAGraphRunner(GraphRunner):
    """A :class:`GraphRunner` backed by CUDA graphs."""

    def __init__(self, device: torch.device, warmup_iters: int = 2) -> None:
        """Graphs for ``device``; ``fn`` runs ``warmup_iters`` times on a side stream before
        each capture."""
        if warmup_iters < 1:
            raise ValueError(f"graph runner: warmup_iters must be >= 1, got {warmup_iters}")
        self.device = torch.device(device)
        self.warmup_iters = warmup_iters
        self._pool: Any = None  # torch.cuda.graph_pool_handle(), made at the first capture
        self._graphs: dict[Any, _Graph] = {}

    def capture(
        self,
        key: Any,
        fn: Callable[[Mapping[str, torch.Tensor]], Any],
        static_inputs: Mapping[str, torch.Tensor],
    ) -> Any:
        """Warm up, record ``fn(static_inputs)`` under ``key`` and replay it once; returns the
        static outputs (tensors, or tuples / lists / dicts of them) that replays refresh."""
        if key in self._graphs:
            raise ValueError(f"graph runner: key {key!r} is already captured; use a new key")
        inputs = checked_static_inputs(static_inputs)
        for name, buf in inputs.items():
            if buf.device.type != "cuda":
                raise ValueError(
                    f"graph runner: static input {name!r} lives on {buf.device}; CUDA graphs "
                    f"read their inputs from device memory, allocate it on {self.device}"
                )
        with torch.cuda.device(self.device):
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(self.warmup_iters):
                    fn(inputs)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with no_collection(), torch.cuda.graph(graph, pool=self._pool):
                outputs = fn(inputs)
            graph.replay()
        self._graphs[key] = _Graph(graph, inputs, outputs)
        return outputs

    def can_run(self, key: Any) -> bool:
        """True when ``key`` was captured."""
        return key in self._graphs

    def prepare(self, key: Any, host_params: Mapping[str, Any]) -> None:
        """CUDA graphs need no host-side parameters; only checks that ``key`` was captured."""
        self._get(key)

    def replay(self, key: Any, new_inputs: Mapping[str, torch.Tensor]) -> Any:
        """Copy ``new_inputs`` into the static buffers (the part past a shorter input is
        zeroed: index buffers then point at the padding slot 0), replay, return the static
        outputs. Inputs not named keep their previous buffer contents."""
        graph = self._get(key)
        check_inputs(key, new_inputs, graph.inputs)
        copy_inputs(new_inputs, graph.inputs, non_blocking=True)
        graph.graph.replay()
        return graph.outputs

    def reset(self) -> None:
        """Drop every captured graph and the memory pool."""
        self._graphs.clear()
        self._pool = None

    def _get(self, key: Any) -> _Graph:
        try:
            return self._graphs[key]
        except KeyError:
            raise never_captured("graph runner", key, list(self._graphs)) from None
