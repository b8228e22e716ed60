"""Plain rounds by load: where the draft trees put plain rounds from some batch size on, a
smaller batch runs plain rounds too while the requests in flight (decoding, prefilling,
waiting; up to max_batch_size) would fill it, and speculates once they would not."""

from __future__ import annotations

import random

import pytest

from polyspec.config import SamplingParams, SpeculativeConfig
from polyspec.engine.llm import LLM
from polyspec.testing.builders import build_tiny_target

PLAIN_FROM = 4  # batch_trees "4:plain"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_target(tmp_path_factory.mktemp("load") / "t", seed=3)


def _workload():
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(30, 60))] for _ in range(12)]
    params = [SamplingParams(max_new_tokens=rng.randint(10, 40), ignore_eos=True) for _ in prompts]
    return prompts, params


def _run(target, max_batch_size: int, graphs: str = "off", speculative: bool = True):
    """-> (each decode round's (batch size, requests in flight, ran plain, was the round
    queued by the call before), outputs, llm)."""
    spec = None
    if speculative:
        spec = SpeculativeConfig(
            algorithm="standalone", num_steps=2, topk=1, num_draft_tokens=3,
            batch_trees=f"{PLAIN_FROM}:plain",
        )  # fmt: skip
    llm = LLM(
        target=str(target), draft=str(target) if speculative else None, speculative=spec,
        backend="cpu", dtype="float32", max_batch_size=max_batch_size, max_context=256,
        max_tokens_per_step=16, prefill_chunk_size=8, graphs=graphs,
        overlap_rounds="on" if graphs == "on" else "off",
    )  # fmt: skip
    sched, worker = llm.scheduler, llm.worker
    rounds = []
    real = worker.decode

    def decode(rids, lookahead=False, plain=False):
        before, used = dict(worker.rounds_by_tree), worker.queued_rounds["used"]
        in_flight = len(rids) + len(sched.prefilling) + len(sched.waiting)
        out = real(rids, lookahead=lookahead, plain=plain)
        ran = [k for k, v in worker.rounds_by_tree.items() if v != before.get(k, 0)]
        queued = worker.queued_rounds["used"] > used
        rounds.append((len(rids), in_flight, ran == ["plain"], queued))
        return out

    worker.decode = decode
    prompts, params = _workload()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    return rounds, [o.token_ids for o in outs], llm


@pytest.fixture(scope="module")
def plain_outputs(tiny):
    return _run(tiny, 8, speculative=False)[1]


@pytest.mark.parametrize("graphs", ["off", "on"])
def test_small_batches_run_plain_while_the_requests_in_flight_fill_a_plain_batch(
    tiny, plain_outputs, graphs
):
    """A batch below 4 runs plain rounds while 4 or more requests are in flight (the ramp-up
    of 12 prompts prefilled 8 to 16 tokens a step), and speculates when fewer are (the drain);
    greedy outputs equal plain decoding's. With graphs and overlap on, the plain rounds by
    load replay graphs at those small sizes and queue behind each other, and the warm-up
    captures the plain round's graph from batch 1."""
    rounds, outs, llm = _run(tiny, 8, graphs)
    assert outs == plain_outputs
    small = [r for r in rounds if r[0] < PLAIN_FROM]
    assert any(load >= PLAIN_FROM for _, load, _, _ in small), "no ramp-up: nothing tested"
    assert any(load < PLAIN_FROM for _, load, _, _ in small), "no drain: nothing tested"
    for n, load, plain, _ in small:
        assert plain == (load >= PLAIN_FROM), (n, load, plain)
    assert all(plain for n, _, plain, _ in rounds if n >= PLAIN_FROM)
    if graphs == "on":
        by_load = [queued for _, _, plain, queued in small if plain]
        assert len(by_load) > 2 and all(by_load[1:]), small  # each queued by the one before
        graphs = llm.worker.graphs
        plain_sizes = {bs for name, bs, _ in graphs.captured if name == "round_greedy@plain"}
        assert min(plain_sizes) < PLAIN_FROM, plain_sizes
        llm.warm_up()
        plain_sizes = {bs for name, bs, _ in graphs.captured if name == "round_greedy@plain"}
        assert graphs.buckets.batch_bucket(1) in plain_sizes, plain_sizes


def test_a_batch_capped_below_the_plain_size_always_speculates(tiny, plain_outputs):
    """With max_batch_size 3 the requests in flight count up to 3 only: every round
    speculates, however many wait."""
    rounds, outs, _ = _run(tiny, 3)
    assert outs == plain_outputs
    assert rounds and not any(plain for _, _, plain, _ in rounds)
