"""One request's grammar state: the tokens it has committed, and the masks of what may come
next, at its newest token or at any node of a draft tree below it (walked with rollback)."""

from __future__ import annotations

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

    The newest committed token (a round's root) is always consumed: :meth:`fill` gives the
    mask of the token after it, :meth:`fill_after` the mask after a draft path below it."""

    def __init__(self, ll_matcher: Any, vocab_size: int):
        self._m = ll_matcher
        self.vocab_size = vocab_size
        self._next: np.ndarray | None = None  # the next token's mask, until the next advance

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
        for i, t in enumerate(tokens):
            if self._m.is_stopped():
                return i
            if not self._m.consume_token(int(t)):
                raise ConstraintViolation(
                    f"the grammar refused token {int(t)}: {self._m.get_error() or 'not allowed'}"
                )
        return len(tokens)

    def next_mask(self) -> np.ndarray:  # [W] int32
        """The mask of the next token (computed once per advance; the scheduler asks first,
        so that a dead end fails its request alone, and the round reuses it).
        :raises ConstraintViolation: the grammar is not complete and no token of the
        vocabulary can continue it."""
        if self._next is None:
            out = np.zeros(mask_width(self.vocab_size), dtype=np.int32)
            self._compute(out)
            if self._m.is_error() or not (out.any() or self._m.is_stopped()):
                raise self._dead_end()
            self._next = out
        return self._next

    def fill_after(self, path: Sequence[int], out: np.ndarray) -> bool:  # out [W] int32
        """The mask after ``path`` (draft tokens below the newest committed one), the state
        rolled back afterwards -> False, with ``out`` left alone, when the grammar refuses a
        token of the path or is complete before its end (a node no output can reach: the
        caller allows every token there, since verification never accepts it)."""
        taken = self._m.try_consume_tokens([int(t) for t in path])
        ok = taken == len(path) and not self._m.is_stopped()
        if ok:
            self._compute(out)
            ok = bool(out.any())
        if taken:
            self._m.rollback(taken)
        return ok

    def _compute(self, out: np.ndarray) -> None:
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
