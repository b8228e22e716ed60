"""Continuous batching: requests join and leave the running batch between rounds.

Each step admits waiting requests while KV slots and batch rows allow (a request reserves its
peak KV need on admission, so a running request never runs out of slots), prefills up to the
step's token budget in chunks of at most ``prefill_chunk_size`` tokens per request, then runs
one decode round for every request whose prompt is done. With ``prefill_wait_steps`` > 0,
admission into a running batch waits (at most that many steps) until every waiting request
fits, so that joining requests share a prefill forward.

A constrained request (structured output) gets its grammar's matcher on admission; it
finishes with ``finish_reason == "stop"`` as soon as its grammar is complete, and fails alone
when the grammar reaches a state no token of the vocabulary can continue.

Requests fail alone: an exception raised while admitting a request, in a prefill forward or in
a decode round finishes the requests it concerned (``finish_reason == "error"``, the cause in
``Request.error``), gives back their KV slots and rows, and leaves the others running, except
:class:`RankFailure` (a tensor-parallel rank failed: no request can run), which propagates. The
scheduler is driven by one thread (:class:`polyspec.engine.loop.EngineLoop`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence

from polyspec.config import EngineConfig
from polyspec.constrain import ConstraintViolation, GrammarCache, constraint_of, next_masks
from polyspec.engine.constrained_choice import ConstrainedChoice
from polyspec.engine.request import Request
from polyspec.engine.stop import StopChecker
from polyspec.errors import RankFailure, RequestError
from polyspec.runtime.sampling import RequestSampler
from polyspec.spec.base import uses_overlap

_log = logging.getLogger("polyspec.engine")


class Scheduler:
    def __init__(
        self,
        worker,
        config: EngineConfig,
        stop_checker: StopChecker,
        grammars: GrammarCache | None = None,
    ):
        """``grammars``: the engine's compiled constraints (None: an engine without a
        tokenizer, which refuses constrained requests at submit)."""
        self.worker = worker
        self.grammars = grammars
        self.config = config
        self.stop = stop_checker
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.decoding: list[Request] = []
        self.reserved: dict[int, int] = {}
        ps = worker.page_size
        self.kv_capacity = worker.num_kv_slots - ps - worker.scratch_kv
        # The most positions a request's decode round may write past its tokens (the widest
        # verify it may get; 1: plain): part of every request's context.
        self.decode_width = max(1, worker.extra_kv_per_request)
        # overlap_rounds resolved for this backend (EngineConfig.overlap_rounds = "auto")
        self.overlap = uses_overlap(worker.backend.capabilities, config.overlap_rounds)
        self.held_steps = 0  # steps admission has waited for more rows (prefill_wait_steps)
        self._failed: list[Request] = []  # failed on admission this step
        self._chunked: list[Request] = []  # the requests of this step's prefill forward
        self.rounds = 0  # decode rounds run
        # speculative or plain rounds for a batch with a constrained request
        self.constrained = ConstrainedChoice(config.constrained_speculation)
        # when the last step's decode round ended, if that step prefilled nothing (None
        # otherwise): a constrained round's time runs from there
        self._round_end: float | None = None

    def check(self, prompt_len: int, max_new_tokens: int) -> None:
        """Raise :class:`RequestError` when a request of this size can never run here."""
        total = prompt_len + max_new_tokens + self.decode_width
        if total > self.config.max_context:
            raise RequestError(
                "max_new_tokens",
                max_new_tokens,
                f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) + verify "
                f"width ({self.decode_width}) = {total} exceeds max_context = "
                f"{self.config.max_context}; lower max_new_tokens, shorten the prompt or raise "
                "max_context",
            )
        need = self.worker.kv_need(prompt_len, max_new_tokens)
        if need > self.kv_capacity:
            raise RequestError(
                "max_new_tokens",
                max_new_tokens,
                f"the request needs {need} KV slots but the pool has {self.kv_capacity} usable; "
                "lower max_new_tokens or raise num_kv_slots",
            )

    def add(self, req: Request) -> None:
        if not req.prompt_ids:
            raise RequestError("prompt_token_ids", [], "the prompt is empty")
        self.check(len(req.prompt_ids), req.params.max_new_tokens)
        self.waiting.append(req)

    def abort(self, rid: int) -> Request | None:
        """Finish request ``rid`` with ``finish_reason == "abort"`` and give back its slots;
        None when it is not here (finished already, or unknown)."""
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                req.finish_reason = "abort"
                req.finish_time = time.perf_counter()
                return req
        for group in (self.prefilling, self.decoding):
            for req in group:
                if req.rid == rid:
                    group.remove(req)
                    req.finish_reason = "abort"
                    self._release(req)
                    return req
        return None

    def fail(self, reqs: Sequence[Request], exc: BaseException) -> list[Request]:
        """Finish ``reqs`` with ``finish_reason == "error"`` and the cause; give back their
        slots. -> those of them that were not finished already."""
        cause = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
        failed = []
        for req in reqs:
            if req.finished and req.finish_reason != "error":
                continue
            for group in (self.prefilling, self.decoding):
                if req in group:
                    group.remove(req)
            if req in self.waiting:
                self.waiting.remove(req)
            req.finish_reason, req.error = "error", cause
            self._release(req)
            failed.append(req)
        _log.error("requests %s failed: %s", [r.rid for r in failed], cause)
        _log.debug("cause of the failure", exc_info=exc)
        return failed

    def _release(self, req: Request) -> None:
        """Give back a request's worker state and reservation, whatever state it is in."""
        req.finish_time = req.finish_time or time.perf_counter()
        if req.rid in self.worker.states:
            try:
                self.worker.remove_request(req.rid)
            except RankFailure:
                raise
            except Exception as exc:  # a half-built state: its row is lost, say so
                _log.error("request %d: could not give back its KV slots: %s", req.rid, exc)
        self.reserved.pop(req.rid, None)

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
            try:
                sampler = RequestSampler.create(
                    p.temperature, p.top_k, p.top_p, seed % 2**63, self.worker.device
                )
                extra = {}
                constraint = constraint_of(p)
                if constraint is not None:
                    matcher = self.grammars.matcher(constraint)
                    matcher.next_mask()  # a grammar no token can start fails here, alone
                    extra["matcher"] = matcher
                self.worker.add_request(
                    req.rid, req.prompt_ids, sampler, kv_reserved=need,
                    max_new_tokens=p.max_new_tokens, **extra,
                )  # fmt: skip
            except RankFailure:  # the ranks are out of step: nothing can run any more
                raise
            except Exception as exc:
                self._failed += self.fail([req], exc)
                continue
            self.reserved[req.rid] = need
            self.prefilling.append(req)

    def _finish(self, req: Request) -> None:
        req.finish_time = time.perf_counter()
        self.worker.remove_request(req.rid)
        del self.reserved[req.rid]

    def step(self) -> list[Request]:
        """One engine step; returns the requests that finished in it (failed ones included)."""
        self._failed = []
        self._admit()
        finished: list[Request] = self._failed
        if self.prefilling:
            self._round_end = None
            try:
                self._prefill(finished)
            except RankFailure:
                raise
            except Exception as exc:  # the prefill forward's requests fail, nobody else
                finished += self.fail([r for r in self._chunked if r not in finished], exc)
        if self.decoding:
            batch = list(self.decoding)
            try:
                self._decode(batch, finished)
            except RankFailure:
                raise
            except Exception as exc:  # the round's requests fail, nobody else
                finished += self.fail([r for r in batch if r not in finished], exc)
        return finished

    def _prefill(self, finished: list[Request]) -> None:
        # The decode round's share of the step: its batch's verify width each (a batch size
        # with plain rounds takes 1 token a request, not the widest tree's N). The prefill
        # keeps at least a quarter of the budget (or a chunk): a full decode batch whose
        # verify tokens fill the step would otherwise prefill a token or two a step, each a
        # forward over all the weights, and starve the requests waiting to join.
        n, cfg = len(self.decoding), self.config
        budget = cfg.max_tokens_per_step - (n * self.worker.round_tokens(n) if n else 0)
        budget = max(budget, min(cfg.prefill_chunk_size, cfg.max_tokens_per_step // 4), 1)
        rids, ends, chunked = [], [], self._chunked
        chunked.clear()
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
                if self._grammar_failed(req, finished):
                    continue
                if req.finished:
                    self._finish(req)
                    finished.append(req)
                else:
                    self.decoding.append(req)

    def _grammar_failed(self, req: Request, finished: list[Request]) -> bool:
        """After a constrained request's new tokens: finish it (``"stop"``) where its grammar
        is complete; fail it alone (-> True) where no token can continue the grammar."""
        state = self.worker.states.get(req.rid)
        matcher = getattr(state, "matcher", None)
        if matcher is None or req.finished:
            return False
        try:
            if matcher.done:
                req.finish_reason = "stop"
                # the whole text is output (no stop token or string to leave out)
                req.stop_text_end = len(self.stop.tokenizer.decode(req.output_ids))
                return False
            matcher.next_mask()
        except ConstraintViolation as exc:
            finished += self.fail([req], exc)
            return True
        return False

    def _matchers(self, batch: list[Request]) -> list:
        """The grammar matchers of the batch's constrained requests."""
        states = (self.worker.states.get(r.rid) for r in batch)
        return [m for m in (getattr(s, "matcher", None) for s in states) if m is not None]

    def _decode(self, batch: list[Request], finished: list[Request]) -> None:
        self.rounds += 1
        rids = [r.rid for r in batch]
        matchers = self._matchers(batch)
        if matchers and self.worker.tree_for(len(rids)).num_steps > 0:
            plain = self.constrained.plain(len(rids))
            # A round's time is the wall time since the last round ended (the host's work
            # between rounds included: a plain round's forward runs on the device meanwhile,
            # a speculative round's draft waits for it), or its call's after a prefill.
            start = self._round_end or time.perf_counter()
            new_tokens = self.worker.decode(rids, lookahead=self.overlap, plain=plain)
            self._round_end = time.perf_counter()
            seconds = self._round_end - start
            self.constrained.record(len(rids), plain, sum(map(len, new_tokens)), seconds)
        else:
            new_tokens = self.worker.decode(rids, lookahead=self.overlap)
            self._round_end = time.perf_counter()
        next_masks(matchers)  # in one parallel call (_grammar_failed reads them)
        for req, toks in zip(batch, new_tokens):
            if not toks:  # it joined this step and sits this round out (the worker's decode)
                continue
            req.accepted_per_round.append(len(toks))
            self.stop.append(req, toks)
            if self._grammar_failed(req, finished):
                continue
            if req.finished:
                self.decoding.remove(req)
                self._finish(req)
                finished.append(req)
