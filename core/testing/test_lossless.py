"""End-to-end: greedy speculative decoding emits exactly the tokens of plain greedy decoding.

Runs on tiny random checkpoints built in-process (no downloads), fp32, over a grid of
algorithm x topk x num_steps x page_size x batch. ``self`` uses the target itself as a
standalone draft, so that long accepted runs (and the KV compaction of topk > 1 trees) are
exercised; random heads exercise rejection; a constructed head whose first choice is always
wrong makes rounds accept second children, deep in the tree (off the first-child chain).
"""

from __future__ import annotations

import random

import pytest

from polyspec.config import SamplingParams, SpeculativeConfig
from polyspec.testing.plugin import (
    NATIVE_PAGE_SIZE,
    default_page_size,
    require,
    resolve_page_size,
)

MAX_NEW = 12
PROMPT_LENS = (3, 9, 17, 5, 26)


def _prompts(n: int, vocab: int = 250) -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(3, vocab) for _ in range(PROMPT_LENS[i])] for i in range(n)]


def _llm(
    backend_name, tiny, algorithm=None, page_size=1, graphs="off", overlap_rounds=False,
    max_batch_size=5, engine=None, **spec,
):  # fmt: skip
    from polyspec.engine.llm import LLM

    draft = None
    speculative = None
    if algorithm is not None:
        draft = tiny["target"] if algorithm == "self" else tiny[algorithm]
        algo = "standalone" if algorithm == "self" else algorithm
        speculative = SpeculativeConfig(algorithm=algo, **spec)
    return LLM(
        target=tiny["target"], draft=draft, speculative=speculative, backend=backend_name,
        dtype="float32", page_size=page_size, max_batch_size=max_batch_size, max_context=256,
        graphs=graphs,
        overlap_rounds=overlap_rounds, **(engine or {}),
    )  # fmt: skip


@pytest.fixture(scope="module")
def plain_outputs(backend, backend_name, tiny_models):
    llm = _llm(backend_name, tiny_models, page_size=default_page_size(backend))
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompt_token_ids=_prompts(5), sampling_params=params)]


@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("page_size", [1, 16, NATIVE_PAGE_SIZE])
@pytest.mark.parametrize("num_steps", [1, 3, 5])
@pytest.mark.parametrize("topk", [1, 2, 4])
@pytest.mark.parametrize("algorithm", ["eagle", "eagle3", "standalone", "self"])
def test_spec_greedy_equals_plain_greedy(
    backend,
    backend_name,
    tiny_models,
    plain_outputs,
    algorithm,
    topk,
    num_steps,
    page_size,
    batch,
):
    require(topk == 1 or backend.capabilities.tree_attention, "tree_attention (topk > 1)")
    page_size = resolve_page_size(backend, page_size)
    llm = _llm(
        backend_name, tiny_models, algorithm, page_size=page_size, topk=topk, num_steps=num_steps
    )
    free_before = llm.kv_slots_free
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=_prompts(batch), sampling_params=params)
    assert [o.token_ids for o in outs] == plain_outputs[:batch]
    assert llm.kv_slots_free == free_before, "KV slots leaked"
    if algorithm == "self":
        # The target drafting for itself gets long accepted runs (a topk > 1 tree of at most 8
        # nodes trades depth for breadth, so the bar is modest; random heads get ~1.0).
        assert min(o.stats.mean_acceptance_length for o in outs) > (1.5 if num_steps > 1 else 1.2)


