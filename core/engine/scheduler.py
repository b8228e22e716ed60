"""Continuous batching: requests join and leave the running batch between rounds.

Each step admits waiting requests while KV slots and batch rows allow (a request reserves its
peak KV need on admission, so a running request never runs out of slots), prefills up to the
step's token budget in chunks of at most ``prefill_chunk_size`` tokens per request, then runs
one decode round for every request whose prompt is done. With ``prefill_wait_steps`` > 0,
admission into a running batch waits (at most that many steps) until every waiting request
fits, so that joining requests share a prefill forward.
"""

from __future__ import annotations

import time
from collections import deque

from polyspec.config import EngineConfig
from polyspec.engine.request import Request
from polyspec.engine.stop import StopChecker
from polyspec.errors import ConfigError
from polyspec.runtime.sampling import RequestSampler
from polyspec.spec.base import uses_overlap


class Scheduler:
    def __init__(self, worker, config: EngineConfig, stop_checker: StopChecker):
        self.worker = worker
        self.config = config
        self.stop = stop_checker
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.decoding: list[Request] = []
        self.reserved: dict[int, int] = {}
        ps = worker.page_size
        self.kv_capacity = worker.num_kv_slots - ps - worker.scratch_kv
        # A request's tokens in a decode round: the widest verify it may get (1: plain).
        self.decode_width = max(1, worker.extra_kv_per_request)
        # overlap_rounds resolved for this backend (EngineConfig.overlap_rounds = "auto")
        self.overlap = uses_overlap(worker.backend.capabilities, config.overlap_rounds)
        self.held_steps = 0  # steps admission has waited for more rows (prefill_wait_steps)

    def add(self, req: Request) -> None:
        need = self.worker.kv_need(len(req.prompt_ids), req.params.max_new_tokens)
        total = len(req.prompt_ids) + req.params.max_new_tokens + self.decode_width
        if total > self.config.max_context:
            raise ConfigError(
                f"request {req.rid}: prompt ({len(req.prompt_ids)} tokens) + max_new_tokens "
                f"({req.params.max_new_tokens}) + verify width ({self.decode_width}) exceeds "
                f"max_context = {self.config.max_context}; raise max_context or shorten it"
            )
        if need > self.kv_capacity:
            raise ConfigError(
                f"request {req.rid} needs {need} KV slots but the pool has {self.kv_capacity} "
                "usable; raise num_kv_slots"
            )
        if not req.prompt_ids:
            raise ConfigError(f"request {req.rid} has an empty prompt")
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding)

    def _hold_admission(self) -> bool:
        """Whether waiting requests wait this step for more rows to free: only while others
        decode, only while some waiting request would not fit yet, at most
        ``prefill_wait_steps`` steps in a row."""
        free = self.config.max_batch_size - len(self.decoding) - len(self.prefilling)
        hold = (
            self.held_steps < self.config.prefill_wait_steps
            and bool(self.decoding)
            and not self.prefilling
            and 0 < free < len(self.waiting)
        )
        self.held_steps = self.held_steps + 1 if hold else 0
        return hold

    def _admit(self) -> None:
        if self.waiting and self._hold_admission():
            return
        while self.waiting:
            req = self.waiting[0]
            if len(self.prefilling) + len(self.decoding) >= self.config.max_batch_size:
                return
            need = self.worker.kv_need(len(req.prompt_ids), req.params.max_new_tokens)
            if sum(self.reserved.values()) + need > self.kv_capacity:
                return
            self.waiting.popleft()
            p = req.params
            seed = p.seed if p.seed is not None else self.config.seed * 1_000_003 + req.rid
            sampler = RequestSampler.create(
                p.temperature, p.top_k, p.top_p, seed, self.worker.device
            )
            self.worker.add_request(req.rid, req.prompt_ids, sampler, kv_reserved=need)
            self.reserved[req.rid] = need
            self.prefilling.append(req)

    def _lookahead(self, batch: list[Request]) -> bool:
        """Whether the worker may queue the next round behind this one (``overlap_rounds``):
        only while no request of the batch can reach its token limit in this round, so the
        queued round stays within every request's KV reservation."""
        depth = self.worker.max_round_tokens
        return self.overlap and all(
            len(r.output_ids) + depth <= r.params.max_new_tokens for r in batch
        )

    def _finish(self, req: Request) -> None:
        req.finish_time = time.perf_counter()
        self.worker.remove_request(req.rid)
        del self.reserved[req.rid]

    def step(self) -> list[Request]:
        """One engine step; returns the requests that finished in it."""
        self._admit()
        finished: list[Request] = []
        if self.prefilling:
            budget = self.config.max_tokens_per_step - len(self.decoding) * self.decode_width
            budget = max(budget, 1)  # always make progress
            rids, ends, chunked = [], [], []
            for req in self.prefilling:
                if budget <= 0:
                    break
                done = self.worker.states[req.rid].prefilled
                n = min(len(req.prompt_ids) - done, self.config.prefill_chunk_size, budget)
                budget -= n
                rids.append(req.rid)
                ends.append(done + n)
                chunked.append(req)
            first = self.worker.prefill(rids, ends)
            now = time.perf_counter()
            for req in chunked:
                if req.rid in first:
                    req.first_token_time = now
                    self.prefilling.remove(req)
                    self.stop.append(req, [first[req.rid]])
                    if req.finished:
                        self._finish(req)
                        finished.append(req)
                    else:
                        self.decoding.append(req)
        if self.decoding:
            batch = list(self.decoding)
            new_tokens = self.worker.decode(
                [r.rid for r in batch], lookahead=self._lookahead(batch)
            )
            for req, toks in zip(batch, new_tokens):
                req.accepted_per_round.append(len(toks))
                self.stop.append(req, toks)
                if req.finished:
                    self.decoding.remove(req)
                    self._finish(req)
                    finished.append(req)
        return finished
