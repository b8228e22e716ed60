"""The engine's choice of speculative or plain rounds for a batch with a constrained request
(``EngineConfig.constrained_speculation``, ``polyspec.engine.constrained_choice``)."""

from __future__ import annotations

import pytest

from polyspec.config import EngineConfig
from polyspec.engine.constrained_choice import ConstrainedChoice
from polyspec.errors import ConfigError


def _run(choice: ConstrainedChoice, bs: int, rounds: int, spec_rate: float, plain_rate: float):
    """``rounds`` constrained rounds of ``bs`` requests, each committing what its kind's rate
    gives in 1 ms -> the kinds run, in order (True: plain)."""
    kinds = []
    for _ in range(rounds):
        plain = choice.plain(bs)
        kinds.append(plain)
        choice.record(bs, plain, round((plain_rate if plain else spec_rate) * 1e-3), 1e-3)
    return kinds


def test_on_and_off_do_not_measure():
    for mode, plain in (("on", False), ("off", True)):
        choice = ConstrainedChoice(mode)
        assert _run(choice, 4, 10, 3000, 1000) == [plain] * 10
        assert choice.rates() == {}


def test_auto_probes_both_then_runs_the_faster():
    choice = ConstrainedChoice("auto", probe=2, window=100)
    kinds = _run(choice, 4, 10, spec_rate=3000, plain_rate=1000)
    # speculative rounds first, then plain ones (the first after the switch not measured)
    assert kinds[:5] == [False, False, True, True, True]
    assert kinds[5:] == [False] * 5
    choice = ConstrainedChoice("auto", probe=2, window=100)
    assert _run(choice, 4, 10, spec_rate=1000, plain_rate=3000)[5:] == [True] * 5
    assert choice.rates() == {4: (1000.0, 3000.0)}


def test_auto_measures_each_range_of_batch_sizes_apart():
    choice = ConstrainedChoice("auto", probe=1, window=100)
    _run(choice, 2, 4, spec_rate=3000, plain_rate=1000)  # sizes 2-3: speculation faster
    _run(choice, 9, 4, spec_rate=1000, plain_rate=3000)  # sizes 8-15: plain faster
    assert not choice.plain(3) and choice.plain(15)
    assert set(choice.rates()) == {2, 8}


def test_auto_measures_the_other_kind_again_and_follows_a_change():
    choice = ConstrainedChoice("auto", probe=2, window=8)
    kinds = _run(choice, 1, 9, spec_rate=3000, plain_rate=1000)  # probes, then speculation
    assert kinds == [False, False, True, True, True, False, False, False, False]
    # (the first round after each switch is not measured: 7 rounds so far)
    # the window is over after one more: plain rounds are measured again (after the switch),
    # now faster; they take over
    kinds = _run(choice, 1, 8, spec_rate=2000, plain_rate=4000)
    assert kinds == [False] + [True] * 7
    assert choice.rates()[1][1] == 4000.0


def test_a_speculative_round_after_plain_rounds_is_not_measured():
    """It catches the draft up over the plain rounds' tokens first: timed, that switch would
    count against every speculative round measured after plain ones."""
    choice = ConstrainedChoice("auto", probe=2, window=100)
    for plain in (False, False, True, True, True):  # (the first plain one is not measured)
        choice.record(1, plain, 2 if not plain else 1, 1e-3)
    # speculation is back: its first round is slow (the catch-up), then steady
    choice.record(1, False, 2, 5e-3)
    choice.record(1, False, 2, 1e-3)
    assert choice.rates() == {1: (2000.0, 1000.0)}
    assert not choice.plain(1)
    # the same after plain rounds of another batch size (the request's draft is behind)
    choice.record(5, True, 1, 1e-3)
    choice.record(2, False, 2, 5e-3)
    assert 2 not in choice.rates()


def test_a_plain_round_after_speculative_rounds_is_not_measured():
    """With ``overlap_rounds`` each plain round's forward is queued behind the round before;
    the first plain round after speculative ones has none queued."""
    choice = ConstrainedChoice("auto", probe=2, window=100)
    for plain, seconds in ((False, 1e-3), (False, 1e-3), (True, 4e-3), (True, 1e-3)):
        choice.record(1, plain, 2 if not plain else 1, seconds)
    assert choice.rates() == {1: (2000.0, 1000.0)}
    assert choice.plain(1)  # one plain round measured of the two the probe needs


def test_forced_overrides_and_is_not_measured():
    choice = ConstrainedChoice("auto", probe=1)
    choice.forced = True
    assert _run(choice, 4, 3, 3000, 1000) == [True] * 3
    choice.forced = None
    assert choice.rates() == {} and not choice.plain(4)


def test_modes_are_checked():
    with pytest.raises(ValueError, match="constrained_speculation"):
        ConstrainedChoice("sometimes")
    with pytest.raises(ConfigError, match="constrained_speculation"):
        EngineConfig(constrained_speculation="sometimes")
