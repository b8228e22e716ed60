"""NPU graph runner: ``torch.npu.NPUGraph`` capture and replay.

A captured forward's attention takes only shape-determined host arguments (its metadata is
built by :meth:`~polyspec.backends.npu.attention.NPUAttention.build_static_metadata`: BSND, an
explicit device mask over the bucket's key range), so a replay needs no task update and no
``prepare``: everything that changes between replays lives in device buffers that the graph
reads (the static inputs, the request table, the KV pool).

Rules shared with every graph runner: inputs only through the static buffers given at capture
(copied into on replay, the rest zeroed), only captured keys replay, at most ``max_shapes``
keys (each graph holds device memory).
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
)

from .runtime import import_torch_npu


@dataclasses.dataclass
class _Captured:
    graph: Any  # torch.npu.NPUGraph
    inputs: Mapping[str, torch.Tensor]
    outputs: Any


class NPUGraphRunner(GraphRunner):
    """Captures with ``torch.npu.graph``; replays with the new static inputs."""

    def __init__(self, max_shapes: int) -> None:
        """Graphs share one memory pool; at most ``max_shapes`` keys."""
        self.max_shapes = max_shapes
        self._graphs: dict[Any, _Captured] = {}
        self._pool: Any = None

    def capture(
        self,
        key: Any,
        fn: Callable[[Mapping[str, torch.Tensor]], Any],
        static_inputs: Mapping[str, torch.Tensor],
    ) -> Any:
        """Warm ``fn`` up once eagerly on a side stream, then capture it under ``key``."""
        import_torch_npu()
        npu = torch.npu
        if key in self._graphs:
            raise ValueError(f"npu graph runner: key {key!r} is already captured; use a new key")
        if len(self._graphs) >= self.max_shapes:
            raise RuntimeError(
                f"npu graph runner: cannot capture {key!r}: {self.max_shapes} graph shapes are "
                f"already captured (capabilities.max_graph_shapes); capture fewer batch sizes"
            )
        inputs = checked_static_inputs(static_inputs)
        side = npu.Stream()
        side.wait_stream(npu.current_stream())
        with npu.stream(side):
            fn(inputs)  # warm-up: lazy initialisation happens outside the capture
        npu.current_stream().wait_stream(side)
        graph = npu.NPUGraph()
        with npu.graph(graph, pool=self._pool):
            outputs = fn(inputs)
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[key] = _Captured(graph, inputs, outputs)
        return outputs

    def can_run(self, key: Any) -> bool:
        """True when ``key`` was captured."""
        return key in self._graphs

    def replay(self, key: Any, new_inputs: Mapping[str, torch.Tensor]) -> Any:
        """Copy ``new_inputs`` into the static buffers (zeroing the rest), replay, return the
        static outputs."""
        graph = self._get(key)
        check_inputs(key, new_inputs, graph.inputs)
        copy_inputs(new_inputs, graph.inputs)
        graph.graph.replay()
        return graph.outputs

    def _get(self, key: Any) -> _Captured:
        try:
            return self._graphs[key]
        except KeyError:
            raise never_captured("npu graph runner", key, list(self._graphs)) from None
