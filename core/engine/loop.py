"""The one engine loop: a background thread owns the scheduler and the worker; any thread
submits requests and waits on its own.

``LLM.generate`` and the HTTP server both sit on it::

    loop = llm.engine                 # started on first use; EngineLoop(llm) for options
    handle = loop.submit(prompt_ids, SamplingParams(max_new_tokens=64))
    for event in handle:              # or ``async for event in handle`` in asyncio
        print(event.text, end="")     # newly stable text, stop strings cut
    out = handle.result()             # the RequestOutput, with stats

Contract:

- :meth:`EngineLoop.submit` checks the request first (:mod:`polyspec.engine.validate`) and
  raises :class:`RequestError` (field, value, message) before anything is admitted; with
  ``max_queued_requests`` set, :class:`QueueFull` when that many requests wait for admission.
  It never blocks on the engine.
- Each round hands every running request a :class:`RequestEvent` with the token ids it
  accepted and the text that became stable (:mod:`polyspec.engine.stream`: never half a UTF-8
  character, never the start of a stop string that may still complete); the last event has
  ``finished=True`` and the finish reason. The events' texts joined are the output's text; their
  token ids joined are its token ids.
- An exception raised while admitting, prefilling or decoding fails only the requests of that
  step (``finish_reason == "error"``, the cause in ``error``), gives back their KV slots, and
  the loop keeps serving. Should the loop itself stop on an error, every waiting handle
  finishes with ``"error"`` and later submits raise ``RuntimeError`` naming the cause.
- :meth:`EngineLoop.abort` finishes a request with ``"abort"`` and frees its KV before the next
  step. :meth:`EngineLoop.shutdown` stops admission, lets running requests finish for up to
  ``grace_s`` seconds, aborts the rest and joins the thread.
- Handle callbacks (:meth:`RequestHandle.add_done_callback`) run on the loop's thread: keep
  them short; ``submit`` and ``abort`` only queue work, so calling them there is fine.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

from polyspec.config import SamplingParams
from polyspec.engine.request import Request, RequestOutput, RequestStats
from polyspec.engine.stream import TextStream
from polyspec.engine.validate import check_request
from polyspec.errors import PolyspecError, RequestError

if TYPE_CHECKING:
    from polyspec.engine.llm import LLM

__all__ = [
    "EngineLoop",
    "EngineStats",
    "QueueFull",
    "RequestError",
    "RequestEvent",
    "RequestHandle",
]


_THREAD_NAME = "polyspec-engine"
"""The name of the thread the loop starts itself (a caller that drives keeps its own)."""


class QueueFull(PolyspecError, RuntimeError):
    """``max_queued_requests`` requests already wait for admission; try again later."""


@dataclasses.dataclass(frozen=True)
class RequestEvent:
    """What one engine step produced for one request."""

    token_ids: list[int]  # tokens newly accepted for this request in this step
    text: str  # newly stable text: never half a UTF-8 character nor a stop string's start
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" once finished
    error: str | None = None  # the cause, when finish_reason == "error"


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine (for /metrics). Totals count since the loop started."""

    running: int  # requests admitted (prefilling or decoding)
    waiting: int  # requests submitted, not admitted yet
    kv_slots_used: int
    kv_slots_free: int
    prompt_tokens_total: int  # prompt tokens of finished requests
    generation_tokens_total: int  # tokens handed out to requests
    requests_finished_total: dict[str, int]  # by finish reason
    rounds_total: int  # decode rounds (one per engine step that decoded)
    steps_total: int
    # decode rounds of one request by tokens committed (accepted drafts + bonus): {length: n}
    acceptance_length_histogram: dict[int, int]
    # accepted_per_position[i]: request-rounds whose draft token at depth i + 1 was accepted
    accepted_per_position: list[int]
    step_time_s_total: float  # wall time of engine steps
    # seconds per worker phase ("draft", "verify", ...) where the worker's timer is enabled
    phase_time_s_total: dict[str, float]


