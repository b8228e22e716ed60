"""Plain autoregressive decoding through the same engine, for a fair baseline: the round of
:mod:`polyspec.spec.round` without a draft (one target DECODE forward, one token a request)."""

from __future__ import annotations

from collections.abc import Sequence

from polyspec.spec.base import WorkerBase
from polyspec.spec.round import RoundParts


class PlainWorker(WorkerBase):
    """One target DECODE forward per round, one token per request."""

    max_round_tokens = 1  # tokens a step commits for a request
    prepare_phase = round_phase = "target"

    def round_parts(self) -> RoundParts:
        return RoundParts(
            self.kernels, self.target, self.target_runner, None, None, self.req_pool.req_to_token,
            None, self.page_size, self.backend.index_dtype, False, 1, self.arange,
        )  # fmt: skip

    def prefill(self, rids: Sequence[int], ends: Sequence[int]) -> dict[int, int]:
        """Prefill prompt[prefilled:end]; returns the first token of requests now complete."""
        self.timer.start()
        hidden, _, starts, lens = self._target_extend(rids, ends)
        done = [i for i, r in enumerate(rids) if ends[i] == len(self.states[r].prompt)]
        first = {}
        if done:
            last = self._last_rows(lens, done)  # [len(done)]
            tokens = self._sample_first([rids[i] for i in done], hidden.index_select(0, last))
            first = {rids[i]: t for i, t in zip(done, tokens)}
        self.timer.lap("prefill")
        return first
