"""CUDA graph runner: ``torch.cuda.CUDAGraph`` capture and replay, one memory pool for all graphs.

``capture`` warms ``fn`` up on a side stream (so lazy initialisation, Triton compilation and the
caching allocator's first allocations happen outside the graph), records it into a graph that
allocates from the runner's private pool (shared by every key: graphs replay one at a time, so
their intermediates may alias), then replays it once so the returned static outputs already hold
the values for the current static inputs, as with the eager runner. ``replay`` applies the same
input rules as :class:`polyspec.backends.cpu.graph.EagerGraphRunner` (unknown names, dtype, rank,
trailing dims and leading dims larger than captured are refused before anything is copied).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

from polyspec.backend import GraphRunner
from polyspec.backends.cpu.graph import _check_fits


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
        for name, buf in static_inputs.items():
            if not isinstance(name, str) or not isinstance(buf, torch.Tensor):
                raise ValueError(
                    f"graph runner: static_inputs must map str -> torch.Tensor, got "
                    f"{type(name).__name__} -> {type(buf).__name__} for {name!r}"
                )
            if buf.device.type != "cuda":
                raise ValueError(
                    f"graph runner: static input {name!r} lives on {buf.device}; CUDA graphs "
                    f"read their inputs from device memory, allocate it on {self.device}"
                )
        inputs = types.MappingProxyType(dict(static_inputs))
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
            with torch.cuda.graph(graph, pool=self._pool):
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
        for name, new in new_inputs.items():
            _check_fits(key, name, new, graph.inputs)
        for name, new in new_inputs.items():
            buf = graph.inputs[name]
            if buf.dim() == 0:
                buf.copy_(new, non_blocking=True)
                continue
            n = new.shape[0]
            buf[:n].copy_(new, non_blocking=True)
            if n < buf.shape[0]:
                buf[n:].zero_()
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
            captured = list(self._graphs)[:8]
            raise KeyError(
                f"graph runner: key {key!r} was never captured (captured keys: {captured}); "
                f"call capture() for it first or check can_run()"
            ) from None
