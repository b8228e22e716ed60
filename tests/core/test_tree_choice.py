"""Choosing a draft tree from measured forward costs (polyspec.engine.tree_choice)."""

from __future__ import annotations

import pytest

from polyspec.config import SpeculativeConfig, TreeCandidate
from polyspec.engine.tree_choice import (
    DEEPER_MARGIN,
    FINALISTS,
    SPEC_MARGIN,
    ForwardCosts,
    batch_report,
    batch_schedule,
    choose_timed,
    choose_tree,
    deeper,
    disturbed,
    finalists,
    monotone,
    report,
    round_work,
    still_timed,
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


# -- trees by batch size, from timed rounds --------------------------------------------------


def _round_s(bs: int, per_token: float) -> dict[str, float]:
    """Round times at batch ``bs`` on a device whose target forward costs 1 unit up to 64
    tokens and ``per_token`` a token beyond (launch-bound, then compute-bound), and whose
    draft forward costs a tenth of that: a plain round is the target's forward over the
    root, a tree's round its verify over N tokens a request and S draft forwards over K."""

    def forward(tokens: int) -> float:
        return 1.0 + per_token * max(0, tokens - 64)

    out = {"plain": forward(bs)}
    for c in CANDIDATES:
        out[c.label] = forward(bs * c.num_draft_tokens) + 0.1 * c.num_steps * forward(bs * c.topk)
    return out


def test_plain_rounds_are_chosen_where_their_time_makes_them_faster():
    # acceptance 1.9 / 2.5 / 3.0 per round against 1 token: a tree wins while it costs less
    # than that many plain rounds, plain once the batch makes every token count
    seconds = {bs: _round_s(bs, 0.05) for bs in (1, 4, 16, 64, 256)}
    schedule = batch_schedule(CANDIDATES, seconds, 256)
    labels = [(bs, "plain" if c is None else c.label) for bs, c in schedule]
    assert labels[0][0] == 1 and labels[0][1] != "plain"
    assert labels[-1][1] == "plain", labels
    plain_from = labels[-1][0]
    assert 16 < plain_from <= 64, labels  # N = 3 tokens a request fill 64 from batch 22
    # rates: the schedule's option is the best at every timed size
    for bs, times in seconds.items():
        chosen = next(c for b, c in reversed(schedule) if b <= bs)
        best = max(times, key=lambda label: _rate(label, bs, times[label]))
        if bs > 1:
            assert ("plain" if chosen is None else chosen.label) == best, (bs, labels)


def _rate(label: str, bs: int, seconds: float) -> float:
    acc = {c.label: c.acceptance for c in CANDIDATES}.get(label, 1.0)
    return acc * bs / seconds


def test_batch_one_runs_a_tree_and_costs_are_interpolated():
    # plain faster at every timed size: batch 1 still runs the best tree
    seconds = {1: {"plain": 1.0, CANDIDATES[0].label: 10.0}, 8: {"plain": 1.0}}
    schedule = batch_schedule(CANDIDATES, seconds, 16)
    assert [(b, c if c is None else c.label) for b, c in schedule] == [
        (1, CANDIDATES[0].label),
        (2, None),
    ]
    # a tree timed at 4 and 8: plain takes over between them, where the interpolated times
    # cross (1.9 / t(tree) = 1 / t(plain): t(tree) 1.5 at 4, 2.4 at 8 -> 1.725 at 5, 1.95 at 6)
    c = CANDIDATES[0]
    seconds = {
        1: {"plain": 1.0, c.label: 1.2},
        4: {"plain": 1.0, c.label: 1.5},
        8: {"plain": 1.0, c.label: 2.4},
    }
    schedule = batch_schedule(CANDIDATES, seconds, 12)
    assert [(b, x if x is None else x.label) for b, x in schedule] == [(1, c.label), (6, None)]


def test_a_tree_must_beat_plain_rounds_by_the_margin():
    # predicted 5 % above plain rounds at batch 8: plain (a thin gain is not taken); 15 %
    # above: the tree; batch 1 runs the tree either way
    c = CANDIDATES[0]
    assert SPEC_MARGIN == 0.10
    for gain, want in ((1.05, None), (1.15, c.label)):
        t = c.acceptance / gain  # its round time for that predicted gain over plain's 1.0
        seconds = {1: {"plain": 1.0, c.label: t}, 8: {"plain": 1.0, c.label: t}}
        schedule = batch_schedule([c], seconds, 8)
        got = [(b, x if x is None else x.label) for b, x in schedule]
        assert got == ([(1, c.label)] if want else [(1, c.label), (2, None)]), (gain, got)


def test_trees_beaten_by_a_lighter_option_are_not_timed_again():
    a, b, c = CANDIDATES  # work 2-1-3: 3 + 1 + 3 = 7; 3-3-8: 8 + 6 + 4 = 18; 5-4-16: 38
    assert [round_work(x) for x in (None, a, b, c)] == [1, 7, 18, 38]
    # b beats a, c loses to b: c is dropped, a stays (nothing lighter beats it)
    times = {"plain": 1.0, a.label: 1.0, b.label: 1.0, c.label: 1.5}
    assert still_timed(CANDIDATES, times, 8) == [a, b]
    # plain beats them all by more than the margin: nothing is timed at larger batches
    times = {"plain": 1.0, a.label: 2.5, b.label: 3.0, c.label: 4.0}
    assert still_timed(CANDIDATES, times, 8) == []
    # within the margin (2 %): kept
    times = {"plain": 1.0, a.label: 1.9 * 1.02}
    assert still_timed([a], times, 8) == [a]


def test_batch_report_and_note():
    seconds = {bs: _round_s(bs, 0.05) for bs in (1, 4, 16, 64)}
    schedule = batch_schedule(CANDIDATES, seconds, 64)
    choice = batch_report(CANDIDATES, seconds, schedule, 2.345, None)
    assert choice["timed_batch_sizes"] == [1, 4, 16, 64]
    assert choice["predicted_speedup"]["64"]["plain"] == 1.0
    assert choice["by_batch_size"][-1][1] == "plain"
    note = tree_note(choice)
    assert "from batch" in note and "plain" in note and "1, 4, 16, 64" in note
    stopped = tree_note(
        batch_report(CANDIDATES, seconds, schedule, 5.1, "the 5 s budget was spent")
    )
    assert "timing stopped early: the 5 s budget was spent" in stopped


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_an_engine_of_captured_rounds_times_them_by_batch_size(tiny_models, monkeypatch, overlap):
    """Where rounds replay graphs (``graphs = "on"`` on the cpu backend: the captured path
    through an eager runner), the engine times the recommended trees' rounds (the main tree
    and ``batch_trees``') and plain rounds at batch 1 and 4 at start-up and runs its choice per
    batch size: the worker's trees are the configured ones, its rounds as named in the report,
    and the output is plain greedy's. With ``overlap_rounds`` the timed rounds are runs of
    rounds each queued behind the last, as the engine runs them, the round queued after a
    run's last dropped before the next run."""
    from polyspec.config import SamplingParams
    from polyspec.engine import tree_choice
    from polyspec.engine.llm import LLM
    from polyspec.spec.base import WorkerBase

    def llm(spec=None, draft=None):
        return LLM(
            target=tiny_models["target"], draft=draft, speculative=spec, backend="cpu",
            dtype="float32", max_batch_size=4, max_context=256, graphs="on",
            overlap_rounds=overlap,
        )  # fmt: skip

    calls = {"lookahead": 0, "dropped": 0}
    decode, drop = WorkerBase.decode, WorkerBase.drop_queued

    def counted_decode(self, rids, lookahead=False, plain=False):
        calls["lookahead"] += lookahead
        return decode(self, rids, lookahead, plain)

    def counted_drop(self):
        calls["dropped"] += self._queued is not None
        drop(self)

    monkeypatch.setattr(WorkerBase, "decode", counted_decode)
    monkeypatch.setattr(WorkerBase, "drop_queued", counted_drop)
    spec = SpeculativeConfig("eagle3", 3, 3, 8, tree_candidates=CANDIDATES, batch_trees="2:5-4-16")
    engine = llm(spec, tiny_models["eagle3"])
    choice = engine.tree_choice
    runs = sum(len(times) for times in choice["round_ms"].values()) * (2 + 3)
    if overlap == "on":  # every run: its first round and the timed ones queue the next
        assert calls["lookahead"] == runs * (1 + tree_choice.OVERLAPPED_ROUNDS), calls
        assert calls["dropped"] == runs, calls
    else:
        assert calls == {"lookahead": 0, "dropped": 0}, calls
    monkeypatch.undo()
    assert choice["timed_batch_sizes"][0] == 1 and set(choice["timed_batch_sizes"]) <= {1, 4}
    assert set(choice["round_ms"]["1"]) == {"plain", "S=3 K=3 N=8", "S=5 K=4 N=16"}
    got = engine.config.speculative
    labels = [label for _, label in choice["by_batch_size"]]
    assert [t.label for t in got.batch_trees] == labels[1:]
    assert [t.label for _, t in engine.worker.trees] == labels
    assert all(n == 0 for n in engine.worker.rounds_by_tree.values())  # timing rounds left out
    assert "chosen for this machine by timing" in tree_note(choice)
    prompts = [[5, 9, 30, 7], [40, 41], [3, 3, 3, 8, 9], [100, 7]]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (9, 7, 5, 3)]
    want = llm().generate(prompt_token_ids=prompts, sampling_params=params)
    outs = engine.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]


