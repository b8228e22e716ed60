"""Plain autoregressive decoding through the same engine, for a fair baseline."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from polyspec.backend import ForwardMode
from polyspec.runtime.graphs import block_slots, static_batch
from polyspec.runtime.sampling import SamplingBatch
from polyspec.spec.base import WorkerBase


class PlainWorker(WorkerBase):
    """One target DECODE forward per round, one token per request."""

    def round_graphs(self, greedy: bool = True) -> tuple[str, ...]:  # noqa: ARG002
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

    def decode(self, rids: Sequence[int], lookahead: bool = False) -> list[list[int]]:  # noqa: ARG002
        sts = [self.states[r] for r in rids]
        rows = [s.row for s in sts]
        seq_lens = [s.seq_len for s in sts]
        self.timer.start()
        self.kv.ensure(rows, [n + 1 for n in seq_lens], self.kv_lookahead)
        bs = len(rows)
        input_ids = self.builder.long([s.last_token for s in sts])
        logits = None
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
            batch = self.builder.build(ForwardMode.DECODE, rows, seq_lens, [1] * bs, input_ids)
            hidden, _ = self.target_runner.forward_target(batch)
            logits = self.target.compute_logits(hidden)
        self.timer.lap("target")
        tokens = SamplingBatch([s.sampler for s in sts], 1, self.device).sample(
            logits, self.kernels
        )
        tokens = tokens.tolist()
        for s, t in zip(sts, tokens):
            s.seq_len += 1
            s.last_token = t
        self.timer.lap("other")
        return [[t] for t in tokens]

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
