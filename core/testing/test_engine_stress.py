"""Continuous batching under churn: hundreds of mixed requests, no KV slot leaks, and every
request's output equals what it produces alone under plain greedy decoding."""

from __future__ import annotations

import dataclasses
import importlib.util
import random

import pytest

from polyspec.config import SamplingParams, SpeculativeConfig
from polyspec.testing.forward import assert_greedy_equal
from polyspec.testing.plugin import (
    NATIVE_PAGE_SIZE,
    default_page_size,
    require,
    resolve_page_size,
)


def _mixed_requests(n: int, seed: int = 7):
    rng = random.Random(seed)
    prompts, params = [], []
    for _ in range(n):
        prompts.append([rng.randrange(3, 250) for _ in range(rng.randint(1, 40))])
        stop_ids = tuple(rng.sample(range(3, 250), rng.choice([0, 0, 3, 20])))
        params.append(
            SamplingParams(max_new_tokens=rng.randint(1, 14), stop_token_ids=stop_ids,
                           ignore_eos=rng.random() < 0.5)
        )  # fmt: skip
    return prompts, params


@pytest.mark.parametrize("page_size", [1, 16, NATIVE_PAGE_SIZE])
def test_hundreds_of_mixed_requests_no_leak(backend, backend_name, tiny_models, page_size):
    from polyspec.engine.llm import LLM

    require(backend.capabilities.tree_attention, "tree_attention (topk > 1)")
    page_size = resolve_page_size(backend, page_size)
    prompts, params = _mixed_requests(200)
    common = dict(
        target=tiny_models["target"], backend=backend_name, dtype="float32", page_size=page_size,
        max_batch_size=6, max_context=128, prefill_chunk_size=8, max_tokens_per_step=24,
    )  # fmt: skip
    plain = LLM(**common)
    spec = LLM(
        draft=tiny_models["target"],
        speculative=SpeculativeConfig(
            algorithm="standalone", topk=2, num_steps=3, num_draft_tokens=6
        ),
        **common,
    )
    free_plain, free_spec = plain.kv_slots_free, spec.kv_slots_free
    want = plain.generate(prompt_token_ids=prompts, sampling_params=params)
    got = spec.generate(prompt_token_ids=prompts, sampling_params=params)
    assert spec.kv_slots_free == free_spec and plain.kv_slots_free == free_plain
    # float32 batches of different shapes sum in different orders: a near-tie (about one in
    # a few thousand tokens of this model) may go either way, anything else is a bug
    ties = assert_greedy_equal(
        plain.target, backend, prompts, [w.token_ids for w in want],
        [g.token_ids for g in got],
    )  # fmt: skip
    assert ties <= 2
    for g, p in zip(got, params):
        assert len(g.token_ids) <= p.max_new_tokens
        if g.finish_reason == "stop" and p.stop_token_ids and g.token_ids[-1] in p.stop_token_ids:
            # nothing after a stop token, even inside an accepted run
            assert not set(g.token_ids[:-1]) & set(p.stop_token_ids)


@pytest.mark.parametrize("page_size", [1, 16, NATIVE_PAGE_SIZE])
def test_captured_rounds_under_churn(backend, backend_name, tiny_models, page_size):
    """The same churn through captured rounds (graphs = "on"): batches grow and shrink across
    the buckets (1, 2, 4) and past the largest one (5 and 6 run eagerly), contexts cross the
    prefix buckets; plain and EAGLE-3 outputs equal eager plain decoding, and no slot leaks."""
    from polyspec.engine.llm import LLM

    require(backend.capabilities.static_metadata, "static_metadata (captured forwards)")
    require(backend.capabilities.tree_attention, "tree_attention (topk > 1)")
    page_size = resolve_page_size(backend, page_size)
    prompts, params = _mixed_requests(120, seed=11)
    common = dict(
        target=tiny_models["target"], backend=backend_name, dtype="float32", page_size=page_size,
        max_batch_size=6, max_context=128, prefill_chunk_size=8, max_tokens_per_step=24,
    )  # fmt: skip
    want = LLM(**common, graphs="off").generate(prompt_token_ids=prompts, sampling_params=params)
    spec = SpeculativeConfig(algorithm="eagle3", topk=2, num_steps=3, num_draft_tokens=6)
    for llm in (
        LLM(**common, graphs="on", max_graph_batch_size=4),
        LLM(**common, graphs="on", max_graph_batch_size=4, draft=tiny_models["eagle3"],
            speculative=spec),
    ):  # fmt: skip
        free = llm.kv_slots_free
        got = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        ties = assert_greedy_equal(
            llm.target, backend, prompts, [w.token_ids for w in want], [g.token_ids for g in got]
        )
        assert ties <= 2
        assert llm.kv_slots_free == free
        assert llm.worker.graphs is not None and llm.worker.graphs.num_captured > 0


def test_warm_up_captures_every_graph_the_churn_replays(backend, backend_name, tiny_models):
    """``LLM.warm_up`` (what ``polyspec serve`` runs before it reports ready) leaves nothing to
    capture: greedy, sampled and (with llguidance) constrained requests coming and going at
    every batch size up to ``max_batch_size``, with prompts of every prefill width and
    contexts across the prefix buckets, capture no graph, and give the outputs of an engine
    that captured lazily."""
    from polyspec.engine.llm import LLM

    require(backend.capabilities.static_metadata, "static_metadata (captured forwards)")
    require(backend.capabilities.tree_attention, "tree_attention (topk > 1)")
    require(
        backend.capabilities.max_graph_shapes is None, "any number of graphs (max_graph_shapes)"
    )
    prompts, params = _mixed_requests(60, seed=5)
    rng = random.Random(5)
    params = [
        dataclasses.replace(p, temperature=1.0, seed=i) if rng.random() < 0.3 else p
        for i, p in enumerate(params)
    ]
    if importlib.util.find_spec("llguidance"):  # constrained batches' rounds too
        params[::7] = [
            dataclasses.replace(p, regex=r"[a-e]{2}@(x|yz)\.(com|org)", max_new_tokens=20)
            for p in params[::7]
        ]
    page_size = default_page_size(backend)
    common = dict(
        target=tiny_models["target"], backend=backend_name, dtype="float32", page_size=page_size,
        max_batch_size=6, max_context=96, prefill_chunk_size=16, max_tokens_per_step=48,
        graphs="on", draft=tiny_models["eagle3"],
        speculative=SpeculativeConfig(algorithm="eagle3", topk=2, num_steps=3, num_draft_tokens=6,
                                      batch_trees="4:3-1-4"),
    )  # fmt: skip
    lazy = LLM(**common)
    want = lazy.generate(prompt_token_ids=prompts, sampling_params=params)
    warm = LLM(**common)
    done = warm.warm_up()
    graphs = warm.worker.graphs
    assert done["graphs"] == graphs.num_captured > lazy.worker.graphs.num_captured
    got = warm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert graphs.num_captured == done["graphs"], "a graph was captured after the warm-up"
    if any(p.constrained for p in params):
        assert any("constrained" in name for name, _, _ in graphs.captured)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    # the loop counts its own rounds: the warm-up's ran on an earlier one
    assert warm.engine.stats().rounds_total == lazy.engine.stats().rounds_total