def test_deeper_candidates_are_those_accepting_clearly_more():
    main = CANDIDATES[1]  # S=3 K=3 N=8, 2.5
    assert deeper(CANDIDATES, [main]) == [CANDIDATES[2]]  # 3.0 > 2.5 * 1.05
    close = TreeCandidate(4, 3, 10, 2.6)  # 2.6 < 2.625: not worth a capture at start-up
    assert deeper((*CANDIDATES, close), [main]) == [CANDIDATES[2]]
    assert deeper(CANDIDATES, [main, CANDIDATES[2]]) == []
    assert DEEPER_MARGIN == 0.05


def test_captured_rounds_time_the_deeper_candidates_too(tiny_models):
    """Where rounds replay graphs, the engine times at start-up the head's recommended tree
    and the candidates that accept clearly more than it (here S=5 K=4 N=16 besides the
    recommended S=3 K=3 N=8; not the chain S=2 K=1 N=3), against plain rounds, and its
    output is plain greedy's whichever it runs."""
    from polyspec.config import SamplingParams
    from polyspec.engine.llm import LLM

    def llm(spec=None, draft=None):
        return LLM(
            target=tiny_models["target"], draft=draft, speculative=spec, backend="cpu",
            dtype="float32", max_batch_size=2, max_context=256, graphs="on",
        )  # fmt: skip

    spec = SpeculativeConfig("eagle3", 3, 3, 8, tree_candidates=CANDIDATES)
    engine = llm(spec, tiny_models["eagle3"])
    assert set(engine.tree_choice["round_ms"]["1"]) == {"plain", "S=3 K=3 N=8", "S=5 K=4 N=16"}
    assert "the rounds of 2 trees and plain rounds" in tree_note(engine.tree_choice)
    prompts = [[5, 9, 30, 7], [40, 41]]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (9, 6)]
    want = llm().generate(prompt_token_ids=prompts, sampling_params=params)
    outs = engine.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]


