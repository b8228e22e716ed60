"""Time one polyspec engine (plain or speculative) over a prompt set."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
import sys
import time
from collections.abc import Iterator, Sequence

from polyspec.config import SamplingParams


@dataclasses.dataclass(frozen=True)
class SystemResult:
    """What one system produced over the whole prompt set, and how fast."""

    name: str
    num_tokens: int  # generated tokens over all prompts
    wall_s: float  # wall time of the whole set (warm-up excluded)
    outputs: list[list[int]]  # generated ids per prompt, in input order
    accepted_per_request: list[list[int]] = dataclasses.field(default_factory=list)
    phase_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    wall_s_runs: list[float] = dataclasses.field(default_factory=list)  # every timed run

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of wall time."""
        return self.num_tokens / self.wall_s if self.wall_s > 0 else 0.0


def progress_bar(name: str, total: int, enabled: bool = True, unit: str = "prompt"):
    """A tqdm bar over prompts (on stderr), or a no-op object when disabled or tqdm is absent."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is a dependency, but a missing bar must not stop a benchmark
        enabled = False
    if not enabled:
        return _NoBar()
    return tqdm(total=total, desc=name, unit=unit, leave=True, dynamic_ncols=True)


class _NoBar:
    """The part of tqdm's interface the benchmark uses, doing nothing."""

    n = 0

    def update(self, n: int = 1) -> None:
        """Ignore progress."""

    def close(self) -> None:
        """Nothing to close."""


def run_polyspec(
    llm,
    name: str,
    prompt_ids: Sequence[Sequence[int]],
    sampling: SamplingParams,
    progress: bool = True,
    phase_times: bool = True,
    warmup_prompts: int = 1,
    repeats: int = 1,
    batch_size: int | None = None,
) -> SystemResult:
    """Warm ``llm`` (a :class:`polyspec.LLM`) up on the first ``warmup_prompts`` prompts
    (untimed; one batch, so that every batch-size-dependent path is built before timing), then
    time ``llm.generate`` over all prompts at once (the engine batches up to max_batch_size).
    With ``repeats`` > 1 the set is timed that many times and ``wall_s`` is the median (on a
    shared host one slow run would otherwise decide a ratio); every run must give the same
    greedy outputs, else a RuntimeError. Phases come from the first run.

    ``phase_times`` turns the worker's :class:`PhaseTimer` on, which synchronises the device
    at each phase boundary. That is free where kernels run synchronously (the CPU), so the
    timed run times its phases too; on a backend with ``async_execution`` the syncs would slow
    the run being measured, so the phases come from a second, separate run of the same prompts
    and the tokens/s from a run without them.

    ``batch_size``: requests in flight at once, at most the engine's ``max_batch_size`` (None:
    that), so that one engine can be timed at several batch sizes."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    with batch_limit(llm, batch_size):
        return _run_polyspec(
            llm, name, prompt_ids, sampling, progress, phase_times, warmup_prompts, repeats
        )


@contextlib.contextmanager
def batch_limit(llm, batch_size: int | None) -> Iterator[None]:
    """Admit at most ``batch_size`` requests at once into ``llm``'s batch while inside (None:
    its ``max_batch_size``; more is refused: the engine's tables hold no more rows)."""
    scheduler = llm.scheduler
    config = scheduler.config
    if batch_size is None:
        yield
        return
    if not 1 <= batch_size <= config.max_batch_size:
        raise ValueError(f"batch_size {batch_size} is not in 1..{config.max_batch_size}")
    scheduler.config = dataclasses.replace(config, max_batch_size=batch_size)
    try:
        yield
    finally:
        scheduler.config = config


def _capture_graphs(llm, name: str, max_prefix: int, progress: bool) -> None:
    """Capture every graph bucket a batch of up to the scheduler's batch size can reach
    (untimed), with a progress bar, and say on stderr how many graphs that took, in how long
    and how much device memory."""
    graphs = llm.worker.graphs
    bar = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = progress_bar(f"{name}: graphs", total, progress, unit="graph")
        bar.update(done - bar.n)

    t0 = time.perf_counter()
    llm.restrict_graphs()  # each tree's rounds for the batch sizes that run it, as a server's
    try:
        new = graphs.capture_all(llm.scheduler.config.max_batch_size, max_prefix, update)
    finally:
        if bar is not None:
            bar.close()
    if new:
        mem = graphs.memory_report()
        line = f"note: {name}: {new} graphs captured in {time.perf_counter() - t0:.1f} s"
        if mem["bytes"] is not None:
            line += (
                f", {mem['graphs']} in all taking {mem['bytes'] / 2**20:.0f} MiB of device "
                f"memory ({mem['free_before'] / 2**30:.1f} GiB free before, "
                f"{mem['free_after'] / 2**30:.1f} GiB after)"
            )
        if mem["eager_from"] is not None:
            line += f"; batches of {mem['eager_from']} and more run eagerly (memory)"
        print(line, file=sys.stderr)


