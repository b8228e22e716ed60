"""Choosing a draft tree from measured forward costs (polyspec.engine.tree_choice)."""

from __future__ import annotations

import pytest

from polyspec.config import SpeculativeConfig, TreeCandidate
from polyspec.engine.tree_choice import (
    ForwardCosts,
    choose_tree,
    disturbed,
    monotone,
    tree_note,
    widths,
)
from polyspec.errors import ConfigError

CANDIDATES = (
    TreeCandidate(2, 1, 3, 1.9),
    TreeCandidate(3, 3, 8, 2.5),
    TreeCandidate(5, 4, 16, 3.0),
)


def _costs(per_token: float) -> ForwardCosts:
    """Target forwards cost 1 + per_token * (w - 1) units (0: verify width is free, as on an
    accelerator at batch 1; 1: every token costs a step, a compute-bound CPU); a draft forward
    0.1 whatever its width."""
    target = {w: 1.0 + per_token * (w - 1) for w in (1, 3, 8, 16)}
    return ForwardCosts(target, dict.fromkeys((1, 3, 4, 6), 0.1))


def test_round_time_and_speedup_follow_the_formula():
    costs = _costs(0.5)
    c = CANDIDATES[1]  # S=3 K=3 N=8: target(8) + 2 draft(3) + draft(4)
    assert costs.round_s(c) == pytest.approx(4.5 + 0.3)
    assert costs.speedup(c) == pytest.approx(2.5 * 1.0 / 4.8)


def test_the_choice_follows_the_cost_of_verify_width():
    # free width: the deepest tree (most tokens per round) wins; cheap: the middle one;
    # costly width: the chain
    assert choose_tree(CANDIDATES, _costs(0.0)) == CANDIDATES[2]
    assert choose_tree(CANDIDATES, _costs(0.05)) == CANDIDATES[1]
    assert choose_tree(CANDIDATES, _costs(0.3)) == CANDIDATES[0]


def test_a_narrow_width_timed_above_a_wider_one_is_disturbed():
    # a measured outlier (ms, a Zen 1 at de76fda): a 2-token target forward timed like a 3-token one
    best = {1: 25.2, 2: 32.4, 3: 32.1, 4: 36.8, 8: 71.9}
    assert disturbed(best) == [2]
    assert disturbed({1: 2.75, 2: 2.62, 3: 3.3}) == [1]  # draft widths: 1 above 2
    assert disturbed({1: 1.0, 2: 1.0, 3: 2.0}) == []  # equal is in order
    assert monotone(best) == {1: 25.2, 2: 32.1, 3: 32.1, 4: 36.8, 8: 71.9}
    assert monotone({1: 3.0, 2: 2.0, 4: 5.0}) == {1: 2.0, 2: 2.0, 4: 5.0}


def test_widths_cover_every_candidate():
    target, draft = widths(CANDIDATES)
    assert target == [1, 3, 8, 16]
    assert draft == [1, 3, 4, 6]  # K = 1, 3, 4 and S + 1 = 3, 4, 6


def test_note_names_the_choice():
    costs = _costs(0.3)
    from polyspec.engine.tree_choice import report

    note = tree_note(report(CANDIDATES, costs, CANDIDATES[0]))
    assert "S=2 K=1 N=3" in note and "3 candidates" in note


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(num_steps=2, topk=1, num_draft_tokens=5, acceptance=2.0), "num_draft_tokens"),
        (dict(num_steps=2, topk=2, num_draft_tokens=4, acceptance=3.5), "acceptance"),
        (dict(num_steps=2, topk=2, num_draft_tokens=4, acceptance="2"), "acceptance"),
    ],
)
def test_a_bad_candidate_is_a_config_error(bad, match):
    with pytest.raises(ConfigError, match=match):
        SpeculativeConfig("eagle3", tree_candidates=[bad])
    with pytest.raises(ConfigError, match="auto_tree"):
        SpeculativeConfig("eagle3", auto_tree="yes")
