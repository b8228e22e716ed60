"""One request's grammar state: the tokens it has committed, and the masks of what may come
next, at its newest token or at any node of a draft tree below it (walked with rollback)."""

from __future__ import annotations

import time
from collections.abc import Sequence
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
    the mask of the token after it, :meth:`fill_paths` the masks after draft paths below it."""

    def __init__(self, ll_matcher: Any, vocab_size: int):
        self._m = ll_matcher
        self.vocab_size = vocab_size
        self._next: np.ndarray | None = None  # the next token's mask, until the next advance
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
        (all of them unless the grammar completed first; what follows is not output).
        :raises ConstraintViolation: the grammar refuses a token."""
        self._next = None
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
            if self._m.is_error() or not (out.any() or self._m.is_stopped()):
                raise self._dead_end()
            self._next = out
        return self._next

    def fill_paths(
        self,
        paths: Sequence[Sequence[int]],
        out: np.ndarray,  # [R, W] int32
        rows: Sequence[int],
    ) -> list[bool]:
        """The mask after each of ``paths`` (draft tokens below the newest committed token)
        into ``out[rows[k]]``, with one matcher walked from path to path: each path rolls
        back to the prefix it shares with the one before and consumes only the rest, so
        paths given depth first (a tree's, or sorted lanes) cost one consume and one mask
        per node, not one consume per token of every path. -> per path: False, its row left
        alone, when the grammar refuses a token of it or is complete before its end (a node
        no output can reach: the caller allows every token there, since verification never
        accepts it). The state is rolled back to the committed tokens at the end."""
        m = self._m
        held: list[int] = []  # draft tokens consumed beyond the committed ones
        dead: list[int] | None = None  # the shortest unreachable prefix of the last failure
        ok: list[bool] = []
        for path, row in zip(paths, rows):
            if dead is not None and path[: len(dead)] == dead:
                ok.append(False)  # below a node no output reaches
                continue
            common = 0
            for a, b in zip(held, path):
                if a != b:
                    break
                common += 1
            if common < len(held):
                m.rollback(len(held) - common)
                del held[common:]
            rest = path[common:]
            if rest:
                taken = m.try_consume_tokens(rest)
                held += rest[:taken]
                if taken < len(rest):
                    dead = list(path[: common + taken + 1])
                    ok.append(False)
                    continue
            if m.is_stopped():  # complete at this node: nothing follows it
                dead = list(path)
                ok.append(False)
                continue
            self._compute(out[row])
            good = bool(out[row].any())
            if not good:
                dead = list(path)
            ok.append(good)
        if held:
            m.rollback(len(held))
        return ok

    def fill_after(self, path: Sequence[int], out: np.ndarray) -> bool:  # out [W] int32
        """The mask after one ``path`` (:meth:`fill_paths` of one path)."""
        return self.fill_paths([list(path)], out[None, :], [0])[0]

    def _compute(self, out: np.ndarray) -> None:
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