class RequestHandle:
    """One submitted request: iterate its events (threads or asyncio), or wait for its output.

    Events are kept, so iterating after the request finished still yields all of them; each
    iteration starts from the first event."""

    def __init__(self, request_id: int, loop: EngineLoop):
        self.request_id = request_id
        self._loop = loop
        self._cond = threading.Condition()
        self._events: list[RequestEvent] = []
        self._output: RequestOutput | None = None
        self._waiters: list[tuple[Any, Any]] = []  # (asyncio loop, future) awaiting an event
        self._callbacks: list[Callable[[RequestHandle], None]] = []

    @property
    def finished(self) -> bool:
        return self._output is not None

    def __iter__(self) -> Iterator[RequestEvent]:
        """Block for each event in turn; ends after the finishing event."""
        i = 0
        while True:
            with self._cond:
                while i >= len(self._events):
                    self._cond.wait()
                event = self._events[i]
            i += 1
            yield event
            if event.finished:
                return

    def __aiter__(self) -> AsyncIterator[RequestEvent]:
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[RequestEvent]:
        import asyncio

        aloop = asyncio.get_running_loop()
        i = 0
        while True:
            with self._cond:
                if i < len(self._events):
                    event, fut = self._events[i], None
                else:
                    event, fut = None, aloop.create_future()
                    self._waiters.append((aloop, fut))
            if fut is not None:
                await fut
                continue
            i += 1
            yield event
            if event.finished:
                return

    def result(self, timeout: float | None = None) -> RequestOutput:
        """The output once the request finished. :raises TimeoutError: not within ``timeout``."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._output is not None, timeout):
                raise TimeoutError(f"request {self.request_id} did not finish in {timeout} s")
            return self._output

    async def result_async(self) -> RequestOutput:
        """:meth:`result` for asyncio."""
        async for _ in self:
            pass
        return self._output

    def abort(self) -> None:
        """Same as ``EngineLoop.abort(handle.request_id)``."""
        self._loop.abort(self.request_id)

    def add_done_callback(self, fn: Callable[[RequestHandle], None]) -> None:
        """Call ``fn(handle)`` once the request finished (at once if it has); it runs on the
        engine loop's thread."""
        with self._cond:
            if self._output is None:
                self._callbacks.append(fn)
                return
        fn(self)

    # -- the loop's side ----------------------------------------------------------------------
    def _push(self, event: RequestEvent, output: RequestOutput | None = None) -> None:
        with self._cond:
            self._events.append(event)
            if output is not None:
                self._output = output
            waiters, self._waiters = self._waiters, []
            callbacks = self._callbacks if output is not None else []
            self._cond.notify_all()
        for aloop, fut in waiters:
            try:
                aloop.call_soon_threadsafe(_wake, fut)
            except RuntimeError:  # that event loop is closed: nobody is waiting any more
                pass
        for fn in callbacks:
            try:
                fn(self)
            except Exception:  # a caller's bug must not stop the engine for everyone
                logging.getLogger("polyspec.engine").exception("a done callback failed")


def _wake(fut) -> None:
    if not fut.done():
        fut.set_result(None)


@dataclasses.dataclass
class _Running:
    """The loop's view of a submitted request."""

    req: Request
    handle: RequestHandle
    text: TextStream
    stream: bool = True
    sent_tokens: int = 0  # handed out in events
    counted: int = 0  # counted in the totals


