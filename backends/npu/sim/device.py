"""The simulated ``torch.npu`` namespace: streams, events, NPU graphs and graph task groups.

Graph semantics follow torch_npu's NPUGraph (``torch_npu/npu/graphs.py`` in torch_npu 2.10.0
.post4, a mirror of ``torch.cuda.CUDAGraph``) and its task-group update API, used by
vllm-ascend's ``compilation/acl_graph.py`` and exercised by torch_npu's ``test_ifa_update``:

* A capture records every operator issued between ``capture_begin`` and ``capture_end``, with
  its tensors by reference (device memory) and its host arguments by value. Replay re-runs the
  recorded operators on the same tensors: whatever host value a captured call saw (a Python
  list, a tensor built from host data) is baked in, as on hardware.
* ``graph_task_group_begin(stream)`` / ``graph_task_group_end(stream)`` bracket an updatable
  task; ``graph_task_update_begin(stream, handle)`` followed by the operator's ``.out`` call
  and ``graph_task_update_end(stream)`` replaces that task's parameters with exactly the ones
  passed: a parameter not passed again keeps its captured value, so a block table left out of
  an update is read from the tensor given at capture.
* ``ExternalEvent`` (``torch_npu/npu/streams.py``: "you can call wait() before record() ...
  call reset() to clear the flag"): a graph that captured ``event.wait`` blocks on replay until
  the event is recorded; the simulator raises instead of hanging, which is what makes a replay
  without its update an error.

Tensors live on the CPU: the simulated device type is ``cpu``
(``torch_npu.SIMULATED_DEVICE_TYPE``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .ops import NPUContractError


class SimStream:
    """A stream: work runs in program order on the CPU, so waits are no-ops."""

    def __init__(self, name: str = "stream") -> None:
        self.name = name

    def wait_stream(self, other: SimStream) -> None:
        """Order after ``other`` (already true on the CPU)."""

    def wait_event(self, event: Any) -> None:
        """Order after ``event``."""

    def synchronize(self) -> None:
        """Nothing queued."""


class ExternalEvent:
    """``torch.npu.ExternalEvent``: waitable before it is recorded; ``reset`` clears it."""

    def __init__(self, sim: SimulatedNPU) -> None:
        self._sim = sim
        self.recorded = False

    def record(self, stream: SimStream | None = None) -> None:
        """Set the flag (the update stream records it after an update)."""
        if self._sim.capturing is not None:
            self._sim.capturing.entries.append(_EventOp(self, "record"))
        self.recorded = True

    def wait(self, stream: SimStream | None = None) -> None:
        """Captured: the replay waits for the flag. Eager: wait for a recorded event."""
        if self._sim.capturing is not None:
            self._sim.capturing.entries.append(_EventOp(self, "wait"))
        elif not self.recorded:
            raise NPUContractError("ExternalEvent.wait outside a graph on an unrecorded event")

    def reset(self, stream: SimStream | None = None) -> None:
        """Clear the flag (captured: at this point of every replay)."""
        if self._sim.capturing is not None:
            self._sim.capturing.entries.append(_EventOp(self, "reset"))
        else:
            self.recorded = False


@dataclasses.dataclass
class _EventOp:
    event: ExternalEvent
    action: str  # "wait" | "reset" | "record"

    def replay(self) -> None:
        if self.action == "record":
            self.event.recorded = True
        elif self.action == "reset":
            self.event.recorded = False
        elif not self.event.recorded:
            raise NPUContractError(
                "NPUGraph.replay: the graph waits on an ExternalEvent nobody recorded since the "
                "previous replay (on hardware the replay hangs): update its task group with "
                "graph_task_update_begin/end and record the event on the update stream first"
            )


@dataclasses.dataclass
class _AtenOp:
    func: Any
    args: tuple
    kwargs: dict
    outputs: list[torch.Tensor]  # fresh outputs, refilled on replay
    run: bool  # False for views (they alias recorded memory already)

    def replay(self) -> None:
        if not self.run:
            return
        result = self.func(*self.args, **self.kwargs)
        if self.outputs:
            fresh, _ = tree_flatten(result)
            for dst, src in zip(self.outputs, (t for t in fresh if isinstance(t, torch.Tensor))):
                if dst is not None:
                    dst.copy_(src)


@dataclasses.dataclass
class Task:
    """One updatable operator call of a graph: ``fn(**params)`` runs it."""

    name: str
    fn: Callable[..., None]
    params: dict[str, Any]

    def replay(self) -> None:
        self.fn(**self.params)  # no recorder is active during a replay: its checks may read


@dataclasses.dataclass
class TaskGroup:
    """The handle ``graph_task_group_end`` returns: the tasks issued inside the group."""

    tasks: list[Task]
    graph: NPUGraph


HOST_SYNC_OPS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "unique",
                           "_unique2", "unique_consecutive", "item", "equal"})  # fmt: skip
"""aten operators a capture refuses: a host read of device data (``.item()``, ``bool()``,
``torch.equal``) or a result sized by device data (as on CUDA / NPU streams in capture)."""


class _Recorder(TorchDispatchMode):
    """Records the aten operators issued during a capture (after running them)."""

    def __init__(self, graph: NPUGraph) -> None:
        super().__init__()
        self.graph = graph
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused and func.name().split("::")[-1].split(".")[0] in HOST_SYNC_OPS:
            raise NPUContractError(
                f"{func.name()} during NPU graph capture: it reads device values on the host "
                f"(or sizes a result by them), which a captured graph cannot do"
            )
        result = func(*args, **kwargs)
        if self.paused:
            return result
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        in_storages = {_storage(t) for t in inputs}
        outs, _ = tree_flatten(result)
        fresh = [
            t if isinstance(t, torch.Tensor) and _storage(t) not in in_storages else None
            for t in outs
            if isinstance(t, torch.Tensor)
        ]
        # A view op's output aliases recorded memory already: nothing to redo. An op that may
        # alias (``aten.to``, ``reshape``) but copied this time is an ordinary computation.
        aliases = bool(getattr(func, "is_view", False)) and all(o is None for o in fresh)
        self.graph.entries.append(_AtenOp(func, args, kwargs, fresh, not aliases))
        return result


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return id(t)


class NPUGraph:
    """``torch.npu.NPUGraph``: capture_begin / capture_end / replay / pool."""

    def __init__(self, sim: SimulatedNPU) -> None:
        self._sim = sim
        self.entries: list[Any] = []
        self.captured = False
        self._mode: _Recorder | None = None
        self._pool = object()

    def capture_begin(self, pool: Any = None) -> None:
        """Start recording on the current stream."""
        if self._sim.capturing is not None:
            raise NPUContractError("NPUGraph.capture_begin: another capture is running")
        if self.captured:
            raise NPUContractError("NPUGraph.capture_begin: this graph is already captured")
        self._sim.capturing = self
        self._mode = _Recorder(self)
        self._mode.__enter__()

    def capture_end(self) -> None:
        """Stop recording."""
        if self._sim.group is not None:
            raise NPUContractError("capture_end inside graph_task_group_begin without its end")
        assert self._mode is not None
        self._mode.__exit__(None, None, None)
        self._mode = None
        self._sim.capturing = None
        self.captured = True

    def replay(self) -> None:
        """Re-run the recorded work with the tasks' current parameters."""
        if not self.captured:
            raise NPUContractError("NPUGraph.replay before a capture")
        self._sim.replays += 1
        with torch.inference_mode():
            for entry in self.entries:
                entry.replay()

    def pool(self) -> Any:
        """An opaque memory-pool handle to share with later captures."""
        return self._pool

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Run operators without recording them (a task records itself instead)."""
        assert self._mode is not None
        self._mode.paused += 1
        try:
            yield
        finally:
            self._mode.paused -= 1


class SimulatedNPU:
    """The ``torch.npu`` namespace of the simulator (one device, ``npu:0``)."""

    def __init__(self) -> None:
        self.capturing: NPUGraph | None = None
        self.group: TaskGroup | None = None
        self.updating: TaskGroup | None = None
        self.replays = 0
        self.task_updates = 0  # completed graph_task_update_begin / end pairs
        self.op_calls: collections.Counter = collections.Counter()  # (op, variant) -> calls
        self._default = SimStream("default")
        self._current = self._default

    # device
    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def set_device(self, device: Any) -> None:
        return None

    def current_device(self) -> int:
        return 0

    def synchronize(self, device: Any = None) -> None:
        if self.capturing is not None:
            raise NPUContractError("torch.npu.synchronize during graph capture")

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        """A 64 GiB device with 48 GiB free (Atlas A2's HBM size)."""
        return 48 << 30, 64 << 30

    # streams
    def Stream(self, *args: Any, **kwargs: Any) -> SimStream:  # noqa: N802 (torch's name)
        return SimStream()

    def current_stream(self, device: Any = None) -> SimStream:
        return self._current

    @contextlib.contextmanager
    def stream(self, stream: SimStream | None) -> Iterator[None]:
        previous = self._current
        self._current = stream or previous
        try:
            yield
        finally:
            self._current = previous

    def ExternalEvent(self) -> ExternalEvent:  # noqa: N802 (torch_npu's name)
        return ExternalEvent(self)

    # graphs
    def NPUGraph(self) -> NPUGraph:  # noqa: N802 (torch_npu's name)
        return NPUGraph(self)

    @contextlib.contextmanager
    def graph(self, npu_graph: NPUGraph, pool: Any = None, stream: Any = None) -> Iterator[None]:
        """``torch.npu.graph``: capture the block into ``npu_graph``."""
        npu_graph.capture_begin(pool)
        try:
            yield
        finally:
            npu_graph.capture_end()

    def is_current_stream_capturing(self) -> bool:
        return self.capturing is not None

    def graph_task_group_begin(self, stream: SimStream) -> None:
        if self.capturing is None:
            raise NPUContractError("graph_task_group_begin outside a graph capture")
        if self.group is not None:
            raise NPUContractError("graph_task_group_begin inside another task group")
        self.group = TaskGroup([], self.capturing)

    def graph_task_group_end(self, stream: SimStream) -> TaskGroup:
        if self.group is None:
            raise NPUContractError("graph_task_group_end without graph_task_group_begin")
        group, self.group = self.group, None
        if not group.tasks:
            raise NPUContractError("graph_task_group_end: the group recorded no task")
        return group

    def graph_task_update_begin(self, stream: SimStream, handle: TaskGroup) -> None:
        if self.capturing is not None:
            raise NPUContractError("graph_task_update_begin during a capture")
        if not isinstance(handle, TaskGroup):
            raise NPUContractError(f"graph_task_update_begin: {handle!r} is not a task handle")
        if self.updating is not None:
            raise NPUContractError("graph_task_update_begin inside another update")
        self.updating = handle
        self._update_index = 0

    def graph_task_update_end(self, stream: SimStream) -> None:
        if self.updating is None:
            raise NPUContractError("graph_task_update_end without graph_task_update_begin")
        if self._update_index != len(self.updating.tasks):
            raise NPUContractError(
                f"graph_task_update_end: {self._update_index} of the group's "
                f"{len(self.updating.tasks)} tasks were re-issued"
            )
        self.updating = None
        self.task_updates += 1

    # used by the simulated operators
    def issue(self, name: str, fn: Callable[..., None], params: dict[str, Any],
              same: tuple[str, ...]) -> bool:  # fmt: skip
        """Route an updatable operator call: True when it was consumed by an update (do not
        run it); under capture, run it unrecorded and record it as one task."""
        variant = (params.get("input_layout"), params.get("sparse_mode"))
        self.op_calls[(name, *variant)] += 1
        if self.updating is not None:
            group = self.updating
            if self._update_index >= len(group.tasks):
                raise NPUContractError(f"{name}: more calls than the task group holds")
            task = group.tasks[self._update_index]
            if task.name != name:
                raise NPUContractError(f"update re-issues {name}, the group holds {task.name}")
            for arg in same:  # the graph's other kernels read these addresses
                if not _same_tensors(params.get(arg), task.params.get(arg)):
                    raise NPUContractError(
                        f"{name} update: {arg} must be the tensor given at capture (graph memory)"
                    )
            task.params = dict(params)
            self._update_index += 1
            return True
        if self.capturing is None:
            fn(**params)
            return False
        graph = self.capturing
        with graph.paused():
            fn(**params)
        task = Task(name, fn, {k: _freeze(v) for k, v in params.items()})
        graph.entries.append(task)
        if self.group is not None:
            self.group.tasks.append(task)
        return False


def _freeze(value: Any) -> Any:
    """Host arguments are copied at capture (the graph holds their values)."""
    return list(value) if isinstance(value, list | tuple) and not _has_tensor(value) else value


def _has_tensor(value: Any) -> bool:
    return any(isinstance(x, torch.Tensor) for x in value)


def _same_tensors(a: Any, b: Any) -> bool:
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(x is y for x, y in zip(a, b))
    return a is b