@pytest.mark.parametrize("threshold", [0.3, 0.999])
@pytest.mark.parametrize("topk", [1, 4])
@pytest.mark.parametrize("algorithm", ["eagle3", "self"])
def test_dynamic_depth_equals_plain_greedy(
    backend, backend_name, tiny_models, plain_outputs, algorithm, topk, threshold
):
    """Rounds that stop drafting early (``dynamic_depth``) fill the tree with probability-0
    nodes: the output is still plain greedy decoding's, no KV slot leaks, and rounds did
    stop (at 0.999 nearly every round drafts one level only)."""
    require(topk == 1 or backend.capabilities.tree_attention, "tree_attention (topk > 1)")
    page_size = default_page_size(backend)
    llm = _llm(
        backend_name, tiny_models, algorithm, page_size=page_size, topk=topk, num_steps=4,
        dynamic_depth=threshold,
    )  # fmt: skip
    free_before = llm.kv_slots_free
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=_prompts(5), sampling_params=params)
    assert [o.token_ids for o in outs] == plain_outputs
    assert llm.kv_slots_free == free_before, "KV slots leaked"
    levels = llm.worker.drafted_levels  # rounds by levels drafted, index 1..4
    assert sum(levels) > 0 and sum(levels[1:4]) > 0, f"no round stopped early: {levels}"
    if threshold > 0.99:
        assert levels[1] >= 0.8 * sum(levels), f"rounds by levels drafted: {levels}"


def _shrinking_batch(llm, plain_outputs):
    """Five requests that stop at different rounds (the batch shrinks from 5 to 1): their
    outputs are plain greedy decoding's and no KV slot leaks. -> the outputs."""
    free_before = llm.kv_slots_free
    lengths = (12, 10, 7, 4, 2)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths]
    outs = llm.generate(prompt_token_ids=_prompts(5), sampling_params=params)
    assert [o.token_ids for o in outs] == [p[:n] for p, n in zip(plain_outputs, lengths)]
    assert llm.kv_slots_free == free_before, "KV slots leaked"
    return outs


