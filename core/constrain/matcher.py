"""One request's grammar state: the tokens it has committed, and the masks of what may come
next, at its newest token or at any node of a draft tree below it (a forked copy); and the
greedy walk's single-token verdicts and early commits."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


class ConstraintViolation(RuntimeError):
    """A committed token the grammar refuses, or a state from which no token can follow (the
    vocabulary cannot spell what the grammar needs)."""


def mask_width(vocab_size: int) -> int:
    """int32 words of a bitmask over ``vocab_size`` tokens (bit ``t % 32`` of word ``t // 32``
    set: token ``t`` allowed)."""
    return (vocab_size + 31) // 32


class Matcher:
    """An llguidance matcher of one request, advanced by the tokens the request commits.

    The newest committed token (a round's root) is always consumed: :meth:`next_mask` gives
    the mask of the token after it, :meth:`fork` the grammar's state after a draft path below
    it, whose mask :func:`fill_masks` computes (many at once, on llguidance's threads)."""

    def __init__(self, ll_matcher: Any, vocab_size: int, executor: Any = None):
        """``executor``: an ``llguidance.LLExecutor`` (the engine's, :func:`next_masks` and
        :func:`fill_masks` compute on its threads); None: one mask at a time."""
        self._m = ll_matcher
        self.vocab_size = vocab_size
        self.executor = executor
        self._next: np.ndarray | None = None  # the next token's mask, until the next advance
        # The tokens the grammar forces next and the mask after them (a constrained round's
        # draft levels, :meth:`lookahead`), until the next commit (None: not computed)
        self._forced: tuple[int, ...] | None = None
        self._after_forced: np.ndarray | None = None
        self._after_known = False
        # Tokens a greedy round's walk (:meth:`walk`) committed ahead of the round's result,
        # which :meth:`advance` then checks instead of committing them again; and whether
        # the walk ended the output (the grammar complete, or no token allowed after them).
        self._ahead: list[int] | None = None
        self._ahead_final = False
        # host seconds in advance and next_mask since the last take_seconds (the scheduler
        # calls them between rounds; the next round's mask time counts them)
        self._seconds = 0.0

    def take_seconds(self) -> float:
        """Host seconds spent committing tokens and computing the next mask since the last
        call."""
        seconds, self._seconds = self._seconds, 0.0
        return seconds

    @property
    def done(self) -> bool:
        """The grammar is complete and admits no further token (the request stops here)."""
        return self._m.is_stopped() and not self._m.is_error()

    def _dead_end(self) -> ConstraintViolation:
        reason = self._m.get_error().strip().splitlines()
        return ConstraintViolation(
            "no token of the vocabulary can continue the output under this constraint"
            + (f" (llguidance: {reason[0]})" if reason else "")
        )

    def advance(self, tokens: Sequence[int]) -> int:
        """Commit ``tokens`` up to the one that completes the grammar -> how many were taken
        (all of them unless the grammar completed first; what follows is not output). After
        a greedy round's walk (:meth:`walk`), which committed them already, checks that they
        are the walk's.
        :raises ConstraintViolation: the grammar refuses a token."""
        if self._ahead is not None:
            return self._check_ahead(tokens)
        self._reset()
        start = time.perf_counter()
        try:
            for i, t in enumerate(tokens):
                if self._m.is_stopped():
                    return i
                if not self._m.consume_token(int(t)):
                    raise ConstraintViolation(
                        f"the grammar refused token {int(t)}: "
                        f"{self._m.get_error() or 'not allowed'}"
                    )
            return len(tokens)
        finally:
            self._seconds += time.perf_counter() - start

    def next_mask(self) -> np.ndarray:  # [W] int32
        """The mask of the next token (computed once per advance; the scheduler asks first,
        so that a dead end fails its request alone, and the round reuses it).
        :raises ConstraintViolation: the grammar is not complete and no token of the
        vocabulary can continue it."""
        if self._next is None:
            start = time.perf_counter()
            out = np.zeros(mask_width(self.vocab_size), dtype=np.int32)
            self._compute(out)
            self._seconds += time.perf_counter() - start
            if not self._continues(out):
                raise self._dead_end()
            self._next = out
        return self._next

    def _reset(self) -> None:
        """A token is committed: what was computed for the state before it is stale."""
        self._next, self._forced, self._after_forced = None, None, None
        self._after_known = False

    def forced_tokens(self) -> tuple[int, ...]:
        """The tokens the grammar forces next, in order (llguidance's canonical tokens of the
        bytes it forces, ~3 us; empty where the next token is free): the only tokens its
        masks allow, one after another. Computed once per commit."""
        if self._forced is None:
            start = time.perf_counter()
            self._forced = tuple(int(t) for t in self._m.compute_ff_tokens())
            self._seconds += time.perf_counter() - start
        return self._forced

    def lookahead(self, depth: int) -> tuple[tuple[int, ...], np.ndarray | None]:
        """The draft's view of the next ``depth`` tokens: the forced tokens (at most
        ``depth``), and where fewer are forced, the mask of the free token after them (None:
        ``depth`` are forced, or no output continues after them). The mask is computed once
        per commit; :func:`next_masks` computes a batch's with their next masks."""
        forced = self.forced_tokens()[:depth]
        if not forced or len(forced) == depth:
            return forced, None
        if not self._after_known:
            next_masks([self], depth)
        return forced, self._after_forced

    def _after_forced_state(self, depth: int) -> Any | None:
        """The grammar's state after the forced tokens, where :meth:`lookahead` ``(depth)``
        needs its mask and it is not known yet (for :func:`next_masks`); else None."""
        if self._after_known:
            return None
        forced = self.forced_tokens()[:depth]
        if not forced or len(forced) == depth:
            return None
        self._after_known = True
        start = time.perf_counter()
        state = self.fork(forced)
        self._seconds += time.perf_counter() - start
        return state

    def _continues(self, mask: np.ndarray) -> bool:  # [W] int32, the next token's
        """Whether the grammar can go on: some token allowed, or complete."""
        return not self._m.is_error() and (bool(mask.any()) or self._m.is_stopped())

    def allows(self, token: int) -> bool:
        """Whether the grammar allows ``token`` next, without the mask (~1 us against ~50):
        the mask's bit wherever :meth:`forced` is False. Where the grammar forces bytes,
        llguidance's mask allows only the tokens that spell them canonically (after
        ``{"`` of a schema with a key ``title``: ``title``, not ``t`` or ``ti``), which
        this allows too."""
        return self._m.validate_tokens([int(token)]) == 1

    def forced(self) -> bool:
        """Whether the grammar forces the next bytes (its mask is then narrower than
        :meth:`allows`)."""
        return bool(self._m.compute_ff_bytes())

    def mask_now(self) -> np.ndarray:  # [W] int32
        """The mask of the next token at the state the walk has reached (not kept; the
        walk's time counts it)."""
        out = np.zeros(mask_width(self.vocab_size), dtype=np.int32)
        self._compute(out)
        return out

    def walk(self, token: int) -> bool:
        """Commit ``token``, which a greedy round will output, before the round's result is
        read (:meth:`~polyspec.constrain.RoundMasks.greedy_walk`, where :meth:`allows` or
        the mask chose it) -> whether the grammar goes on after it (False: complete)."""
        if self._ahead is None:
            self._ahead, self._ahead_final = [], False
        self._reset()
        if not self._m.consume_token(int(token)):
            raise ConstraintViolation(f"the grammar refused token {int(token)} it allowed")
        self._ahead.append(int(token))
        if self._m.is_stopped():
            self._ahead_final = True
        return not self._ahead_final

    @property
    def walk_ended(self) -> bool:
        """The walk of the round in flight ended the output: the grammar is complete, or no
        token could follow (:meth:`walk`, :meth:`end_walk`)."""
        return self._ahead is not None and self._ahead_final

    def end_walk(self) -> None:
        """The walk stops at a state where no token is allowed: the round's next token (the
        device's unmasked choice) is not output, and :meth:`next_mask` raises."""
        if self._ahead is None:
            self._ahead = []
        self._ahead_final = True

    def _check_ahead(self, tokens: Sequence[int]) -> int:
        ahead, final = self._ahead, self._ahead_final
        self._ahead, self._ahead_final = None, False
        n = len(ahead)
        if [int(t) for t in tokens[:n]] != ahead or (len(tokens) != n and not final):
            raise RuntimeError(
                f"the round's tokens {list(tokens)} are not its grammar walk's {ahead}"
            )
        return n

    def fork(self, path: Sequence[int]) -> Any | None:
        """A copy of the grammar's state after ``path`` (draft tokens below the newest
        committed one), for :func:`fill_masks`; None at a node no output can reach: the
        grammar refuses a token of the path, or is complete before its end (the caller
        allows every token there, since verification never accepts one)."""
        state = self._m.deep_copy()
        if state.try_consume_tokens(list(path)) < len(path) or state.is_stopped():
            return None
        return state

    def _compute(self, out: np.ndarray) -> None:
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)


def greedy_choice(
    allowed: Callable[[int], bool],  # whether the grammar allows a token at the node
    values: Sequence[float],  # [C] the target's C largest logits at the node, descending
    ids: Sequence[int],  # [C] their tokens
) -> int | None:
    """The token greedy decoding under the grammar takes (the argmax of the masked logits:
    the lowest id among the allowed tokens of the largest value), read off the target's top
    C where they settle it; None where they do not (no token of them is allowed, or the
    allowed value ties with the C-th, so tokens past the C may tie it too)."""
    for j, token in enumerate(ids):
        if allowed(token):
            best = values[j]
            if best == values[-1]:
                return None
            return min(t for v, t in zip(values[j:], ids[j:]) if v == best and allowed(t))
    return None


def allowed_by(mask: np.ndarray) -> Callable[[int], bool]:  # [W] int32
    """Whether ``mask`` allows a token (its bit), as :func:`greedy_choice` asks."""
    words = mask.view(np.uint32)
    return lambda token: bool((words[token >> 5] >> np.uint32(token & 31)) & np.uint32(1))


def masked_argmax(
    mask: np.ndarray,  # [W] int32, the grammar's mask (some token allowed)
    logits: np.ndarray,  # [V] the target's logits
) -> int:
    """The lowest id among the allowed tokens of the largest logit (as the device's argmax
    of the masked logits)."""
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[: len(logits)].astype(bool)
    return int(np.argmax(np.where(bits, logits, -np.inf)))


def fill_masks(
    executor: Any,
    states: Sequence[tuple[Any, int]],  # (a state of Matcher.fork or a matcher's, row of out)
    out: np.ndarray,  # [R, W] int32, C-contiguous
) -> None:
    """Each state's next-token mask into its row of ``out``: in parallel on ``executor``'s
    threads (an ``llguidance.LLExecutor``), else one after another."""
    if not states:
        return
    if executor is None:
        for state, row in states:
            state.unsafe_compute_mask_ptr(out[row].ctypes.data, out[row].nbytes)
        return
    assert out.flags.c_contiguous and out.dtype == np.int32
    executor.unsafe_compute_mask_ptr(list(states), out.ctypes.data, out[0].nbytes, out.shape[0])


def next_masks(matchers: Sequence[Matcher], lookahead: int = 0) -> None:
    """Compute the next masks of ``matchers`` that have none yet in one parallel call (a
    batch's, between rounds, or while the device finishes a greedy round whose tokens the
    walk committed); each :meth:`Matcher.next_mask` then returns its own, or raises for its
    request alone. ``lookahead``: in the same call, the mask after the forced tokens of
    each one that needs it for a draft of that many levels (:meth:`Matcher.lookahead`)."""
    jobs: list[tuple[Matcher, Any, bool]] = []  # (matcher, state, whether its next mask)
    for m in matchers:
        if m.done:
            continue
        if m._next is None:
            jobs.append((m, m._m, True))
        if lookahead:
            state = m._after_forced_state(lookahead)
            if state is not None:
                jobs.append((m, state, False))
    if not jobs:
        return
    start = time.perf_counter()
    out = np.zeros((len(jobs), mask_width(jobs[0][0].vocab_size)), dtype=np.int32)
    # a single one on this thread (a dispatch to the executor costs more than it saves)
    executor = jobs[0][0].executor if len(jobs) > 1 else None
    fill_masks(executor, [(state, i) for i, (_, state, _) in enumerate(jobs)], out)
    share = (time.perf_counter() - start) / len(jobs)
    for (m, _, is_next), row in zip(jobs, out):
        m._seconds += share
        if not is_next:
            if row.any():  # else no output continues after the forced tokens
                m._after_forced = row
        elif m._continues(row):
            m._next = row  # a dead end is left to its next_mask, which computes and raises
