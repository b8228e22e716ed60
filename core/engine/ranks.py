"""Rank 0 drives, the other ranks follow: the engine side of tensor parallelism.

Rank 0 owns the tokenizer, the scheduler and the engine loop (and, with ``polyspec serve``,
the HTTP side). Its scheduler talks to a :class:`LeaderWorker`, which hands each call that
changes the worker's state (``add_request``, ``prefill``, ``decode``, ``remove_request``) to
every other rank before running it itself; each other rank runs :func:`follow`, which makes the
same call on its own worker. So every rank runs the same rounds on the same inputs, and the
models' collectives pair up.

Token decisions: every rank decides for itself, identically. The logits every rank samples
and verifies from are the same (all-gathered, after layers whose all-reduces give every rank
the same sum), each request's random stream is the same (rank 0 sends its generator's state
with the request), and the draft head is replicated; so every rank's tree, acceptance and
tokens are the same, without a broadcast of tokens inside the round (which would be one more
collective per round, and one inside captured rounds). That it holds is checked, not assumed:
after every call the ranks exchange whether it returned and a digest of what it decided
(:meth:`TPGroup.agree`), and a rank that raised alone, broke a collective or decided other
tokens stops every rank with :class:`RankFailure` naming it. A call that raises on every rank
alike (a request that cannot run) fails only its requests, as without tensor parallelism.
"""

from __future__ import annotations

import logging
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

import torch

from polyspec.errors import RankFailure
from polyspec.parallel.group import (
    STATUS_BROKEN,
    STATUS_OK,
    STATUS_RAISED,
    TPGroup,
    is_collective_failure,
)
from polyspec.runtime.sampling import RequestSampler

_log = logging.getLogger("polyspec.engine")

_STOP = "stop"
_CALLS = ("add_request", "prefill", "decode", "remove_request")

_joined: TPGroup | None = None
"""The group a rank rank 0 spawned joined before building its engine (one per process)."""

REPORT_WAIT_S = 3.0
"""How long rank 0 waits, after a collective broke, for the failed rank's report (or its
process's exit) so that the error can name it."""


def joined_group() -> TPGroup | None:
    """The group this process joined as a spawned rank, if it is one."""
    return _joined


def _sampler_spec(s: RequestSampler) -> tuple[float, int, float, torch.Tensor | None]:
    """What another rank needs to rebuild ``s``: its settings and its generator's state."""
    state = None if s.generator is None else s.generator.get_state()
    return (s.temperature, s.top_k, s.top_p, state)


def _sampler(spec: tuple[float, int, float, torch.Tensor | None], device) -> RequestSampler:
    temperature, top_k, top_p, state = spec
    gen = None
    if state is not None:
        gen = torch.Generator(device=device)
        gen.set_state(state)
    return RequestSampler(temperature, top_k, top_p, gen)


def _digest(result: Any) -> int:
    """A digest of a call's result (tokens decided) that is the same in every process."""
    if result is None:
        return 0
    if isinstance(result, dict):
        return hash(tuple(sorted(result.items())))
    return hash(tuple(tuple(t) for t in result))


def _run(tp: TPGroup, worker: Any, name: str, args: tuple) -> tuple[int, Any, BaseException | None]:
    """Run one call on this rank's worker: (status, result, exception). A call that failed
    here closes this rank's model group first (:meth:`TPGroup.close_model_group`): a peer
    waiting for this rank inside a forward's collective then fails at once, and every rank
    reaches :meth:`TPGroup.agree`, where the failure is named."""
    try:
        return STATUS_OK, getattr(worker, name)(*args), None
    except Exception as exc:
        status = STATUS_BROKEN if is_collective_failure(exc) else STATUS_RAISED
        tp.close_model_group()
        return status, None, exc


def _settle(
    tp: TPGroup, name: str, votes: list[tuple[int, int]], exc: BaseException | None
) -> None:
    """After every rank's (status, digest) of call ``name``: return when all returned and
    agree, re-raise ``exc`` when all raised alike, else :class:`RankFailure`."""
    statuses = [s for s, _ in votes]
    if all(s == STATUS_OK for s in statuses):
        lead = votes[0][1]
        differ = [r for r, (_, d) in enumerate(votes) if d != lead]
        if not differ:
            return
        raise RankFailure(
            f"rank(s) {', '.join(map(str, differ))} decided other tokens than rank 0 in "
            f"{name}: the ranks' logits are not the same (a collective that does not give "
            "every rank the same sum)"
        )
    if all(s == STATUS_RAISED for s in statuses) and exc is not None:
        # The same request error everywhere: those requests fail, the engine goes on, over a
        # model group every rank opens anew (each closed its own when the call raised).
        tp.reopen_model_group()
        raise exc
    culprits = [r for r, s in enumerate(statuses) if s == STATUS_RAISED] or [
        r for r, s in enumerate(statuses) if s != STATUS_OK
    ]
    raise _failure(tp, culprits, f"in {name}", exc)


def _failure(
    tp: TPGroup, culprits: Sequence[int], where: str, exc: BaseException | None
) -> RankFailure:
    """A :class:`RankFailure` naming the failed ranks and their causes."""
    mine = None if exc is None else f"{type(exc).__name__}: {exc}".splitlines()[0]
    causes = {r: mine for r in culprits if r == tp.rank and mine}
    others = [r for r in culprits if r != tp.rank] or None
    deadline = time.monotonic() + REPORT_WAIT_S
    while True:  # a dead rank's report or exit code may lag the broken socket a little
        causes.update(tp.failures(others))
        if causes or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    if not causes:
        return RankFailure(
            f"rank {tp.rank}: a collective failed {where} ({mine}); no rank reported a cause: "
            "one may hang or have been killed"
        )
    text = "; ".join(f"rank {r} failed: {c}" for r, c in sorted(causes.items()))
    return RankFailure(f"{text} ({where}; every rank stops)")