@pytest.mark.parametrize("graphs", ["off", "on"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("algorithm", ["eagle3", "self"])
def test_batch_trees_equal_plain_greedy(
    backend, backend_name, tiny_models, plain_outputs, algorithm, page_size, graphs
):
    """Rounds whose tree depends on their batch size (``batch_trees``): requests stop at
    different rounds, so the batch shrinks from 5 to 1 across both thresholds; the draft state
    kept for the widest tree (K = 4) serves the narrower ones, a chain of another depth
    included. The output is plain greedy decoding's, every tree ran, no KV slot leaks."""
    require(backend.capabilities.tree_attention, "tree_attention (topk > 1)")
    if graphs == "on":
        require(backend.capabilities.static_metadata, "static_metadata (captured forwards)")
    page_size = resolve_page_size(backend, page_size)
    llm = _llm(
        backend_name, tiny_models, algorithm, page_size=page_size, graphs=graphs, num_steps=3,
        topk=4, num_draft_tokens=10, batch_trees="3:4-2-7,5:2-1-3",
    )  # fmt: skip
    _shrinking_batch(llm, plain_outputs)
    rounds = llm.worker.rounds_by_tree
    assert list(rounds) == ["S=3 K=4 N=10", "S=4 K=2 N=7", "S=2 K=1 N=3"]
    assert all(n > 0 for n in rounds.values()), f"rounds by tree: {rounds}"
    if graphs == "on" and algorithm != "self":
        names = {name for name, _, _ in llm.worker.graphs.captured}
        assert {"round_greedy", "round_greedy@4-2-7", "round_greedy@2-1-3"} <= names, names


@pytest.mark.parametrize("graphs", ["off", "on"])
@pytest.mark.parametrize("algorithm", ["eagle", "eagle3", "standalone", "self"])
def test_plain_rounds_in_a_speculative_engine_equal_plain_greedy(
    backend, backend_name, tiny_models, plain_outputs, algorithm, graphs
):
    """``batch_trees`` with plain rounds (``MIN:plain``): the batch shrinks from 5 to 1, so
    rounds switch from a tree (batch 5) to plain rounds (3 and 4) and back to the main tree
    (below 3) as requests finish. The output is plain greedy decoding's, every kind of round
    ran, no KV slot leaks; and the draft read the plain rounds' tokens: the target drafting
    for itself (``self``) still has every draft of its speculative rounds accepted after them
    (a draft that missed them would be wrong from the first one on)."""
    if graphs == "on":
        require(backend.capabilities.static_metadata, "static_metadata (captured forwards)")
    llm = _llm(
        backend_name, tiny_models, algorithm, page_size=default_page_size(backend),
        graphs=graphs, num_steps=3, topk=1, batch_trees="3:plain,5:2-1-3",
    )  # fmt: skip
    outs = _shrinking_batch(llm, plain_outputs)
    rounds = llm.worker.rounds_by_tree
    assert list(rounds) == ["S=3 K=1 N=4", "plain", "S=2 K=1 N=3"]
    assert all(n > 0 for n in rounds.values()), f"rounds by tree: {rounds}"
    if algorithm == "self":
        # the longest request: its last rounds (batch 1 and 2) run the main tree after plain
        # rounds; all but the one cut by max_new_tokens commit S + 1 = 4 tokens
        per_round = outs[0].stats.accepted_per_round
        tail = per_round[per_round.index(1, 1) :]  # from its first plain round on
        spec = [n for n in tail if n > 1]
        assert spec and all(n == 4 for n in spec[:-1]), per_round


@pytest.mark.parametrize("prompt_len", [None, 90])
def test_plain_rounds_keep_an_eagle_head_current(backend, backend_name, tiny_models, prompt_len):
    """After a prefill and plain rounds at a batch size whose rounds are plain (both skip the
    draft) an EAGLE head's state (its KV of the prompt and the rounds' tokens, and the
    feature and top-K the next speculative round drafts from) is what a prefill of the same
    tokens gives: the catch-up before that round is the draft extend of the prompt and the
    tokens the plain rounds committed, from the target features the prefill and the rounds
    kept: all of them, also where a long prompt and many plain rounds are behind (a head whose
    KV missed the prompt's start attends to other values there, and its state differs)."""
    import torch

    from polyspec.runtime.sampling import RequestSampler

    for algorithm in ("eagle", "eagle3"):
        llm = _llm(
            backend_name, tiny_models, algorithm, page_size=default_page_size(backend),
            num_steps=2, topk=2, num_draft_tokens=4, batch_trees="2:plain",
        )  # fmt: skip
        w = llm.worker
        sampler = RequestSampler.create(0.0, 0, 1.0, 0, w.device)
        prompt = _prompts(3)[2]
        if prompt_len is not None:
            prompt = (prompt * prompt_len)[:prompt_len]
        rounds = 4 if prompt_len is None else 40
        w.add_request(0, prompt, sampler, kv_reserved=len(prompt) + rounds + 32)
        w.add_request(1, prompt[:5], sampler, kv_reserved=rounds + 32)
        first = w.prefill([0, 1], [len(prompt), 5])[0]
        assert w.states[0].draft_len == 0  # a batch of two: the prefill skipped the draft
        tokens = [first]
        for _ in range(rounds):  # plain rounds: a batch of two
            tokens += w.decode([0, 1])[0]
        w.remove_request(1)
        assert w.states[0].draft_len == 0  # so did the plain rounds
        state = w._draft_state([0], [w.states[0]])  # caught up first
        assert w.states[0].draft_len == w.states[0].seq_len
        w.remove_request(0)
        # the same tokens prefilled alone (so the draft reads them): the head's state at the
        # same position
        w.add_request(2, prompt + tokens[:-1], sampler, kv_reserved=len(prompt) + rounds + 32)
        assert w.prefill([2], [len(prompt) + len(tokens) - 1])[2] == tokens[-1]
        ref = w.states[2]
        assert ref.draft_len == ref.seq_len
        torch.testing.assert_close(state[2][0], ref.draft_feature, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(state[0][0], ref.topk_p, atol=1e-4, rtol=1e-4)
        assert state[1][0].tolist() == ref.topk_index.tolist()
        w.remove_request(2)


@pytest.mark.parametrize("stop", [False, True])
@pytest.mark.parametrize("batch_trees", ["", "3:4-2-7", "3:plain"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("algorithm", [None, "eagle", "eagle3"])  # plain, EAGLE heads
def test_overlapped_rounds_equal_plain_greedy(
    backend, backend_name, tiny_models, algorithm, page_size, batch_trees, stop
):
    """``overlap_rounds``: each captured greedy round (a plain step, or a speculative round)
    is queued behind the last one, from its device outputs, before the host reads that one's
    tokens. Requests stop at different
    rounds (token limits, and with ``stop`` a stop token met mid-round), so queued rounds are
    used by fewer requests than they were queued for; the output is plain greedy decoding's
    and no KV slot leaks."""
    require(backend.capabilities.static_metadata, "static_metadata (captured forwards)")
    require(backend.capabilities.tree_attention, "tree_attention (topk > 1)")
    require(
        not backend.capabilities.graph_needs_prepare,
        "graphs without prepare (a queued round's lengths are not on the host yet)",
    )
    page_size = resolve_page_size(backend, page_size)
    spec = {"num_steps": 3, "topk": 4, "num_draft_tokens": 10, "batch_trees": batch_trees}
    if algorithm is None:  # plain decoding: one step per round, no tree
        if batch_trees:
            pytest.skip("plain decoding has no tree")
        spec = {}
    llm = _llm(
        backend_name, tiny_models, algorithm, page_size=page_size, graphs="on",
        overlap_rounds=True, **spec,
    )  # fmt: skip
    free_before = llm.kv_slots_free
    lengths = (40, 30, 20, 12, 6)
    plain = _llm(backend_name, tiny_models, page_size=page_size)
    params = SamplingParams(max_new_tokens=max(lengths), ignore_eos=True)
    longest = plain.generate(prompt_token_ids=_prompts(5), sampling_params=params)
    want = [o.token_ids[:n] for o, n in zip(longest, lengths)]
    stops = [()] * 5
    if stop:  # a token first met at the 9th position or later stops its request there
        for i, w in enumerate(want):
            first = [j for j, t in enumerate(w) if t not in w[:j] and j >= 8]
            if first:
                stops[i] = (w[first[0]],)
                want[i] = w[: first[0] + 1]
    params = [
        SamplingParams(max_new_tokens=n, ignore_eos=True, stop_token_ids=s)
        for n, s in zip(lengths, stops)
    ]
    outs = llm.generate(prompt_token_ids=_prompts(5), sampling_params=params)
    assert [o.token_ids for o in outs] == want
    assert llm.kv_slots_free == free_before, "KV slots leaked"
    queued = llm.worker.queued_rounds
    assert queued["used"] > 0, queued
    # A request that stops (its limit, a stop token) leaves the round queued for its batch to
    # the others; with one tree for every batch size, only the round queued behind the last
    # one goes unused.
    assert queued["used_by_fewer"] > 0, queued
    if not batch_trees:
        assert queued["queued"] - queued["used"] <= 1, queued
    # the same engine again, its graphs warm: the same output
    outs = llm.generate(prompt_token_ids=_prompts(5), sampling_params=params)
    assert [o.token_ids for o in outs] == want


@pytest.mark.parametrize("algorithm", [None, "eagle3", "self"])
def test_overlapped_rounds_with_requests_joining_and_leaving(
    backend, backend_name, tiny_models, algorithm
):
    """``overlap_rounds`` with more requests than batch rows: requests leave (token limits,
    stop tokens) and others join every few rounds. A round queued for a batch that has lost
    requests since runs for the others; a greedy request that joins sits that round out and
    is in the one queued behind it; a sampled one that joins makes the engine drop it. Greedy
    outputs are plain greedy decoding's, each sampled request's output is its own run's alone
    (its seeded stream), and no KV slot leaks."""
    require(backend.capabilities.static_metadata, "static_metadata (captured forwards)")
    require(
        not backend.capabilities.graph_needs_prepare,
        "graphs without prepare (a queued round's lengths are not on the host yet)",
    )
    page_size = default_page_size(backend)
    spec = {}
    if algorithm is not None:
        topk = 2 if backend.capabilities.tree_attention else 1
        spec = {"num_steps": 3, "topk": topk, "num_draft_tokens": 2 * topk + 1}
    rng = random.Random(99)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(3, 20))] for _ in range(11)]
    lengths = [rng.randint(6, 30) for _ in prompts]
    plain = _llm(backend_name, tiny_models, page_size=page_size)
    greedy = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths]
    want = [o.token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=greedy)]
    params = []
    for i, (w, n) in enumerate(zip(want, lengths)):
        if i == 9:  # sampled, seeded (joins late: no round is queued while it decodes)
            params.append(
                SamplingParams(max_new_tokens=n, temperature=0.8, seed=i, ignore_eos=True)
            )
        elif i % 3 == 1 and len(w) > 8:  # stops at a token first met at the 5th position
            params.append(SamplingParams(max_new_tokens=n, ignore_eos=True, stop_token_ids=(w[4],)))
            want[i] = w[: w.index(w[4]) + 1]
        else:
            params.append(greedy[i])
    llm = _llm(
        backend_name, tiny_models, algorithm, page_size=page_size, graphs="on",
        overlap_rounds=True, max_batch_size=4, **spec,
    )  # fmt: skip
    free_before = llm.kv_slots_free
    outs = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    queued = dict(llm.worker.queued_rounds)
    assert queued["used_by_fewer"] > 0 and queued["joined_after"] > 0, queued
    assert llm.kv_slots_free == free_before, "KV slots leaked"
    for i, p in enumerate(params):
        if p.temperature == 0:
            assert outs[i] == want[i], i
        else:  # the same request alone: its seeded stream gives the same tokens
            alone = llm.generate(prompt_token_ids=[prompts[i]], sampling_params=p)[0].token_ids
            assert outs[i] == alone, i