def _run_polyspec(
    llm, name, prompt_ids, sampling, progress, phase_times, warmup_prompts, repeats
) -> SystemResult:
    if warmup_prompts > 0:
        warm = [list(p) for p in prompt_ids[:warmup_prompts]]
        llm.generate(prompt_token_ids=warm, sampling_params=sampling)
        if llm.worker.graphs is not None:  # every bucket the timed run can reach, untimed
            longest = max(len(p) for p in prompt_ids) + sampling.max_new_tokens
            _capture_graphs(llm, name, longest + 16, progress)
    separate = phase_run(llm.backend, phase_times) == "separate run"
    runs = []
    for i in range(repeats):
        label = name if i == 0 else f"{name} ({i + 1}/{repeats})"
        timed = phase_times and not separate and i == 0
        wall, outs, phases = _timed_generate(llm, label, prompt_ids, sampling, progress, timed)
        runs.append(SystemResult(
            name=name,
            num_tokens=sum(len(o.token_ids) for o in outs),
            wall_s=wall,
            outputs=[list(o.token_ids) for o in outs],
            accepted_per_request=[list(o.stats.accepted_per_round) for o in outs],
            phase_seconds=phases,
        ))  # fmt: skip
    result = median_of(runs, sampling.temperature == 0)
    if separate:
        _, _, phases = _timed_generate(
            llm, f"{name} (phases)", prompt_ids, sampling, progress, True
        )
        result = dataclasses.replace(result, phase_seconds=phases)
    return result


def median_of(runs: Sequence[SystemResult], greedy: bool) -> SystemResult:
    """Several timed runs of one system over the same prompts as one result: the first run's
    outputs and phases, the median wall time of them all. Greedy runs must give the same
    outputs, else a RuntimeError."""
    first = runs[0]
    for i, r in enumerate(runs[1:], start=2):
        if greedy and r.outputs != first.outputs:
            raise RuntimeError(f"{first.name}: timed run {i} gave other greedy outputs than run 1")
    walls = [w for r in runs for w in (r.wall_s_runs or [r.wall_s])]
    return dataclasses.replace(first, wall_s=statistics.median(walls), wall_s_runs=walls)


def phase_run(backend, phase_times: bool) -> str:
    """Where :func:`run_polyspec` times phases on ``backend``: "off", "timed run" (syncs are
    free: kernels run synchronously) or "separate run" (``async_execution``)."""
    if not phase_times:
        return "off"
    return "separate run" if backend.capabilities.async_execution else "timed run"


def _timed_generate(llm, name, prompt_ids, sampling, progress: bool, phase_times: bool):
    """One timed ``llm.generate`` over all prompts -> (wall s, outputs, phase seconds)."""
    timer = llm.worker.timer
    timer.seconds.clear()
    timer.enabled = phase_times
    bar = progress_bar(name, len(prompt_ids), progress)

    def update(done: int, _total: int) -> None:
        bar.update(done - bar.n)

    sync = llm.backend.synchronize
    # As ``polyspec serve`` does once ready: the engine's start-up objects out of the
    # collector's generations while timed (a full collection of them takes tens of ms), back
    # in afterwards so that a released engine's reference cycles can be collected.
    gc.collect()
    gc.freeze()
    try:
        sync()
        t0 = time.perf_counter()
        outs = llm.generate(
            prompt_token_ids=[list(p) for p in prompt_ids],
            sampling_params=sampling,
            progress=update,
        )
        sync()
        wall = time.perf_counter() - t0
    finally:
        gc.unfreeze()
        timer.enabled = False
        bar.close()
    return wall, outs, dict(timer.seconds) if phase_times else {}
