"""Captured forwards: one graph per (computation, batch-size bucket, context bucket).

The engine keeps the shapes of a decode round fixed so that the backend's graph runner can
record it once and replay it: the batch is padded up to a bucket size (padding requests use
row 0, prefix 0 and the padding slot 0, which is what the runner's zero-fill gives), and the
attention reads a fixed number of prefix columns (the context bucket), masking what lies past
each request's prefix. Buckets are captured lazily, on first use; a batch larger than the
largest bucket, or a context longer than ``max_context``, runs eagerly.

Where the backend's graphs really capture (``graph_capture``) and it reports its free memory
(``Backend.memory_info``), each capture is measured and none is made that would leave less
than :data:`MEMORY_MARGIN` of the device's memory free: that batch bucket and the larger ones,
where not captured yet, run eagerly (said once, in a warning of the ``polyspec.engine`` logger).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from polyspec.backend import Backend, ForwardBatch, ForwardMode, KernelSet

_log = logging.getLogger("polyspec.engine")

MEMORY_MARGIN = 0.05
"""The share of the device's total memory graph capture leaves free, for what eager forwards
and the allocator need: a capture whose expected cost would take the free memory below it is
not made. The expected cost is that of the costliest capture so far: graphs share one memory
pool, so a capture costs what its bucket adds to the pool's peak (the buckets grow in small
steps) plus its outputs, and the first capture's one-off costs (the pool itself, workspaces)
make a cost per batch row a poor guide."""


@dataclasses.dataclass(frozen=True)
class GraphBuckets:
    """Batch sizes and prefix widths that graphs are captured for."""

    batch_sizes: tuple[int, ...]  # ascending
    prefix_lens: tuple[int, ...]  # ascending; the last one is the request table's width

    @classmethod
    def default(cls, max_batch_size: int, max_graph_batch_size: int | None, table_width: int):
        """Batch sizes 1, 2, 4, 8, then steps of 8 up to 64, of 16 up to 256 and of 32 above,
        ending at the top bucket ``max_batch_size`` (``max_graph_batch_size`` where that is
        smaller; None: no cap); prefix widths 256, 512, ... doubling up to the table width
        (the context limit)."""
        top = max_batch_size
        if max_graph_batch_size is not None:
            top = min(top, max_graph_batch_size)
        steps = [1, 2, 4, *range(8, 64, 8), *range(64, 256, 16), *range(256, top, 32)]
        sizes = [b for b in steps if b < top] + [top]
        widths, w = [], 256
        while w < table_width:
            widths.append(w)
            w *= 2
        widths.append(table_width)
        return cls(tuple(sorted(set(sizes))), tuple(widths))

    def batch_bucket(self, bs: int) -> int | None:
        """The smallest captured batch size >= ``bs``; None above the largest."""
        i = bisect.bisect_left(self.batch_sizes, bs)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    def prefix_bucket(self, max_prefix: int) -> int | None:
        i = bisect.bisect_left(self.prefix_lens, max_prefix)
        return self.prefix_lens[i] if i < len(self.prefix_lens) else None


class CapturedForwards:
    """Lazily captured, replayed computations over one backend's graph runner.

    ``fn(static_inputs, batch_bucket, prefix_bucket)`` must read its per-step values only from
    ``static_inputs`` (every tensor's leading dimension is per request: ``bs`` rows, or
    ``bs * Q`` tokens) and may close over persistent state that is updated in place (weights,
    KV pools, the request table). Outputs are the runner's static buffers, overwritten by the
    next replay of the same key: copy what must outlive it.
    """

    def __init__(self, backend: Backend, buckets: GraphBuckets) -> None:
        self.backend = backend
        self.buckets = buckets
        self.runner = backend.make_graph_runner()
        self.needs_prepare = backend.capabilities.graph_needs_prepare
        self.max_graphs = backend.capabilities.max_graph_shapes
        self.captured: list[tuple[str, int, int]] = []  # (name, batch bucket, prefix bucket)
        # name -> (fn, {input: (rows per request, trailing shape, dtype, device)}), from the
        # first run of each computation (or :meth:`declare`), so that capture_all can record
        # the other buckets.
        self._templates: dict[str, tuple[Callable, dict[str, tuple]]] = {}
        # name -> the largest batch bucket worth capturing (a prefill width's token budget)
        self._max_batch: dict[str, int] = {}
        # name -> the smallest batch bucket worth capturing (a round of a tree that only
        # larger batches use)
        self._min_batch: dict[str, int] = {}
        # Memory: measured where graphs really capture and the backend reports free memory.
        self._measure = backend.capabilities.graph_capture
        self.graph_bytes = 0  # free device memory the captures took, summed
        self.free_before: int | None = None  # free bytes before the first capture
        self.free_after: int | None = None  # free bytes after the latest capture
        # the smallest batch bucket at which nothing more is captured, for lack of memory
        self.eager_from: int | None = None
        self._largest_cost = 0  # bytes of the costliest capture so far

    @property
    def num_captured(self) -> int:
        """Graphs captured so far."""
        return len(self.captured)

    @property
    def names(self) -> tuple[str, ...]:
        """The computations run or declared so far (what :meth:`capture_all` records)."""
        return tuple(self._templates)

    def declare(
        self,
        name: str,
        fn: Callable[[Mapping[str, torch.Tensor], int, int], Any],
        template: Mapping[str, tuple[int, tuple[int, ...], torch.dtype, torch.device]],
        max_batch: int | None = None,
    ) -> None:
        """Make ``name`` known before its first run, so that :meth:`capture_all` records it too
        (a computation some timed run will need, like another prefill width). ``template``:
        input name -> (rows per request, trailing shape, dtype, device). ``max_batch``: record
        no batch bucket above it (the computation runs eagerly there)."""
        if name not in self._templates:
            self._templates[name] = (fn, dict(template))
        if max_batch is not None:
            self._max_batch[name] = max_batch

    def fits(self, bs: int, max_prefix: int) -> bool:
        """True when a batch of ``bs`` requests with prefixes up to ``max_prefix`` can replay."""
        return (
            self.buckets.batch_bucket(bs) is not None
            and self.buckets.prefix_bucket(max_prefix) is not None
        )

    @torch.inference_mode()
    def run(
        self,
        name: str,
        bs: int,
        max_prefix: int,
        inputs: Mapping[str, torch.Tensor],
        fn: Callable[[Mapping[str, torch.Tensor], int, int], Any],
        host_params: Mapping[str, list[int]] | None = None,
    ) -> Any:
        """Replay ``name`` for the bucket of (``bs``, ``max_prefix``), capturing it first if
        needed; returns the static outputs (leading dims for the padded batch). Returns None
        when the backend's graph budget (``max_graph_shapes``) is spent, or the device's free
        memory too low for this bucket (:data:`MEMORY_MARGIN`): run eagerly then.
        ``host_params``: the replay's per-request host lists (``bs`` entries each), handed to
        ``GraphRunner.prepare`` where the backend's graphs need it (its forwards'
        ``ForwardBatch.host_lengths`` read them)."""
        b = self.buckets.batch_bucket(bs)
        p = self.buckets.prefix_bucket(max_prefix)
        if b is None or p is None:
            raise ValueError(f"no graph bucket for bs={bs}, prefix={max_prefix}; check fits()")
        if name not in self._templates:
            template = {}
            for n, x in inputs.items():
                if x.dim() == 0 or x.shape[0] % bs:
                    raise ValueError(f"graph input {n!r}: leading dim {x.shape} not per request")
                template[n] = (x.shape[0] // bs, tuple(x.shape[1:]), x.dtype, x.device)
            self._templates[name] = (fn, template)
        if not self._capture(name, b, p):
            return None
        key = (name, b, p)
        if self.needs_prepare:
            if host_params is None:
                raise ValueError(
                    f"graph {name!r}: this backend's graphs need the replay's host lengths "
                    f"(capabilities.graph_needs_prepare); pass host_params"
                )
            params = {"batch_size": bs, "max_prefix_len": p}
            params.update({n: [int(x) for x in v] for n, v in host_params.items()})
            self.runner.prepare(key, params)
        return self.runner.replay(key, inputs)

    def _budget_spent(self) -> bool:
        return self.max_graphs is not None and self.num_captured >= self.max_graphs

    def _capture(self, name: str, b: int, p: int) -> bool:
        """Capture ``name`` for buckets (b, p) unless done; False when the backend's graph
        budget is spent or the device's free memory is not enough (the bucket runs eagerly)."""
        key = (name, b, p)
        if self.runner.can_run(key):
            return True
        if self._budget_spent() or (self.eager_from is not None and b >= self.eager_from):
            return False
        free, total = self.backend.memory_info() if self._measure else (0, 0)
        if free > 0:
            expected = self._largest_cost
            if free - expected < MEMORY_MARGIN * total:
                self._stop_capturing(b, free, total, expected)
                return False
            if self.free_before is None:
                self.free_before = free
        fn, template = self._templates[name]
        static = {
            n: torch.zeros((per * b, *rest), dtype=dtype, device=device)
            for n, (per, rest, dtype, device) in template.items()
        }
        self.runner.capture(key, lambda s: fn(s, b, p), static)
        self.captured.append(key)
        if free > 0:
            after = self.backend.memory_info()[0]
            cost = max(0, free - after)
            self.graph_bytes += cost
            self._largest_cost = max(self._largest_cost, cost)
            self.free_after = after
        return True

    def _stop_capturing(self, b: int, free: int, total: int, expected: float) -> None:
        """Capture nothing more at batch bucket ``b`` or above (said the first time): those
        buckets run eagerly where no graph is captured for them yet."""
        if self.eager_from is None:
            _log.warning(
                "graph capture stopped at batch %d: %.0f MiB free of %.0f MiB, a capture "
                "there is expected to take %.0f MiB, and %.0f%% of the device is kept free; "
                "batches of %d and more run eagerly where no graph is captured for them yet "
                "(the %d graphs captured, which still replay, take %.0f MiB)",
                b, free / 2**20, total / 2**20, expected / 2**20, 100 * MEMORY_MARGIN, b,
                self.num_captured, self.graph_bytes / 2**20,
            )  # fmt: skip
        self.eager_from = b if self.eager_from is None else min(self.eager_from, b)

    def memory_report(self) -> dict[str, Any]:
        """What the captured graphs hold, for reports: ``graphs`` captured, ``bytes`` of free
        device memory their captures took, ``free_before`` (before the first capture) and
        ``free_after`` (after the latest) in bytes (the three None where the backend's graphs
        do not really capture or it reports no memory), and ``eager_from``, the smallest
        batch bucket left eager for lack of memory (None: none was)."""
        measured = self.free_before is not None
        return {
            "graphs": self.num_captured,
            "bytes": self.graph_bytes if measured else None,
            "free_before": self.free_before,
            "free_after": self.free_after,
            "eager_from": self.eager_from,
        }

    def forget(self, names: Sequence[str]) -> None:
        """Have :meth:`capture_all` record ``names`` no more (the rounds of a tree the engine
        timed at start-up and does not run). Their graphs captured so far stay; a later run
        of one captures its bucket again on first use."""
        for name in names:
            self._templates.pop(name, None)
            self._min_batch.pop(name, None)
            self._max_batch.pop(name, None)

    def restrict(self, name: str, min_batch: int, max_batch: int) -> None:
        """Have :meth:`capture_all` record ``name`` for the batch buckets from ``min_batch`` to
        ``max_batch`` only (a round of a tree that only those batch sizes use); a batch outside
        still captures it on first use."""
        self._min_batch[name] = min_batch
        self._max_batch[name] = max_batch

    @torch.inference_mode()
    def capture_all(
        self,
        max_batch_size: int,
        max_prefix: int,
        progress: Callable[[int, int], None] | None = None,
    ) -> int:
        """Capture every computation run so far for every bucket a batch of up to
        ``max_batch_size`` requests with prefixes up to ``max_prefix`` can use (a benchmark's
        warm-up: lazy capture would land inside the timed run). ``progress(done, total)`` is
        called after each graph attempted. Returns how many were new; buckets the graph budget
        or the free memory leave out run eagerly."""
        before = self.num_captured
        top_b = self.buckets.batch_bucket(max_batch_size) or self.buckets.batch_sizes[-1]
        top_p = self.buckets.prefix_bucket(max_prefix) or self.buckets.prefix_lens[-1]
        todo = [
            (name, b, p)
            for name in self._templates
            for b in self.buckets.batch_sizes
            for p in self.buckets.prefix_lens
            if self._min_batch.get(name, 0) <= b <= min(top_b, self._max_batch.get(name, top_b))
            and p <= top_p
            and not self.runner.can_run((name, b, p))
        ]
        for i, (name, b, p) in enumerate(todo):
            if self._budget_spent():
                break
            self._capture(name, b, p)
            if progress is not None:
                progress(i + 1, len(todo))
        return self.num_captured - before