@pytest.mark.parametrize("algorithm", ["eagle3", "self"])
def test_prompts_prefilled_during_plain_rounds_join_queued_rounds(
    backend, backend_name, tiny_models, algorithm
):
    """Five requests in flight (plain rounds from 5: ``5:plain``) prefill in chunks of 8 and
    finish their prompts a step apart. Each prompt is prefilled while five are in flight, so
    it skips the draft, then joins a batch whose speculative rounds are queued one behind the
    other: the round queued when it joins is not used for it, and its draft catches up
    before its first speculative round. The output is plain greedy decoding's."""
    require(backend.capabilities.static_metadata, "static_metadata (captured forwards)")
    require(
        not backend.capabilities.graph_needs_prepare,
        "graphs without prepare (a queued round's lengths are not on the host yet)",
    )
    page_size = default_page_size(backend)
    topk = 2 if backend.capabilities.tree_attention else 1
    spec = {"num_steps": 3, "topk": topk, "num_draft_tokens": 2 * topk + 1}
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (6, 14, 22, 30, 38)]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = _llm(backend_name, tiny_models, page_size=page_size)
    want = [o.token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)]
    llm = _llm(
        backend_name, tiny_models, algorithm, page_size=page_size, graphs="on",
        overlap_rounds=True, engine={"prefill_chunk_size": 8}, batch_trees="5:plain", **spec,
    )  # fmt: skip
    free_before = llm.kv_slots_free
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in outs] == want
    assert llm.kv_slots_free == free_before, "KV slots leaked"
    rounds = llm.worker.rounds_by_tree
    assert rounds["plain"] > 0 and sum(rounds.values()) > rounds["plain"], rounds
    assert llm.worker.queued_rounds["used"] > 0, llm.worker.queued_rounds