def test_deeper_candidates_are_timed_after_the_others_in_a_budget_of_their_own(
    tiny_models, monkeypatch
):
    """The recommended trees and plain rounds are timed first, at every batch size, in
    ROUND_BUDGET_S; the deeper candidates after them in DEEPER_BUDGET_S: with that budget
    spent at once, the others' timing is whole, the deeper tree is never timed nor run, and
    the note says why."""
    from polyspec.engine import tree_choice
    from polyspec.engine.llm import LLM

    monkeypatch.setattr(tree_choice, "DEEPER_BUDGET_S", 0.0)
    spec = SpeculativeConfig("eagle3", 3, 3, 8, tree_candidates=CANDIDATES)
    engine = LLM(
        target=tiny_models["target"], draft=tiny_models["eagle3"], speculative=spec,
        backend="cpu", dtype="float32", max_batch_size=2, max_context=256, graphs="on",
    )  # fmt: skip
    choice = engine.tree_choice
    assert set(choice["round_ms"]["1"]) == {"plain", "S=3 K=3 N=8"}
    assert all("S=5 K=4 N=16" not in times for times in choice["round_ms"].values())
    assert "S=5 K=4 N=16" not in [label for _, label in choice["by_batch_size"]]
    assert choice["stopped"] == "the deeper trees' timing: the 0 s budget was spent"