class EngineLoop:
    """A background thread that owns ``llm``'s scheduler; ``submit`` / ``abort`` / ``stats`` are
    safe from any thread and never wait for a step. ``max_queued_requests``: the most requests
    that may wait for admission (None: no limit); more raise :class:`QueueFull` at once.

    An LLM has one loop at a time: this one becomes ``llm.engine`` (which ``LLM.generate``
    uses); building a second while the first is not shut down raises ``RuntimeError``."""

    def __init__(self, llm: LLM, *, max_queued_requests: int | None = None):
        if max_queued_requests is not None and (
            not isinstance(max_queued_requests, int) or max_queued_requests < 1
        ):
            raise ValueError(
                f"max_queued_requests = {max_queued_requests!r} is invalid: a positive integer "
                "or None"
            )
        with llm._engine_lock:  # one loop per LLM: two would drive one scheduler
            other = llm._engine
            if other is not None and not other._stopping:
                raise RuntimeError(
                    "this LLM already has an engine loop (llm.engine); use it, or shut it down "
                    "first (llm.shutdown())"
                )
            llm._engine = self
        # What the loop uses of the LLM, not the LLM itself: no reference cycle, so a dropped
        # LLM is freed at once (its KV pools with it), not at the next garbage collection.
        self.scheduler = llm.scheduler
        self.worker = llm.worker
        self._has_tokenizer = llm.tokenizer is not None
        self._ids = llm._ids
        self.max_queued_requests = max_queued_requests
        self._lock = threading.Condition()
        self._inbox: list[_Running] = []
        self._aborts: list[int] = []
        self._running: dict[int, _Running] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._deadline: float | None = None
        self._dead: str | None = None  # why the loop stopped on an error
        self._vocab_size = int(llm.target.config.vocab_size)
        self._totals = Counter()
        self._finished = Counter()
        self._hist: Counter = Counter()
        self._step_time = 0.0
        # The scheduler's and the worker's counters run since they were built (a warm-up may
        # have run on an earlier loop): this loop's totals start from here.
        self._rounds0 = llm.scheduler.rounds
        self._phase0 = dict(llm.worker.timer.seconds)

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the loop's thread if it is not running (:meth:`submit` does this). The thread
        ends whenever no request is left, and the next submit starts another."""
        with self._lock:
            if self._thread is not None:
                return
            if self._stopping:
                raise RuntimeError("this engine loop was shut down; make a new one")
            self._spawn()

    def _spawn(self) -> None:  # with self._lock held and no thread driving the loop
        self._thread = threading.Thread(target=self._main, name=_THREAD_NAME, daemon=True)
        self._thread.start()

    def drive(self, done: Callable[[], bool], *, keep_alive: bool = False) -> None:
        """Run the loop's steps on the calling thread until ``done()`` is true, unless another
        thread drives the loop already (then return at once: that thread serves this caller's
        requests too). Requests left when ``done()`` turns true (other callers') go on in the
        loop's own thread. ``keep_alive``: when no request is left, wait for the next one
        (checking ``done()`` every 0.2 s) instead of returning; a server's main thread drives
        this way.

        Why a caller lends its thread: every thread that runs torch's CPU kernels keeps its own
        OpenMP team, and once the teams' threads outnumber the cores libgomp stops spinning
        between parallel regions, so on a machine with few cores the model runs about half as
        fast on a second thread as on the one that built it (docs/configuration.md, "Engine
        loop"). :meth:`LLM.generate` and ``polyspec serve`` drive the loop this way. A loop that
        fails here fails as on its own thread: every request ends with the error, and the
        exception reaches this caller."""
        me = threading.current_thread()
        with self._lock:
            if self._thread is not None or self._dead is not None:
                return
            self._thread = me
        try:
            while not done() and self._one_step(keep_alive):
                pass
        except BaseException as exc:
            self._fail(exc)
            raise
        finally:
            with self._lock:
                if self._thread is me:
                    self._thread = None
                    if self._dead is None and (
                        self._inbox or self._aborts or self.scheduler.has_work or self._stopping
                    ):
                        self._spawn()
                self._lock.notify_all()

    def shutdown(self, grace_s: float = 0.0) -> None:
        """Stop admitting, let running requests finish for up to ``grace_s`` seconds, abort the
        rest (waiting ones included), and join the thread."""
        with self._lock:
            self._stopping = True
            self._deadline = time.monotonic() + max(grace_s, 0.0)
            thread = self._thread
            self._lock.notify_all()
        if thread is not None and thread is not threading.current_thread():
            if thread.name == _THREAD_NAME:
                thread.join()
            else:  # a caller drives: wait until it has handed the loop back
                with self._lock:
                    self._lock.wait_for(lambda: self._thread is not thread)
                if self._thread is not None:
                    self._thread.join()
        elif thread is None:  # not running: abort what was queued
            self._abort_all("abort")

    @property
    def alive(self) -> bool:
        """Whether the loop's thread runs now (it runs while requests are in the engine)."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    # -- requests ------------------------------------------------------------------------------
    def submit(
        self,
        prompt_token_ids: Any,
        params: SamplingParams | None = None,
        *,
        prompt: str | None = None,
        stream: bool = True,
        start: bool = True,
    ) -> RequestHandle:
        """Queue one request; -> its handle. ``params`` None: ``SamplingParams()``; ``prompt``:
        the text the ids came from (kept in the output). ``stream=False``: one event, the
        final one, with every token and the whole text (no per-round detokenization: what a
        caller that only wants the result should ask for). ``start=False``: do not start the
        loop's thread; the caller will :meth:`drive` the loop (or submit more first).

        :raises RequestError: the request is invalid (nothing was queued).
        :raises QueueFull: ``max_queued_requests`` requests wait already.
        :raises RuntimeError: the loop was shut down or stopped on an error."""
        params = SamplingParams() if params is None else params
        ids = self.check(prompt_token_ids, params)
        with self._lock:
            if self._dead is not None:
                raise RuntimeError(f"the engine loop stopped on an error: {self._dead}")
            if self._stopping:
                raise RuntimeError("the engine loop is shut down; it takes no new requests")
            if self.max_queued_requests is not None:
                waiting = len(self._inbox) + len(self.scheduler.waiting)
                if waiting >= self.max_queued_requests:
                    raise QueueFull(
                        f"{waiting} requests wait for admission (max_queued_requests = "
                        f"{self.max_queued_requests}); retry later"
                    )
            rid = next(self._ids)
            handle = RequestHandle(rid, self)
            req = Request(rid, prompt, ids, params)
            self._inbox.append(_Running(req, handle, TextStream(self.scheduler.stop), stream))
            self._lock.notify_all()
        if start:
            self.start()
        return handle

    def check(self, prompt_token_ids: Any, params: SamplingParams) -> list[int]:
        """What :meth:`submit` checks, without submitting; -> the prompt as a list of ints.

        :raises RequestError: naming the field, the value and what is allowed."""
        return check_request(
            prompt_token_ids,
            params,
            vocab_size=self._vocab_size,
            has_tokenizer=self._has_tokenizer,
            scheduler=self.scheduler,
        )

    def abort(self, request_id: int) -> None:
        """Finish the request with ``finish_reason == "abort"`` before the next step (its KV
        is freed then); unknown or finished ids are ignored."""
        with self._lock:
            self._aborts.append(request_id)
            self._lock.notify_all()

    def stats(self) -> EngineStats:
        """A snapshot; taken while a step runs, the running / waiting counts and KV slots may
        be that step's, the totals the last finished step's."""
        sched = self.scheduler
        worker = self.worker
        with self._lock:
            hist = dict(sorted(self._hist.items()))
            depth = max(hist, default=1) - 1
            per_pos = [sum(n for length, n in hist.items() if length > i + 1) for i in range(depth)]
            free = worker.allocator.available
            return EngineStats(
                running=len(sched.prefilling) + len(sched.decoding),
                waiting=len(sched.waiting) + len(self._inbox),
                kv_slots_used=worker.num_kv_slots - worker.allocator.page_size - free,
                kv_slots_free=free,
                prompt_tokens_total=self._totals["prompt"],
                generation_tokens_total=self._totals["generation"],
                requests_finished_total=dict(self._finished),
                rounds_total=sched.rounds - self._rounds0,
                steps_total=self._totals["steps"],
                acceptance_length_histogram=hist,
                accepted_per_position=per_pos,
                step_time_s_total=self._step_time,
                phase_time_s_total={
                    k: v - self._phase0.get(k, 0.0) for k, v in worker.timer.seconds.items()
                },
            )

    # -- the loop's thread ---------------------------------------------------------------------
    def _main(self) -> None:
        try:
            while self._one_step():
                pass
        except BaseException as exc:
            self._fail(exc)
            raise

    def _fail(self, exc: BaseException) -> None:
        """A bug in the loop itself (or Ctrl-C inside a step): nobody may wait forever."""
        cause = f"{type(exc).__name__}: {exc}"
        with self._lock:
            self._dead = cause
        self._abort_all("error", cause)

    def _one_step(self, keep_alive: bool = False) -> bool:
        """Take new requests and aborts, run one step; False once shut down and drained, or
        idle unless ``keep_alive`` (then wait up to 0.2 s for work and return True)."""
        sched = self.scheduler
        with self._lock:
            if keep_alive and not (self._inbox or self._aborts or sched.has_work or self._stopping):
                self._lock.wait(0.2)
                return True
            if not (self._inbox or self._aborts or sched.has_work or self._stopping):
                # Idle: the thread ends, so that it does not keep the LLM (and its KV pools)
                # alive once its user drops it; the next submit starts a new one.
                self._thread = None
                return False
            new, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
            stopping = self._stopping
            past_deadline = stopping and time.monotonic() >= self._deadline
        for run in new:
            self._running[run.req.rid] = run
            if stopping:
                run.req.finish_reason = "abort"
                self._emit(run)
                continue
            try:
                sched.add(run.req)
            except Exception as exc:  # checked at submit; a config change since is a bug
                sched.fail([run.req], exc)
                self._emit(run)
        for rid in aborts:
            run = self._running.get(rid)
            if run is not None and sched.abort(rid) is not None:
                self._emit(run)
        if stopping and (past_deadline or not sched.has_work):
            for req in list(sched.waiting) + sched.prefilling + sched.decoding:
                sched.abort(req.rid)
            self._emit_all()
            return False
        if stopping:  # admission is over: what still waits is aborted
            for req in list(sched.waiting):
                sched.abort(req.rid)
        if sched.has_work:
            t0 = time.perf_counter()
            sched.step()
            with self._lock:
                self._step_time += time.perf_counter() - t0
                self._totals["steps"] += 1
        self._emit_all()
        return True

    def _emit_all(self) -> None:
        # A running request that streams nothing until it ends only adds to the totals:
        # counted here under one lock a step, not one a request (at batch 256 the per-request
        # lock was the largest host cost of a round).
        quiet, new_tokens = [], 0
        for run in list(self._running.values()):
            req = run.req
            if run.stream or req.finished:
                self._emit(run)
                continue
            n = len(req.output_ids)
            if n != run.counted:
                new_tokens += n - run.counted
                quiet.append((run, n))
        if new_tokens:
            with self._lock:
                self._totals["generation"] += new_tokens
            for run, n in quiet:
                run.counted = n

    def _emit(self, run: _Running) -> None:
        """Hand ``run`` its new tokens and stable text, if any (a request submitted with
        ``stream=False`` only its final event); finish its handle if done."""
        req = run.req
        n = len(req.output_ids)
        if n == run.counted and not req.finished:
            return
        with self._lock:
            self._totals["generation"] += n - run.counted
            if req.finished:
                self._finished[req.finish_reason] += 1
                self._hist.update(req.accepted_per_round)
                self._totals["prompt"] += len(req.prompt_ids)
        run.counted = n
        if not req.finished and not run.stream:
            return
        new_ids = req.output_ids[run.sent_tokens :]
        run.sent_tokens = n
        text = run.text.advance(req)
        event = RequestEvent(
            token_ids=list(new_ids),
            text=text,
            finished=req.finished,
            finish_reason=req.finish_reason,
            error=req.error,
        )
        if req.finished:
            self._running.pop(req.rid, None)
            run.handle._push(event, self._output(run))
        else:
            run.handle._push(event)

    def _output(self, run: _Running) -> RequestOutput:
        r = run.req
        rounds = r.accepted_per_round
        end = r.finish_time or time.perf_counter()
        stats = RequestStats(
            accepted_per_round=list(rounds),
            num_rounds=len(rounds),
            mean_acceptance_length=sum(rounds) / len(rounds) if rounds else 0.0,
            time_s=end - r.arrival,
            time_to_first_token_s=(r.first_token_time or r.arrival) - r.arrival,
        )
        return RequestOutput(
            request_id=r.rid,
            prompt=r.prompt,
            prompt_token_ids=r.prompt_ids,
            text=run.text.sent,
            token_ids=list(r.output_ids),
            finish_reason=r.finish_reason or "abort",
            stats=stats,
            error=r.error,
        )

    def _abort_all(self, reason: str, cause: str | None = None) -> None:
        """Finish every request this loop knows with ``reason`` (the loop is not running)."""
        with self._lock:
            pending = self._inbox + list(self._running.values())
            self._inbox = []
            self._running = {}
        for run in pending:
            if not run.req.finished:
                run.req.finish_reason, run.req.error = reason, cause
            try:
                self._emit(run)
            except Exception:  # the failure may be the tokenizer's: end the wait regardless
                event = RequestEvent([], "", True, run.req.finish_reason, run.req.error)
                run.handle._push(event, self._output(run))