@pytest.mark.parametrize("batch", [1, 3, 5])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("topk", [1, 4])
@pytest.mark.parametrize("algorithm", [None, "eagle", "eagle3"])
def test_captured_rounds_equal_eager_plain(
    backend, backend_name, tiny_models, plain_outputs, algorithm, topk, page_size, batch
):
    """Decode rounds replayed from captured graphs (padded to batch buckets 1, 2, 4, 5; static
    attention metadata) emit the tokens of eager plain decoding, and leak no KV slot."""
    require(backend.capabilities.static_metadata, "static_metadata (captured forwards)")
    require(topk == 1 or backend.capabilities.tree_attention, "tree_attention (topk > 1)")
    if algorithm is None and topk > 1:
        pytest.skip("plain decoding has no topk")
    page_size = resolve_page_size(backend, page_size)
    spec = {} if algorithm is None else {"topk": topk, "num_steps": 3}
    llm = _llm(backend_name, tiny_models, algorithm, page_size=page_size, graphs="on", **spec)
    free_before = llm.kv_slots_free
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=_prompts(batch), sampling_params=params)
    assert [o.token_ids for o in outs] == plain_outputs[:batch]
    assert llm.kv_slots_free == free_before, "KV slots leaked"
    assert llm.worker.graphs is not None and llm.worker.graphs.num_captured > 0


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("algorithm", [None, "eagle", "eagle3", "self"])
def test_captured_prefill_equals_eager(backend, backend_name, tiny_models, algorithm, page_size):
    """Prompts prefilled through captured forwards (chunks padded to a prefill width, a chunked
    prompt whose second chunk has a prefix, batches padded to a bucket) give the tokens of an
    engine that prefills and decodes eagerly."""
    from polyspec.engine.llm import LLM

    require(backend.capabilities.static_metadata, "static_metadata (captured forwards)")
    require(
        backend.capabilities.max_graph_shapes is None,
        "an unbounded graph budget (prefill is captured only then)",
    )
    page_size = resolve_page_size(backend, page_size)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (5, 70, 17, 150, 3)]
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    outs = {}
    for graphs in ("off", "on"):
        speculative = draft = None
        if algorithm is not None:
            draft = tiny_models["target" if algorithm == "self" else algorithm]
            algo = "standalone" if algorithm == "self" else algorithm
            speculative = SpeculativeConfig(algorithm=algo, num_steps=3, topk=1)
        llm = LLM(
            target=tiny_models["target"], draft=draft, speculative=speculative,
            backend=backend_name, dtype="float32", page_size=page_size,
            max_batch_size=3, max_context=256, graphs=graphs, prefill_chunk_size=64,
        )  # fmt: skip
        free_before = llm.kv_slots_free
        done = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        outs[graphs] = [o.token_ids for o in done]
        assert llm.kv_slots_free == free_before, "KV slots leaked"
    graphs = llm.worker.graphs
    # every width is known after the first prefill, so that a warm-up's capture_all records it
    assert {f"prefill_{w}" for w in llm.worker.prefill_widths} <= set(graphs.names)
    captured = {name for name, _, _ in graphs.captured}
    assert {"prefill_64", "prefill_32"} <= captured, captured
    if algorithm == "eagle3":
        assert "draft_prefill_64" in captured, captured
    assert outs["on"] == outs["off"]