def test_trees_timed_and_not_chosen_are_not_captured_by_a_warm_up(tiny_models):
    """A warm-up captures the rounds of the trees the engine runs for the batch sizes that
    run them; the rounds of a tree timed at start-up and not chosen are not among the
    computations it records (at batch 1 only one tree runs; two were timed). Plain rounds
    come back with the warm-up's constrained requests, which may run them at any size."""
    from polyspec.engine.llm import LLM

    spec = SpeculativeConfig("eagle3", 3, 3, 8, tree_candidates=CANDIDATES)
    engine = LLM(
        target=tiny_models["target"], draft=tiny_models["eagle3"], speculative=spec,
        backend="cpu", dtype="float32", max_batch_size=1, max_context=256, graphs="on",
    )  # fmt: skip
    worker, graphs = engine.worker, engine.worker.graphs
    assert set(engine.tree_choice["round_ms"]["1"]) == {"plain", "S=3 K=3 N=8", "S=5 K=4 N=16"}
    (chosen,) = [t for _, t in worker.trees]
    timed = {tree for tree, _, _ in worker._rounds}
    assert chosen in timed and len(timed) == 3  # the two trees and plain rounds
    before = graphs.num_captured
    engine.warm_up()
    assert {name for name, _, _ in graphs.captured} >= {worker.round_fn(chosen, True).__name__}
    for (tree, _, _), fn in worker._rounds.items():
        if tree != chosen and tree.num_steps > 0:
            assert fn.__name__ not in graphs.names
            assert all(name != fn.__name__ for name, _, _ in graphs.captured[before:])


def test_eager_finalists_are_decided_by_their_timed_rounds():
    """The prediction ranks the candidates; the FINALISTS best predicted are timed as whole
    rounds, and the one of the most tokens per second (acceptance over its round) runs,
    even where the prediction put another first. None timed: no choice from timings."""
    costs = _costs(0.05)
    best = finalists(CANDIDATES, costs)  # best predicted first
    assert [c.label for c in best] == ["S=3 K=3 N=8", "S=2 K=1 N=3", "S=5 K=4 N=16"]
    assert FINALISTS == 3
    round_s = {"plain": 1.0, "S=3 K=3 N=8": 2.0, "S=5 K=4 N=16": 2.2, "S=2 K=1 N=3": 1.1}
    assert choose_timed(best, round_s) == CANDIDATES[0]  # 1.9 / 1.1 beats 2.5 / 2.0, 3.0 / 2.2
    assert choose_timed(best, {"plain": 1.0}) is None
    choice = report(CANDIDATES, costs, CANDIDATES[0], round_s)
    assert choice["measured_speedup"] == {
        "S=3 K=3 N=8": 1.25, "S=5 K=4 N=16": round(3.0 / 2.2, 3), "S=2 K=1 N=3": round(1.9 / 1.1, 3)
    }  # fmt: skip
    assert "then the rounds of the 3 predicted fastest (1.73x plain rounds" in tree_note(choice)
