"""NPU graph runner: ``torch.npu.NPUGraph`` capture, task updates in ``prepare``, replay.

Ascend graphs bake an operator's host arguments into the captured task. The fused attention
takes its sequence lengths as host lists, so under capture each of its calls is an updatable
task (:class:`AttentionTask`, recorded by
:meth:`~polyspec.backends.npu.attention.NPUAttention.forward` while :func:`capturing`): a task
group behind an ``ExternalEvent``. :meth:`NPUGraphRunner.prepare` re-issues every task of the
graph with the lengths of the engine's host parameters (``graph_task_update_begin`` /
``graph_task_update_end`` on an update stream) and records its event; a replay without a
``prepare`` since the previous one raises here (on hardware it would wait on the events
forever). Everything else that changes between replays lives in device buffers the graph
reads (the static inputs, the request table and the block tables gathered from it inside the
graph, the KV pool).

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
    no_collection,
)

from .runtime import import_torch_npu


@dataclasses.dataclass
class AttentionTask:
    """One captured attention call: its task-group handle, the ``ExternalEvent`` the replay
    waits on, and ``reissue(host_params)``, which calls the operator's ``.out`` again with the
    captured tensors and the lengths for ``host_params`` (inside an update)."""

    handle: Any
    event: Any
    reissue: Callable[[Mapping[str, Any]], None]


_recording: list[list[AttentionTask]] = []  # the task list of the capture in progress


def capturing() -> bool:
    """Whether an :class:`NPUGraphRunner` capture is recording (attention calls are tasks)."""
    return bool(_recording)


def record(task: AttentionTask) -> None:
    """Add ``task`` to the capture in progress."""
    _recording[-1].append(task)


@dataclasses.dataclass
class _Captured:
    graph: Any  # torch.npu.NPUGraph
    inputs: Mapping[str, torch.Tensor]
    outputs: Any
    tasks: list[AttentionTask]
    prepared: bool = False


class NPUGraphRunner(GraphRunner):
    """Captures with ``torch.npu.graph``; replays with the new static inputs."""

    def __init__(self, max_shapes: int) -> None:
        """Graphs share one memory pool; at most ``max_shapes`` keys."""
        self.max_shapes = max_shapes
        self._graphs: dict[Any, _Captured] = {}
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
            fn(inputs)  # warm-up: lazy initialisation happens outside the capture
        npu.current_stream().wait_stream(side)
        graph = npu.NPUGraph()
        tasks: list[AttentionTask] = []
        _recording.append(tasks)
        try:
            with no_collection(), npu.graph(graph, pool=self._pool):
                outputs = fn(inputs)
        finally:
            _recording.pop()
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[key] = _Captured(graph, inputs, outputs, tasks)
        return outputs

    def prepare(self, key: Any, host_params: Mapping[str, Any]) -> None:
        """Re-issue every attention task of ``key`` with the lengths of ``host_params`` (the
        engine's ``{"batch_size", "max_prefix_len", ...}`` and per-request host lists), then
        record each task's event so that the next replay runs."""
        graph = self._get(key)
        if not isinstance(host_params, Mapping):
            raise TypeError(f"npu graph runner: prepare({key!r}) needs a mapping")
        npu = torch.npu
        if self._update_stream is None:
            self._update_stream = npu.Stream()
        stream = self._update_stream
        with npu.stream(stream):
            for task in graph.tasks:
                npu.graph_task_update_begin(stream, task.handle)
                task.reissue(host_params)
                npu.graph_task_update_end(stream)
                task.event.record(stream)
        graph.prepared = True

    def can_run(self, key: Any) -> bool:
        """True when ``key`` was captured."""
        return key in self._graphs

    def replay(self, key: Any, new_inputs: Mapping[str, torch.Tensor]) -> Any:
        """Copy ``new_inputs`` into the static buffers (zeroing the rest), replay, return the
        static outputs."""
        graph = self._get(key)
        check_inputs(key, new_inputs, graph.inputs)
        if graph.tasks and not graph.prepared:
            raise RuntimeError(
                f"npu graph runner: replay of {key!r} without prepare(): its {len(graph.tasks)} "
                f"attention tasks need this replay's host lengths (capabilities."
                f"graph_needs_prepare)"
            )
        copy_inputs(new_inputs, graph.inputs)
        graph.graph.replay()
        graph.prepared = False
        return graph.outputs

    def _get(self, key: Any) -> _Captured:
        try:
            return self._graphs[key]
        except KeyError:
            raise never_captured("npu graph runner", key, list(self._graphs)) from None
