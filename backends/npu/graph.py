"""NPU graph runner: ``torch.npu.NPUGraph`` capture, host-parameter update, replay.

Ascend graphs (ACL graphs) bake host-side operator arguments into the captured tasks, and the
fused attention operator takes its sequence lengths on the host. So, as vllm-ascend does, every
attention call made during a capture is recorded inside a task group (see
:class:`~polyspec.backends.npu.attention.GraphTaskRecorder`), and before each replay
:meth:`NPUGraphRunner.prepare` re-issues those tasks on an update stream with the new lengths
(``graph_task_update_begin`` / ``graph_task_update_end``). A replay without a prepare since the
previous replay raises: it would run with stale lengths.

Rules shared with every graph runner: inputs only through the static buffers given at capture
(copied into on replay, the rest zeroed), only captured keys replay, at most
``max_shapes`` keys (each graph holds device streams and memory).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from polyspec.backend import ForwardMode, GraphRunner
from polyspec.backends.common.graph import (
    check_inputs,
    checked_static_inputs,
    copy_inputs,
    never_captured,
)

from .attention import GraphTask, GraphTaskRecorder, host_lengths, update_task
from .runtime import import_torch_npu


@dataclasses.dataclass
class _Captured:
    graph: Any  # torch.npu.NPUGraph
    inputs: Mapping[str, torch.Tensor]
    outputs: Any
    tasks: list[GraphTask]


class NPUGraphRunner(GraphRunner):
    """Captures with ``torch.npu.graph``; replays after a :meth:`prepare` (module docstring)."""

    def __init__(self, recorder: GraphTaskRecorder, max_shapes: int) -> None:
        """Graphs share one memory pool; attention tasks are recorded through ``recorder``."""
        self.recorder = recorder
        self.max_shapes = max_shapes
        self._graphs: dict[Any, _Captured] = {}
        self._prepared: set[Any] = set()
        self._pool: Any = None
        self._update_stream: Any = None

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
            fn(inputs)  # warm-up: lazy initialisation and workspace sizing happen outside capture
        npu.current_stream().wait_stream(side)
        graph = npu.NPUGraph()
        self.recorder.tasks = []
        try:
            with npu.graph(graph, pool=self._pool):
                outputs = fn(inputs)
            tasks = self.recorder.tasks
        finally:
            self.recorder.tasks = None
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[key] = _Captured(graph, inputs, outputs, tasks)
        return outputs

    def can_run(self, key: Any) -> bool:
        """True when ``key`` was captured."""
        return key in self._graphs

    def prepare(self, key: Any, host_params: Mapping[str, Any]) -> None:
        """Give the attention tasks of ``key`` the next replay's host lengths.

        ``host_params``: ``prefix_lens`` and ``extend_lens`` (lists of int, one per request of
        the captured batch, padding rows included), ``lane_lens`` for DRAFT_DECODE graphs;
        a graph without attention accepts any mapping."""
        graph = self._get(key)
        if graph.tasks:
            prefix = _int_list(host_params, "prefix_lens")
            extend = _int_list(host_params, "extend_lens")
            lanes = host_params.get("lane_lens")
            if self._update_stream is None:
                self._update_stream = torch.npu.Stream()
            for task in graph.tasks:
                lane = None if lanes is None else [int(x) for x in lanes]
                if task.mode is ForwardMode.DRAFT_DECODE and lane is None:
                    raise ValueError("npu graph runner: a DRAFT_DECODE graph needs lane_lens")
                update_task(
                    task,
                    self._update_stream,
                    host_lengths(task.mode, prefix, extend, lane, task.topk),
                )
        self._prepared.add(key)

    def replay(self, key: Any, new_inputs: Mapping[str, torch.Tensor]) -> Any:
        """Copy ``new_inputs`` into the static buffers (zeroing the rest), replay, return the
        static outputs. Raises ``RuntimeError`` without a :meth:`prepare` since the last replay."""
        graph = self._get(key)
        check_inputs(key, new_inputs, graph.inputs)
        if key not in self._prepared:
            raise RuntimeError(
                f"npu graph runner: replay of {key!r} without prepare(): Ascend graphs need "
                f"their host-side sequence lengths updated before every replay"
            )
        copy_inputs(new_inputs, graph.inputs)
        graph.graph.replay()
        self._prepared.discard(key)
        return graph.outputs

    def _get(self, key: Any) -> _Captured:
        try:
            return self._graphs[key]
        except KeyError:
            raise never_captured("npu graph runner", key, list(self._graphs)) from None


def _int_list(params: Mapping[str, Any], name: str) -> list[int]:
    value = params.get(name)
    if value is None or isinstance(value, torch.Tensor):
        raise ValueError(
            f"npu graph runner: prepare() needs host_params[{name!r}] as a list of int (host "
            f"values, not a tensor), got {type(value).__name__}"
        )
    return [int(x) for x in value]