class LeaderWorker:
    """Rank 0's worker: every state-changing call goes to the other ranks first, then runs
    here; everything else is the worker's own (``__getattr__``)."""

    def __init__(self, worker: Any, tp: TPGroup) -> None:
        self._worker = worker
        self._tp = tp
        self._stopped = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._worker, name)

    def add_request(
        self,
        rid: int,
        prompt: Sequence[int],
        sampler: RequestSampler,
        kv_reserved: int | None = None,
        max_new_tokens: int | None = None,
    ) -> None:
        """:meth:`WorkerBase.add_request` on every rank (the sampler travels as its state)."""
        shipped = (rid, list(prompt), _sampler_spec(sampler), kv_reserved, max_new_tokens)
        local = (rid, prompt, sampler, kv_reserved, None, max_new_tokens)
        return self._call("add_request", shipped, local)

    def prefill(self, rids: Sequence[int], ends: Sequence[int]) -> dict[int, int]:
        """The worker's prefill on every rank; -> rank 0's first tokens."""
        args = (list(rids), list(ends))
        return self._call("prefill", args, args)

    def decode(
        self, rids: Sequence[int], lookahead: bool = False, plain: bool = False
    ) -> list[list[int]]:
        """One decode round on every rank (the same kind on each: ``plain`` travels too);
        -> rank 0's new tokens per request."""
        args = (list(rids), bool(lookahead), bool(plain))
        return self._call("decode", args, args)

    def remove_request(self, rid: int) -> None:
        """:meth:`WorkerBase.remove_request` on every rank."""
        return self._call("remove_request", (rid,), (rid,))

    def _call(self, name: str, shipped: tuple, local: tuple) -> Any:
        tp = self._tp
        if self._stopped:
            raise RankFailure("the other ranks have stopped; build a new engine")
        try:
            tp.send((name, shipped))
        except Exception as exc:
            self._stopped = True
            raise _failure(tp, [], f"sending {name}", exc) from None
        status, result, exc = _run(tp, self._worker, name, local)
        try:
            votes = tp.agree(status, _digest(result))
        except Exception as agree_exc:
            self._stopped = True
            raise _failure(tp, [], f"after {name}", exc or agree_exc) from None
        try:
            _settle(tp, name, votes, exc)
        except RankFailure:
            self._stopped = True
            raise
        return result

    def stop(self) -> None:
        """Tell the other ranks to leave their loop (once; a no-op after a failure)."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self._tp.send((_STOP, ()))
        except Exception:  # they are gone already
            pass


def follow(worker: Any, tp: TPGroup) -> None:
    """A rank other than 0: make rank 0's calls on ``worker`` until it says stop.

    :raises RankFailure: rank 0 went away, or the ranks fell out of step (after reporting
        this rank's cause in the store, for rank 0 to name)."""
    while True:
        try:
            name, args = tp.receive()
        except Exception as exc:
            raise RankFailure(f"rank {tp.rank}: rank 0 went away ({exc})") from None
        if name == _STOP:
            return
        if name not in _CALLS:
            raise RankFailure(f"rank {tp.rank}: unknown command {name!r} from rank 0")
        if name == "add_request":
            rid, prompt, spec, reserved, max_new = args
            args = (rid, prompt, _sampler(spec, worker.device), reserved, None, max_new)
        status, result, exc = _run(tp, worker, name, args)
        try:
            votes = tp.agree(status, _digest(result))
        except Exception as agree_exc:
            raise RankFailure(f"rank {tp.rank}: rank 0 went away ({agree_exc})") from None
        try:
            _settle(tp, name, votes, exc)
        except RankFailure:
            if exc is not None:  # for rank 0 to name this rank's cause
                tp.report_failure(f"{type(exc).__name__}: {exc}".splitlines()[0])
            raise
        except Exception:  # failed alike on every rank: rank 0 fails those requests
            continue


def spawned_rank_main(
    index: int, port: int, config: Any, dist_backend: str, timeout_s: float
) -> None:
    """Entry point of a rank rank 0 spawned (``torch.multiprocessing``; rank ``index + 1``):
    join, build the same engine (this rank's part of the model), follow rank 0."""
    global _joined
    from polyspec.engine.llm import LLM
    from polyspec.parallel.launch import join_spawned, leave

    rank = index + 1
    tp = None
    try:
        tp = join_spawned(rank, config.tensor_parallel_size, port, dist_backend, timeout_s)
        _joined = tp
        llm = LLM(config=config)
        llm.follow()
    except KeyboardInterrupt:  # Ctrl-C reaches every rank of the terminal's process group
        sys.exit(130)
    except BaseException as exc:
        text = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
        if tp is not None:
            tp.report_failure(text)
        print(f"polyspec: rank {rank}: {text}", file=sys.stderr)
        _log.debug("rank %d failed", rank, exc_info=exc)
        if not isinstance(exc, RankFailure):
            traceback.print_exc()
        sys.exit(1)
    finally:
        leave()
