"""Graph runners' shared rules, and an eager runner that keeps them without capturing.

The rules every runner enforces (cpu, cuda, npu and the Ascend-shaped test backend call the
functions below): static inputs map names to tensors (:func:`checked_static_inputs`); a replay
names only captured buffers, each new input fitting its buffer (:func:`check_inputs`); new
values are copied into the buffers, the part past a shorter input zeroed so that index buffers
point at the padding slot 0 (:func:`copy_inputs`); only captured keys replay
(:func:`never_captured`).

:class:`EagerGraphRunner` (the cpu backend's, and the base of the Ascend-shaped one):

``capture`` runs ``fn`` once on the static buffers and records ``fn``, the buffers and the
outputs. ``replay`` validates and copies the new inputs into those same buffer objects, reruns
``fn`` on them and copies the fresh results into the output tensors recorded at capture, so a
caller holding them sees new values exactly as with a CUDA graph.

What eager replay cannot check: a ``fn`` that closes over tensors other than its static
buffers reads their *current* values here, whereas a captured graph reads whatever lives at
their captured addresses. Both only agree while such tensors are updated in place; code that
rebinds them works eagerly but breaks under a real graph runner. Pass every per-step input
through ``static_inputs``.

What it imitates on purpose: graphs that share one memory pool (as the cuda runner's do) may
reuse, for a later capture's outputs, memory that an earlier capture used for intermediates,
so replaying a graph can overwrite the outputs of every graph captured after it. ``replay``
therefore poisons those outputs (NaN, or an out-of-range index), so that engine code which
holds a graph's outputs across another replay fails here instead of on the device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from polyspec.backend import GraphRunner


@dataclasses.dataclass
class _Captured:
    fn: Callable[[Mapping[str, torch.Tensor]], Any]
    inputs: Mapping[str, torch.Tensor]  # read-only view of the static buffers
    outputs: Any


def checked_static_inputs(
    static_inputs: Mapping[str, torch.Tensor],
) -> Mapping[str, torch.Tensor]:
    """A read-only copy of ``static_inputs``; ``ValueError`` unless it maps str -> tensor."""
    for name, buf in static_inputs.items():
        if not isinstance(name, str) or not isinstance(buf, torch.Tensor):
            raise ValueError(
                f"graph runner: static_inputs must map str -> torch.Tensor, got "
                f"{type(name).__name__} -> {type(buf).__name__} for {name!r}"
            )
    return types.MappingProxyType(dict(static_inputs))


def check_inputs(
    key: Any, new_inputs: Mapping[str, Any], static: Mapping[str, torch.Tensor]
) -> None:
    """Raise ``ValueError`` unless every new input fits the captured buffer of its name
    (checked before anything is copied)."""
    for name, new in new_inputs.items():
        check_fits(key, name, new, static)


def copy_inputs(
    new_inputs: Mapping[str, torch.Tensor],
    static: Mapping[str, torch.Tensor],
    non_blocking: bool = False,
) -> None:
    """Copy each new input into its static buffer and zero the rows past it (index buffers
    then point at the padding slot 0). Inputs not named keep their previous contents."""
    for name, new in new_inputs.items():
        buf = static[name]
        if buf.dim() == 0:
            buf.copy_(new, non_blocking=non_blocking)
            continue
        n = new.shape[0]
        buf[:n].copy_(new, non_blocking=non_blocking)
        if n < buf.shape[0]:
            buf[n:].zero_()


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    """The garbage collector off for a device graph's capture: a collection started by the
    capture's Python work can free another engine's graph, whose destructor (a device call)
    is illegal while the stream captures, and the capture fails."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def never_captured(runner: str, key: Any, captured: list[Any]) -> KeyError:
    """The error for a replay or prepare of a key that was never captured."""
    return KeyError(
        f"{runner}: key {key!r} was never captured (captured keys: {captured[:8]}); "
        f"call capture() for it first or check can_run()"
    )


