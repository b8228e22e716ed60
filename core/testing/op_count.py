"""Counts the torch operations a speculative round dispatches outside its captured forwards.

A CPU-measurable proxy for a round's host overhead on an accelerator with graphs: there, each
operation the worker dispatches between graph replays costs a few microseconds of host time
(dispatch, launch), while everything inside a replay is one launch. The cpu backend's graph
runner reruns the captured functions eagerly, so :class:`RoundOpCounter` pauses counting inside
them (and while the eager runner copies fresh results into its static outputs, which a device
graph does not need); the copies of new inputs into the static buffers are counted, as they are
real device work outside the graph.

Per phase of :class:`polyspec.spec.base.PhaseTimer` (draft, verify, accept, draft_extend,
other), each round gets:

- ``ops``: every aten operation dispatched (views included: they cost host time too);
- ``kernels``: the ones that would launch device work (not views, allocations or scalar reads);
- ``uploads``: tensors built from host values (``torch.tensor``; ``Backend.host_tensor``);
- ``syncs``: host reads of tensor values (``tolist``, ``item``, ``bool``, ``int``, ``.cpu()``),
  each a device-to-host synchronisation when the tensor lives on an asynchronous device (a
  ``.to("cpu")`` is not seen: on the cpu backend it cannot be told from a no-op);
- ``replays``: graph replays.

Used by ``ci/count_round_ops.py`` and tests; it only observes, and restores what it patched.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Iterator
from typing import Any

from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# Aten ops that neither launch device work nor read device memory on the host.
_NO_KERNEL = {
    "aten::empty",
    "aten::empty_strided",
    "aten::empty_like",
    "aten::lift_fresh",
    "aten::detach_",
    "aten::detach",
    "aten::alias",
    "aten::resolve_conj",
    "aten::resolve_neg",
    "aten::item",
    "aten::_local_scalar_dense",
    "aten::is_nonzero",
}
# Tensor methods (as TorchFunctionMode names them) that read values back on the host.
_HOST_READS = {"tolist", "item", "__bool__", "__int__", "__index__", "__float__", "numpy", "cpu"}


FIELDS = ("ops", "kernels", "uploads", "syncs", "replays")


@dataclasses.dataclass
class PhaseCounts:
    ops: int = 0
    kernels: int = 0
    uploads: int = 0
    syncs: int = 0
    replays: int = 0

    def add(self, other: PhaseCounts) -> None:
        for f in FIELDS:
            setattr(self, f, getattr(self, f) + getattr(other, f))


class _Modes:
    """The two torch modes, feeding one counter; nothing is counted while ``paused``."""

    def __init__(self, counter: RoundOpCounter) -> None:
        self.counter = counter

    def dispatch(self) -> TorchDispatchMode:
        counter = self.counter

        class Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if not counter.paused:
                    counter._on_aten(func)
                return func(*args, **(kwargs or {}))

        return Dispatch()

    def function(self) -> TorchFunctionMode:
        counter = self.counter

        class Function(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if not counter.paused:
                    counter._on_function(func, args, kwargs or {})
                return func(*args, **(kwargs or {}))

        return Function()


class RoundOpCounter:
    """Counts operations per decode round and phase of an engine's EAGLE worker.

    >>> counter = RoundOpCounter(llm)
    >>> with counter:
    ...     llm.generate(prompt_token_ids=prompts, sampling_params=params)
    >>> counter.rounds  # one {phase: PhaseCounts} per decode() call, with its batch size

    Only ``decode`` calls are counted (prefill and the scheduler are not). Graph capture is
    counted as replay work, so warm the engine up (capture its buckets) before counting."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.worker = llm.worker
        self.paused = 0
        self.active = False  # inside a decode() call
        self.rounds: list[tuple[int, dict[str, PhaseCounts]]] = []
        self._phase = PhaseCounts()  # counts since the last phase boundary
        self._current: dict[str, PhaseCounts] = {}
        self._restore: list[tuple[Any, str, Any]] = []
        self._stack: contextlib.ExitStack | None = None
        # (phase, aten op) -> how many times, over every counted round (for finding sources)
        self.op_names: Counter = Counter()
        self._names: Counter = Counter()  # since the last phase boundary

    # -- counting -----------------------------------------------------------------------------
    def _on_aten(self, func: Any) -> None:
        if not self.active:
            return
        self._phase.ops += 1
        name = func._schema.name
        self._names[name] += 1
        if not func.is_view and name not in _NO_KERNEL:
            self._phase.kernels += 1
        if name == "aten::lift_fresh":
            self._phase.uploads += 1

    def _on_function(self, func: Any, args: tuple, kwargs: dict) -> None:
        if not self.active:
            return
        name = getattr(func, "__name__", "")
        if name in _HOST_READS:
            self._phase.syncs += 1

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    def _lap(self, phase: str) -> None:
        self._current.setdefault(phase, PhaseCounts()).add(self._phase)
        self._phase = PhaseCounts()
        for name, n in self._names.items():
            self.op_names[phase, name] += n
        self._names.clear()

    # -- patching -----------------------------------------------------------------------------
    def _patch(self, obj: Any, name: str, new: Any) -> None:
        had = name in vars(obj)
        self._restore.append((obj, name, vars(obj)[name] if had else _MISSING))
        setattr(obj, name, new)

    def __enter__(self) -> RoundOpCounter:
        w = self.worker
        decode = w.decode
        counter = self
        modes = _Modes(self)

        def counted_decode(rids, **kw):
            counter.active, counter._current = True, {}
            counter._phase = PhaseCounts()
            try:
                # torch modes are per thread: enter them on the thread that runs the round
                # (the engine loop's), not the one that entered the counter
                with modes.function(), modes.dispatch():
                    return decode(rids, **kw)
            finally:
                counter._lap("other")  # whatever follows the last lap
                counter.active = False
                counter.rounds.append((len(rids), counter._current))

        class Laps:  # PhaseTimer's interface: phases end at lap()
            enabled = False

            def start(self) -> None:
                counter._lap("other")

            def lap(self, phase: str) -> None:
                counter._lap(phase)

        self._patch(w, "decode", counted_decode)
        self._patch(w, "timer", Laps())
        self._patch_graphs()
        self._stack = contextlib.ExitStack()
        return self

    def _patch_graphs(self) -> None:
        graphs = self.worker.graphs
        if graphs is None:
            return
        runner, counter = graphs.runner, self
        replay = runner.replay

        def counted_replay(key, new_inputs):
            if counter.active:
                counter._phase.replays += 1
            return replay(key, new_inputs)

        self._patch(runner, "replay", counted_replay)
        # A captured graph's work is one launch: pause inside the recorded functions. The
        # eager runner keeps ``fn`` in its records; a device runner never calls it again.
        for rec in getattr(runner, "_graphs", {}).values():
            if hasattr(rec, "fn") and not getattr(rec.fn, "_op_count_paused", False):
                self._patch(rec, "fn", self._paused(rec.fn))
        capture = runner.capture

        def paused_capture(key, fn, static_inputs):
            with counter.pause():
                return capture(key, self._paused(fn), static_inputs)

        self._patch(runner, "capture", paused_capture)
        # The eager runner's copy of fresh results into the static outputs: no device graph
        # does that, so it is not round overhead either.
        # Nor is its poisoning of later graphs' outputs (what a shared pool may do on a device).
        module = _runner_module(runner)
        for helper in ("_copy_outputs", "_poison"):
            if module is not None and hasattr(module, helper):
                self._patch(module, helper, self._paused_helper(getattr(module, helper)))

    def _paused_helper(self, fn: Any) -> Any:
        def paused(*args):
            with self.pause():
                return fn(*args)

        return paused

    def _paused(self, fn: Any) -> Any:
        counter = self

        def paused(*args, **kwargs):
            with counter.pause():
                return fn(*args, **kwargs)

        paused._op_count_paused = True
        return paused

    def __exit__(self, *exc: Any) -> None:
        assert self._stack is not None
        self._stack.close()
        for obj, name, old in reversed(self._restore):
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
        self._restore.clear()

    # -- results ------------------------------------------------------------------------------
    def per_round(self, batch_size: int | None = None) -> dict[str, dict[str, float]]:
        """Mean counts per round by phase (plus ``total``), over the rounds of ``batch_size``
        requests (all rounds when None)."""
        rounds = [r for bs, r in self.rounds if batch_size is None or bs == batch_size]
        if not rounds:
            return {}
        sums: dict[str, Counter] = {}
        for r in rounds:
            for phase, c in r.items():
                acc = sums.setdefault(phase, Counter())
                for f in FIELDS:
                    acc[f] += getattr(c, f)
        out = {p: {f: acc[f] / len(rounds) for f in FIELDS} for p, acc in sums.items()}
        out["total"] = {f: sum(out[p][f] for p in sums) for f in FIELDS}
        return out


_MISSING = object()


def _runner_module(runner: Any) -> Any:
    import sys

    return sys.modules.get(type(runner).__module__)