def static_batch(
    mode: ForwardMode,
    req_to_token: torch.Tensor,  # [R, C]
    req_pool_indices: torch.Tensor,  # [bs]
    prefix_lens: torch.Tensor,  # [bs]
    extend_lens: torch.Tensor,  # [bs]
    input_ids: torch.Tensor,  # [bs * Q]
    positions: torch.Tensor,  # [bs * Q]
    out_cache_loc: torch.Tensor,  # [bs * Q]
    **extra: Any,
) -> ForwardBatch:
    """A ForwardBatch of device tensors only (no host lists), for captured forwards."""
    return ForwardBatch(
        mode=mode,
        input_ids=input_ids,
        positions=positions,
        out_cache_loc=out_cache_loc,
        req_pool_indices=req_pool_indices,
        req_to_token=req_to_token,
        prefix_lens=prefix_lens,
        extend_lens=extend_lens,
        **extra,
    )


def block_slots(
    kernels: KernelSet,
    req_to_token: torch.Tensor,  # [R, C]
    rows: torch.Tensor,  # [bs]
    starts: torch.Tensor,  # [bs]
    lens: torch.Tensor,  # [bs]
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([bs * width] slots, [bs * width] int64 positions)
    """Slots and positions of ``width`` tokens per request from ``starts``; tokens past
    ``lens[b]`` get the padding slot 0 (and a position clamped into the table):
    ``KernelSet.assign_block_cache_locs``, one launch where torch took five (inside a
    captured round each costs its latency, whatever its size)."""
    n = rows.shape[0] * width
    slots = torch.empty(n, dtype=req_to_token.dtype, device=req_to_token.device)
    positions = torch.empty(n, dtype=torch.int64, device=req_to_token.device)
    kernels.assign_block_cache_locs(rows, req_to_token, starts, lens, width, slots, positions)
    return slots, positions


def padded(host_params: Mapping[str, Any], name: str, rows: int) -> list[int]:
    """``host_params[name]`` (one entry per live request; ``[]`` when absent: a capture's own
    inputs) padded with zeros to the ``rows`` of a captured batch (padding requests hold 0)."""
    values = [int(x) for x in host_params.get(name, ())]
    if len(values) > rows:
        raise ValueError(f"host parameter {name!r} has {len(values)} entries for {rows} rows")
    return values + [0] * (rows - len(values))