def test_round_state_survives_prefill_replays(backend, backend_name, tiny_models):
    """The draft state a captured round leaves for the next one lives in that graph's outputs;
    a prefill that joins between two rounds replays graphs of its own, captured earlier,
    which may reuse that memory (one pool). Rounds in a prefix bucket first captured after the
    prefill graphs (by capture_all, as a benchmark's warm-up does), with requests joining
    between them, must still give the eager engine's tokens."""
    from polyspec.engine.llm import LLM

    require(backend.capabilities.static_metadata, "static_metadata (captured forwards)")
    rng = random.Random(11)
    short = [[rng.randrange(3, 250) for _ in range(rng.randrange(5, 20))] for _ in range(3)]
    long = [[rng.randrange(3, 250) for _ in range(rng.randrange(230, 300))] for _ in range(9)]
    # different lengths, so that requests join while others keep decoding
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in range(12, 39, 3)]
    outs = {}
    for graphs in ("off", "on"):
        llm = LLM(
            target=tiny_models["target"], draft=tiny_models["eagle3"],
            speculative=SpeculativeConfig(algorithm="eagle3", num_steps=3, topk=2,
                                          num_draft_tokens=6),
            backend=backend_name, dtype="float32", page_size=default_page_size(backend),
            max_batch_size=3, max_context=480, graphs=graphs,
        )  # fmt: skip
        llm.generate(prompt_token_ids=short, sampling_params=params[:3])  # warm-up: short prefixes
        if llm.worker.graphs is not None:
            llm.worker.graphs.capture_all(3, 340)
        done = llm.generate(prompt_token_ids=long, sampling_params=params)
        outs[graphs] = [o.token_ids for o in done]
    assert outs["on"] == outs["off"]


