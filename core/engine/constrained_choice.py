"""Speculative or plain rounds for a batch with a constrained request
(``EngineConfig.constrained_speculation``).

A constrained speculative round builds token masks on the host for the draft lanes and the
tree's nodes of each constrained request (docs/structured-output.md), and cannot be queued
behind the last round; a plain round builds one mask a request, and its forward is queued
behind the last round where rounds are overlapped. Which of the two gives
more tokens a second depends on the grammar, the head's acceptance under it, the host's
CPUs and how fast the device is (docs/benchmarks.md, "Structured output"). ``auto`` therefore
measures: for each range of batch sizes (1, 2-3, 4-7, ...) the first ``probe`` rounds
speculate and the next ``probe`` are plain, then the kind with more tokens per second of its
rounds runs; every ``window`` rounds the other kind is measured again (the text and the
grammar's state change as requests go on), the older measurements of the kind in use counting
half. A speculative round right after plain rounds is not measured: it first catches the
draft up over the plain rounds' tokens (a draft extend), a cost paid once a switch, which
would make every speculative round look slower if the kinds alternated round by round. Nor
is a plain round right after speculative ones: with ``overlap_rounds`` each plain round's
forward is queued behind the round before, and the first one's is not. A round's time is
the scheduler's: the wall time from the end of the round before (the host's work between
rounds included), or from its own start after a prefill.
Either kind gives the same greedy output; sampled output follows the target's distribution
either way.
"""

from __future__ import annotations

import dataclasses

from polyspec.config import CONSTRAINED_SPECULATION_MODES


@dataclasses.dataclass
class _Kind:
    rounds: int = 0
    tokens: float = 0.0
    seconds: float = 0.0

    def rate(self) -> float:  # tokens a second
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclasses.dataclass
class _Range:
    spec: _Kind = dataclasses.field(default_factory=_Kind)
    plain: _Kind = dataclasses.field(default_factory=_Kind)
    since_probe: int = 0  # rounds since both kinds were last measured


class ConstrainedChoice:
    """Whether the next round of a batch with a constrained request runs plain."""

    def __init__(self, mode: str = "auto", probe: int = 4, window: int = 256):
        """``mode``: "on" (speculative rounds), "off" (plain rounds) or "auto" (measured).
        ``probe``: rounds of each kind measured before choosing; ``window``: rounds between
        two measurements of the kind not in use."""
        if mode not in CONSTRAINED_SPECULATION_MODES:
            raise ValueError(
                f"constrained_speculation must be one of {CONSTRAINED_SPECULATION_MODES}"
            )
        self.mode = mode
        self.probe = probe
        self.window = window
        self.forced: bool | None = None  # set: every round plain (True) or speculative
        self._last_plain = False  # the kind of the last constrained round (any batch size)
        self._ranges: dict[int, _Range] = {}

    @staticmethod
    def _key(bs: int) -> int:
        return bs.bit_length()  # 1, 2-3, 4-7, 8-15, ...

    def plain(self, bs: int) -> bool:
        """Whether the next constrained round of ``bs`` requests runs plain."""
        if self.forced is not None:
            return self.forced
        if self.mode != "auto":
            return self.mode == "off"
        r = self._ranges.setdefault(self._key(bs), _Range())
        if r.spec.rounds < self.probe:  # speculative rounds measured first (or again)
            return False
        if r.plain.rounds < self.probe:
            return True
        return r.plain.rate() > r.spec.rate()

    def record(self, bs: int, plain: bool, tokens: int, seconds: float) -> None:
        """A constrained round of ``bs`` requests (``plain`` or speculative) committed
        ``tokens`` in ``seconds`` of wall time."""
        if self.mode != "auto" or self.forced is not None:
            return
        after_plain, self._last_plain = self._last_plain, plain
        if plain != after_plain:  # a switch: not a steady round (whatever the batch size of
            return  # the rounds before it): the draft's catch-up, or an unqueued forward
        r = self._ranges.setdefault(self._key(bs), _Range())
        kind = r.plain if plain else r.spec
        kind.rounds += 1
        kind.tokens += tokens
        kind.seconds += seconds
        r.since_probe += 1
        if r.since_probe >= self.window:  # measure the other kind again
            r.since_probe = 0
            used, other = (r.plain, r.spec) if r.plain.rate() > r.spec.rate() else (r.spec, r.plain)
            used.tokens, used.seconds = used.tokens / 2, used.seconds / 2
            other.rounds, other.tokens, other.seconds = 0, 0.0, 0.0

    def rates(self) -> dict[int, tuple[float, float]]:
        """Tokens a second of (speculative, plain) constrained rounds, by range of batch sizes
        (keyed by the smallest size of the range)."""
        return {
            1 << (k - 1): (r.spec.rate(), r.plain.rate()) for k, r in sorted(self._ranges.items())
        }
