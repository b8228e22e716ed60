"""Acceptance and phase-time statistics from the engine's per-request stats."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

SPEC_PHASES = ("draft", "verify", "draft_extend", "other")
"""Phases of a speculative round in reports; "other" folds in accept (commit + KV compaction)."""


def all_rounds(accepted_per_request: Sequence[Sequence[int]]) -> list[int]:
    """Every decode round of every request, pooled: tokens committed per round (accepted + 1)."""
    return [n for rounds in accepted_per_request for n in rounds]


def mean_acceptance_length(rounds: Sequence[int]) -> float:
    """Mean tokens committed per round over all rounds (0.0 when there are none)."""
    return sum(rounds) / len(rounds) if rounds else 0.0


def position_acceptance(rounds: Sequence[int], num_steps: int) -> list[float]:
    """Entry d-1 = fraction of rounds that accepted at least d draft tokens, d = 1..num_steps.

    A round committing n tokens accepted n - 1 draft tokens (the last one is the bonus)."""
    if not rounds:
        return [0.0] * num_steps
    return [sum(1 for n in rounds if n - 1 >= d) / len(rounds) for d in range(1, num_steps + 1)]


def acceptance_histogram(rounds: Sequence[int], max_length: int) -> dict[int, int]:
    """Number of rounds committing each length 1..max_length (lengths above are clamped)."""
    counts = Counter(min(n, max_length) for n in rounds)
    return {n: counts.get(n, 0) for n in range(1, max_length + 1)}


def spec_phase_fractions(seconds: Mapping[str, float]) -> dict[str, float]:
    """Share of the speculative run's timed work per reported phase: the round's draft,
    verify and draft extend, the prompts' prefill, and everything else (sums to 1; zeros
    when untimed)."""
    grouped = {
        "draft": seconds.get("draft", 0.0),
        "verify": seconds.get("verify", 0.0),
        "draft_extend": seconds.get("draft_extend", 0.0),
        "prefill": seconds.get("prefill", 0.0),
    }
    grouped["other"] = sum(seconds.values()) - sum(grouped.values())
    total = sum(grouped.values())
    return {k: (v / total if total > 0 else 0.0) for k, v in grouped.items()}


def speedup(numerator_tps: float | None, denominator_tps: float | None) -> float | None:
    """Ratio of two throughputs; None when either is missing or zero."""
    if not numerator_tps or not denominator_tps:
        return None
    return numerator_tps / denominator_tps