class EagerGraphRunner(GraphRunner):
    """A :class:`GraphRunner` that reruns the recorded function eagerly on replay."""

    def __init__(self) -> None:
        """An empty runner (no keys captured)."""
        self._graphs: dict[Any, _Captured] = {}

    def capture(
        self,
        key: Any,
        fn: Callable[[Mapping[str, torch.Tensor]], Any],
        static_inputs: Mapping[str, torch.Tensor],
    ) -> Any:
        """Run ``fn(static_inputs)`` once and record it under ``key``; returns its outputs
        (tensors, or tuples / lists / dicts of them), which replays update in place."""
        if key in self._graphs:
            raise ValueError(f"graph runner: key {key!r} is already captured; use a new key")
        inputs = checked_static_inputs(static_inputs)
        outputs = fn(inputs)
        self._graphs[key] = _Captured(fn, inputs, outputs)
        return outputs

    def can_run(self, key: Any) -> bool:
        """True when ``key`` was captured."""
        return key in self._graphs

    def prepare(self, key: Any, host_params: Mapping[str, Any]) -> None:
        """Nothing to update for eager replay; only checks that ``key`` was captured."""
        self._get(key)

    def replay(self, key: Any, new_inputs: Mapping[str, torch.Tensor]) -> Any:
        """Copy ``new_inputs`` into the static buffers (the part past a shorter input is
        zeroed: index buffers then point at the padding slot 0), rerun, return the static
        outputs refreshed in place. Inputs not named keep their previous buffer contents."""
        graph = self._get(key)
        check_inputs(key, new_inputs, graph.inputs)
        copy_inputs(new_inputs, graph.inputs)
        later = list(self._graphs)
        for other in later[later.index(key) + 1 :]:
            _poison(self._graphs[other].outputs)
        fresh = graph.fn(graph.inputs)
        _copy_outputs(key, graph.outputs, fresh)
        return graph.outputs

    def _get(self, key: Any) -> _Captured:
        try:
            return self._graphs[key]
        except KeyError:
            raise never_captured("graph runner", key, list(self._graphs)) from None


def check_fits(key: Any, name: str, new: Any, static: Mapping[str, torch.Tensor]) -> None:
    """Raise ``ValueError`` unless ``new`` can be copied into the buffer ``name``."""
    if name not in static:
        raise ValueError(
            f"graph runner: replay of {key!r} got unknown input {name!r}; captured inputs are "
            f"{sorted(static)}"
        )
    buf = static[name]
    if not isinstance(new, torch.Tensor):
        raise ValueError(f"graph runner: input {name!r} must be a tensor, got {type(new).__name__}")
    if new.dtype != buf.dtype:
        raise ValueError(
            f"graph runner: input {name!r} has dtype {new.dtype} but its static buffer has "
            f"{buf.dtype}; cast it before replay"
        )
    if new.dim() != buf.dim():
        raise ValueError(
            f"graph runner: input {name!r} has rank {new.dim()} but its static buffer has rank "
            f"{buf.dim()} (shape {list(buf.shape)})"
        )
    if buf.dim() == 0:
        return
    if new.shape[0] > buf.shape[0] or new.shape[1:] != buf.shape[1:]:
        raise ValueError(
            f"graph runner: input {name!r} of shape {list(new.shape)} does not fit its static "
            f"buffer {list(buf.shape)}: the leading dim must be <= {buf.shape[0]} and the others "
            f"equal; capture a larger key for bigger inputs"
        )


def _poison(outputs: Any) -> None:
    """Overwrite recorded outputs with values no computation gives: NaN, or an index past any
    table (booleans are left alone)."""
    if isinstance(outputs, torch.Tensor):
        if outputs.is_floating_point():
            outputs.fill_(float("nan"))
        elif outputs.dtype != torch.bool:
            outputs.fill_(torch.iinfo(outputs.dtype).max)
    elif isinstance(outputs, (tuple, list)):
        for t in outputs:
            _poison(t)
    elif isinstance(outputs, Mapping):
        for t in outputs.values():
            _poison(t)


def _copy_outputs(key: Any, static: Any, fresh: Any) -> None:
    """Copy ``fresh`` into the same-structured ``static`` outputs recorded at capture."""
    if isinstance(static, torch.Tensor):
        if not isinstance(fresh, torch.Tensor) or fresh.shape != static.shape:
            raise RuntimeError(
                f"graph runner: replay of {key!r} produced an output of a different shape or "
                f"type than at capture; a captured computation must have fixed output shapes"
            )
        if fresh is not static:
            static.copy_(fresh)
    elif isinstance(static, (tuple, list)):
        if not isinstance(fresh, (tuple, list)) or len(fresh) != len(static):
            raise RuntimeError(f"graph runner: replay of {key!r} changed the output structure")
        for s, f in zip(static, fresh):
            _copy_outputs(key, s, f)
    elif isinstance(static, Mapping):
        if not isinstance(fresh, Mapping) or set(fresh) != set(static):
            raise RuntimeError(f"graph runner: replay of {key!r} changed the output keys")
        for name in static:
            _copy_outputs(key, static[name], fresh[name])
    # Non-tensor leaves (None, ints) are constants of the captured computation.