def _off_chain_spy(backend):
    """``backend`` with a verify_tree_greedy that also counts, per round and request, the
    accepted paths leaving the first-child chain (at any depth, and at depth 2 or more)."""
    import copy
    import dataclasses

    seen = {"rounds": 0, "off_chain": 0, "deep_off_chain": 0}
    verify = backend.kernels.verify_tree_greedy

    def counting_verify(
        candidates, retrive_index, retrive_next_token, retrive_next_sibling, target_predict,
        predicts, accept_index, accept_length,
    ):  # fmt: skip
        verify(
            candidates, retrive_index, retrive_next_token, retrive_next_sibling, target_predict,
            predicts, accept_index, accept_length,
        )  # fmt: skip
        bs, n = candidates.shape
        for b in range(bs):
            length = int(accept_length[b])
            nodes = [int(g) - b * n for g in accept_index[b, : length + 1].tolist()]
            first = retrive_next_token[b].tolist()
            off = [d for d, (u, c) in enumerate(zip(nodes, nodes[1:]), 1) if first[u] != c]
            seen["rounds"] += 1
            seen["off_chain"] += bool(off)
            seen["deep_off_chain"] += any(d >= 2 for d in off)

    spy = copy.copy(backend)
    spy.kernels = dataclasses.replace(backend.kernels, verify_tree_greedy=counting_verify)
    return spy, seen


@pytest.mark.parametrize("page_size", [16, NATIVE_PAGE_SIZE])
def test_off_chain_acceptance_equals_plain_greedy(backend, page_size):
    """A constructed head (:func:`polyspec.testing.builders.build_off_chain_models`) whose
    first choice is always wrong: rounds accept second children, also below depth 1, so the
    accepted KV is compacted from scattered tree positions. Greedy output is still plain
    greedy decoding's, no KV slot leaks, and such rounds did happen."""
    from polyspec.engine.llm import LLM
    from polyspec.testing.builders import build_off_chain_models

    require(backend.capabilities.tree_attention, "tree_attention (topk > 1)")
    page_size = resolve_page_size(backend, page_size)
    target, head = build_off_chain_models(backend)
    kw = dict(max_batch_size=4, max_context=128, page_size=page_size, graphs="off",
              overlap_rounds=False)  # fmt: skip
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 63) for _ in range(n)] for n in (3, 9, 17, 5)]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = LLM.from_modules(target, backend=backend, **kw)
    want = [o.token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)]
    spy, seen = _off_chain_spy(backend)
    spec = SpeculativeConfig("eagle", num_steps=5, topk=4, num_draft_tokens=16)
    llm = LLM.from_modules(target, head, spec, backend=spy, **kw)
    free_before = llm.kv_slots_free
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in outs] == want
    assert llm.kv_slots_free == free_before, "KV slots leaked"
    assert seen["off_chain"] >= 10 and seen["deep_off_chain"] >= 5, (
        f"case too weak: {seen} (rounds accepting a child that is not the first)"
    )
