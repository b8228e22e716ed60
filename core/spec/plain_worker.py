"""Plain autoregressive decoding through the same engine, for a fair baseline."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from polyspec.backend import ForwardMode, HostRead
from polyspec.runtime.graphs import block_slots, static_batch
from polyspec.runtime.sampling import SamplingBatch, greedy_ids
from polyspec.spec.base import WorkerBase


@dataclasses.dataclass
class _Step:
    """A decode step on the device queue whose tokens the host has not read."""

    rids: tuple[int, ...]
    tokens: torch.Tensor  # [bs] int64 on the device
    read: HostRead | None  # ``tokens`` on their way to the host, when a step is queued behind
    inputs: dict[str, torch.Tensor] | None  # the captured step's inputs; None: not queueable


class PlainWorker(WorkerBase):
    """One target DECODE forward per round, one token per request."""

    max_round_tokens = 1  # tokens a step commits for a request

    def round_graphs(self, greedy: bool = True, batch_size: int = 1) -> tuple[str, ...]:  # noqa: ARG002
        """The captured computations a round replays when its batch fits a graph bucket."""
        return ("decode",)

    def prefill(self, rids: Sequence[int], ends: Sequence[int]) -> dict[int, int]:
        """Prefill prompt[prefilled:end]; returns the first token of requests now complete."""
        self.timer.start()
        hidden, _, starts, lens = self._target_extend(rids, ends)
        done = [i for i, r in enumerate(rids) if ends[i] == len(self.states[r].prompt)]
        first = {}
        if done:
            last = [sum(lens[: i + 1]) - 1 for i in done]
            tokens = self._sample_first([rids[i] for i in done], hidden[last])
            first = {rids[i]: t for i, t in zip(done, tokens)}
        self.timer.lap("prefill")
        return first

    def decode(self, rids: Sequence[int], lookahead: bool = False) -> list[list[int]]:
        """One token for each of ``rids``. ``lookahead``: the scheduler allows queueing the
        next step behind this one (``EngineConfig.overlap_rounds``; all-greedy captured
        steps only, as for the speculative worker)."""
        sts = [self.states[r] for r in rids]
        self.timer.start()
        step = self._take_queued(rids)  # the last call may have queued this very step
        if step is None:
            step = self._launch(rids, sts, copy=lookahead)
        if lookahead and step.inputs is not None:
            self._keep_queued(self._queue_next(step, sts))
        self.timer.lap("target")
        tokens = (step.read.wait() if step.read is not None else step.tokens).tolist()
        for s, t in zip(sts, tokens):
            s.seq_len += 1
            s.last_token = t
        self.timer.lap("other")
        return [[t] for t in tokens]

    def _launch(self, rids: Sequence[int], sts, copy: bool) -> _Step:
        """Queue one step from the host's view of the requests; ``copy``: another step will
        be queued behind it, so its tokens start towards the host now."""
        rows = [s.row for s in sts]
        seq_lens = [s.seq_len for s in sts]
        self.kv.ensure(rows, [n + 1 for n in seq_lens], self.kv_lookahead)
        bs = len(rows)
        input_ids = self.builder.long([s.last_token for s in sts])
        logits = inputs = None
        graphs = self.graphed(bs, max(seq_lens))
        if graphs is not None:
            rows_t = self.builder.index(rows)
            inputs = {
                "input_ids": input_ids,
                "rows": rows_t,
                "seq_lens": self.builder.index(seq_lens),
                "extend_lens": torch.ones_like(rows_t),  # padding rows get 0 from the runner
            }
            out = graphs.run("decode", bs, max(seq_lens), inputs, self._decode_graph)
            logits = None if out is None else out[:bs]
        if logits is None:
            inputs = None
            batch = self.builder.build(ForwardMode.DECODE, rows, seq_lens, [1] * bs, input_ids)
            hidden, _ = self.target_runner.forward_target(batch)
            logits = self.target.compute_logits(hidden)
        sampling = SamplingBatch([s.sampler for s in sts], 1, self.device)
        tokens = sampling.sample(logits, self.kernels)  # [bs] int64
        if not sampling.all_greedy:
            inputs = None  # a sampled step is never queued behind: only greedy ones
        read = self.backend.read_async(tokens) if copy else None
        return _Step(tuple(rids), tokens, read, inputs)

    def _queue_next(self, step: _Step, sts) -> _Step | None:
        """Queue the step after ``step`` from its tokens on the device, before the host has
        read them; dropped by the next call when the batch has changed."""
        bs = len(sts)
        max_prefix = max(s.seq_len for s in sts) + 1
        graphs = self.graphed(bs, max_prefix)
        if graphs is None:
            return None
        self.kv.ensure([s.row for s in sts], [s.seq_len + 2 for s in sts], self.kv_lookahead)
        inputs = dict(step.inputs, input_ids=step.tokens, seq_lens=step.inputs["seq_lens"] + 1)
        out = graphs.run("decode", bs, max_prefix, inputs, self._decode_graph)
        if out is None:
            return None
        tokens = greedy_ids(out[:bs])
        return _Step(step.rids, tokens, self.backend.read_async(tokens), inputs)

    def _decode_graph(self, s, bs: int, max_prefix: int):
        """The captured plain decode: one target forward -> logits [bs, V]."""
        table = self.req_pool.req_to_token
        slots, positions = block_slots(
            table, s["rows"], s["seq_lens"], s["extend_lens"], 1, self.arange(1)
        )
        batch = static_batch(
            ForwardMode.DECODE, table, s["rows"], s["seq_lens"], s["extend_lens"],
            s["input_ids"], positions, slots,
        )  # fmt: skip
        hidden, _ = self.target_runner.forward_target(batch, static_prefix=max_prefix)
        return self.target.compute_logits(hidden)
