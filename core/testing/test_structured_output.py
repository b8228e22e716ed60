"""Structured output under speculation is lossless and its outputs follow the constraint.

- Greedy: speculative output equals plain output under the same constraint, token for token
  (float32), for chains and trees, EAGLE-3 and standalone drafts, in batches that mix
  constrained and unconstrained requests (the unconstrained ones equal their own plain output);
  in bfloat16 too where the backend claims row-invariant bf16 forwards.
- Sampling: seeded speculative runs follow the constrained target distribution, computed
  exactly by enumerating every path under masks decided by an independent oracle (a
  character-level check of the regex, not the grammar engine), by a chi-square test.
- Outputs: a finished JSON-schema output parses and validates, a regex output matches, a
  choice is one of the choices.
"""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
import torch

from polyspec.config import SamplingParams, SpeculativeConfig
from polyspec.testing.plugin import default_page_size, require
from polyspec.testing.test_sampling_e2e import chi_square_rejects

pytest.importorskip("llguidance", reason="structured output needs llguidance (polyspec[grammar])")

PROMPTS = [[17, 42, 99, 5, 61], [7, 8, 9], [200, 3, 150, 77]]

SCHEMAS = [
    {  # nested object, enum, bounded integer, required fields
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 99},
            "color": {"enum": ["red", "green"]},
            "pos": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}},
                "required": ["x"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "color", "pos"],
        "additionalProperties": False,
    },
    {  # an array of booleans, bounded
        "type": "object",
        "properties": {"flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
        "required": ["flags"],
        "additionalProperties": False,
    },
]
REGEX = r"[a-e]{2}@(x|yz)\.(com|org)"
CHOICES = ["alpha", "beta gamma", 'say "hi"']


def _llm(
    backend, backend_name, tiny, algorithm=None, dtype="float32", graphs="off",
    constrained_speculation="on", constrained_draft="auto", overlap_rounds="off", **spec,
):  # fmt: skip
    """An engine over the tiny models. ``graphs`` "off" by default: the eager constrained
    round (:func:`test_constrained_rounds_replay_graphs` runs the replayed phases). A batch
    with a constrained request speculates (``constrained_speculation`` "on"), unless asked
    otherwise (:func:`test_constrained_batches_run_the_rounds_chosen`)."""
    from polyspec.engine.llm import LLM

    draft = speculative = None
    if algorithm is not None:
        draft = tiny["target"] if algorithm == "self" else tiny[algorithm]
        algo = "standalone" if algorithm == "self" else algorithm
        speculative = SpeculativeConfig(algorithm=algo, **spec)
    return LLM(
        target=tiny["target"], draft=draft, speculative=speculative, backend=backend_name,
        dtype=dtype, max_batch_size=64, max_context=160, page_size=default_page_size(backend),
        graphs=graphs, constrained_speculation=constrained_speculation,
        constrained_draft=constrained_draft, overlap_rounds=overlap_rounds,
    )  # fmt: skip


@pytest.fixture(scope="module")
def plain(backend, backend_name, tiny_models):
    return _llm(backend, backend_name, tiny_models)


def _constraints():
    return [
        {"json_schema": SCHEMAS[0]},
        {"json_schema": SCHEMAS[1]},
        {"regex": REGEX},
        {"choice": CHOICES},
    ]


def _batch(max_new_tokens: int = 90, **kw):
    """Each constraint on each prompt, and every prompt unconstrained, in one batch."""
    prompts, params = [], []
    for c in _constraints():
        for p in PROMPTS:
            prompts.append(p)
            params.append(SamplingParams(max_new_tokens=max_new_tokens, **c, **kw))
    for p in PROMPTS:
        prompts.append(p)
        params.append(SamplingParams(max_new_tokens=20, ignore_eos=True, **kw))
    return prompts, params


def _check_output(params: SamplingParams, text: str, finish_reason: str) -> None:
    """A finished output satisfies its constraint; a truncated one is a prefix of one."""
    if params.regex is not None:
        assert finish_reason == "stop" and re.fullmatch(REGEX, text), (text, finish_reason)
    elif params.choice is not None:
        assert finish_reason == "stop" and text in CHOICES, (text, finish_reason)
    elif params.json_schema is not None:
        assert finish_reason == "stop", f"a bounded schema's output was cut: {text!r}"
        value = json.loads(text)
        schema = json.loads(params.json_schema)
        try:
            import jsonschema
        except ImportError:  # the checks the schemas above need, by hand
            assert isinstance(value, dict) and set(value) == set(schema["required"]), value
        else:
            jsonschema.validate(value, schema)


@pytest.mark.parametrize(
    "algorithm,topk,num_steps,draft_masks",
    [("self", 1, 3, "auto"), ("self", 2, 3, "levels"), ("self", 2, 3, "root"),
     ("eagle3", 2, 3, "levels"), ("eagle3", 2, 3, "root"), ("eagle3", 3, 2, "auto")],
)  # fmt: skip
def test_constrained_greedy_spec_equals_plain(
    backend, backend_name, tiny_models, plain, algorithm, topk, num_steps, draft_masks
):
    """Greedy speculative == greedy plain under each constraint, in one mixed batch, with
    the draft masked at every level or at its root only (``constrained_draft``); every
    constrained output satisfies its constraint and finishes with "stop"."""
    from polyspec.testing.forward import assert_greedy_equal

    require(topk == 1 or backend.capabilities.tree_attention, "tree_attention (topk > 1)")
    spec = _llm(
        backend, backend_name, tiny_models, algorithm, topk=topk, num_steps=num_steps,
        constrained_draft=draft_masks,
    )  # fmt: skip
    prompts, params = _batch()
    want = plain.generate(prompt_token_ids=prompts, sampling_params=params)
    got = spec.generate(prompt_token_ids=prompts, sampling_params=params)
    ties = assert_greedy_equal(
        plain.target, plain.backend, prompts, [o.token_ids for o in want],
        [o.token_ids for o in got],
    )  # fmt: skip
    assert ties <= 1, f"{ties} near-ties: the test models should make them rare"
    for p, w, g in zip(params, want, got):
        if p.constrained:
            _check_output(p, w.text, w.finish_reason)
            _check_output(p, g.text, g.finish_reason)
    assert spec.worker.constrained_rounds > 0
    accepted = [n for p, o in zip(params, got) if p.constrained for n in o.stats.accepted_per_round]
    assert max(accepted) > 1, "no constrained round accepted a draft token: nothing proven"


def _mixed_batch_equals_plain(llm, plain, run_on: bool = True):
    """:func:`_batch` on ``llm`` (with ``run_on`` its unconstrained requests running on after
    the constrained ones have finished): the outputs equal plain greedy decoding's and
    satisfy their constraints. -> (the requests' params, ``llm``'s outputs)."""
    prompts, params = _batch()
    if run_on:
        params = [p if p.constrained else SamplingParams(max_new_tokens=120, ignore_eos=True)
                  for p in params]  # fmt: skip
    want = plain.generate(prompt_token_ids=prompts, sampling_params=params)
    got = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for p, g in zip(params, got):
        if p.constrained:
            _check_output(p, g.text, g.finish_reason)
    return params, got


def _accepted(params, outputs, constrained: bool) -> list[int]:
    """Tokens each round committed, over the (un)constrained requests' rounds."""
    return [n for p, o in zip(params, outputs) if p.constrained == constrained
            for n in o.stats.accepted_per_round]  # fmt: skip


@pytest.mark.parametrize(
    "algorithm,dynamic_depth,draft_masks",
    [(None, 0.0, "auto"), ("self", 0.0, "levels"), ("eagle3", 0.0, "levels"),
     ("eagle3", 0.999, "levels"), ("eagle3", 0.0, "root"), ("eagle3", 0.999, "root")],
)  # fmt: skip
def test_constrained_rounds_replay_graphs(
    backend, backend_name, tiny_models, plain, algorithm, dynamic_depth, draft_masks
):
    """Where rounds replay graphs, a constrained round replays them too: a plain round with
    the root's mask as an input, a speculative one as its phases (the draft's levels, the
    verify, the acceptance) with the masks built on the host in between (each level's lanes',
    the tree's nodes); with the draft masked at its root only, the draft is one phase.
    Greedy outputs equal eager plain decoding's (with dynamic depth too), constrained
    outputs satisfy their constraints, the constrained requests speculate, and once they
    have finished the others speculate on."""
    require(backend.capabilities.static_metadata, "static_metadata (captured forwards)")
    require(backend.capabilities.tree_attention, "tree_attention (topk > 1)")
    spec = {} if algorithm is None else {"topk": 2, "num_steps": 3}
    if dynamic_depth:
        spec["dynamic_depth"] = dynamic_depth
    llm = _llm(
        backend, backend_name, tiny_models, algorithm, graphs="on",
        constrained_draft=draft_masks, **spec,
    )  # fmt: skip
    params, got = _mixed_batch_equals_plain(llm, plain)
    names = {name for name, _, _ in llm.worker.graphs.captured}
    if algorithm is None:
        assert "decode_greedy_constrained" in names, names
        return
    levels = ("level1", "level2") if draft_masks == "levels" else ()  # num_steps 3
    drafts = ("draft", *levels, "verify")
    if draft_masks == "root":  # nothing read between the draft and the verify: one phase
        drafts = ("draft_verify",)
    phases = {f"round_greedy_constrained.{p}" for p in (*drafts, "accept")}
    assert phases == {n for n in names if n.startswith("round_greedy_constrained.")}, names
    for constrained in (True, False):
        accepted = _accepted(params, got, constrained)
        assert max(accepted) > 1, f"constrained={constrained}: no draft token was accepted"
    if dynamic_depth:  # rounds stopped drafting early
        assert sum(llm.worker.drafted_levels[1:3]) > 0, llm.worker.drafted_levels


LONG_REGEX = r"[a-e]{30}"
"""A regex of free tokens only, whose outputs run for many rounds."""


@pytest.mark.parametrize("algorithm", [None, "eagle3"])
def test_constrained_plain_rounds_queue_their_forward(
    backend, backend_name, tiny_models, plain, algorithm
):
    """``overlap_rounds``: a constrained plain round runs as its two phases, the forward of
    the roots and the next tokens under the roots' masks, and the next round's forward is
    queued behind it before the host reads the tokens (the host builds the next masks while
    the device runs it). In a plain engine and in a speculative one whose constrained
    batches run plain rounds (``constrained_speculation`` "off"): long constrained outputs
    with unconstrained requests in their batch, one stopping at its token limit early on
    (the forward queued for its batch serves the others), seeded sampled ones, then the
    mixed batch of :func:`_batch`; the outputs equal eager plain decoding's and satisfy
    their constraints, queued forwards are used, and no KV slot leaks."""
    require(backend.capabilities.static_metadata, "static_metadata (captured forwards)")
    require(
        not backend.capabilities.graph_needs_prepare,
        "graphs without prepare (a queued forward's lengths are not on the host yet)",
    )
    spec = {} if algorithm is None else {"topk": 1, "num_steps": 3}
    llm = _llm(
        backend, backend_name, tiny_models, algorithm, graphs="on", overlap_rounds="on",
        constrained_speculation="off", **spec,
    )  # fmt: skip
    free_before = llm.kv_slots_free
    params = [SamplingParams(max_new_tokens=60, regex=LONG_REGEX) for _ in PROMPTS]
    params += [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (6, 50)]
    prompts = PROMPTS + PROMPTS[:2]
    want = plain.generate(prompt_token_ids=prompts, sampling_params=params)
    got = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for o in got[: len(PROMPTS)]:
        assert o.finish_reason == "stop" and re.fullmatch(LONG_REGEX, o.text), o.text
    queued = llm.worker.queued_forwards
    assert 0 < queued["used"] < queued["queued"], queued
    assert queued["used_by_fewer"] > 0, queued  # after a request's token limit, or its stop
    names = {name for name, _, _ in llm.worker.graphs.captured}
    for phase in (".forward", ".next"):
        assert any("_constrained" in n and n.endswith(phase) for n in names), names
    # seeded sampling draws each round's noise from the request's own stream, as eagerly
    params = [
        SamplingParams(max_new_tokens=60, regex=LONG_REGEX, temperature=1.0, seed=i)
        for i in range(len(PROMPTS))
    ]
    used = queued["used"]
    want = plain.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    got = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert llm.worker.queued_forwards["used"] > used, llm.worker.queued_forwards
    _mixed_batch_equals_plain(llm, plain)
    assert llm.kv_slots_free == free_before, "KV slots leaked"


@pytest.mark.parametrize("batch_size", [1, 3])
def test_constrained_speculative_rounds_queue_their_draft_and_verify(
    backend, backend_name, tiny_models, plain, batch_size
):
    """``overlap_rounds`` with the draft masked at its root: once a greedy constrained
    round's walk has committed its tokens, the next round's draft-and-verify phase is queued
    behind its accept phase, under the next roots' masks, before the host reads the round's
    result. Long outputs of one or three requests (the batch stays), then the mixed batch of
    :func:`_batch` (requests stop at their grammar's end or their token limit, so the batch
    changes and queued phases are dropped): outputs equal eager plain decoding's and satisfy
    their constraints, queued phases are used, and no KV slot leaks."""
    require(backend.capabilities.static_metadata, "static_metadata (captured forwards)")
    require(backend.capabilities.tree_attention, "tree_attention (topk > 1)")
    require(
        not backend.capabilities.graph_needs_prepare,
        "graphs without prepare (a queued phase's lengths are not on the host yet)",
    )
    llm = _llm(
        backend, backend_name, tiny_models, "eagle3", graphs="on", overlap_rounds="on",
        constrained_draft="root", topk=2, num_steps=3,
    )  # fmt: skip
    free_before = llm.kv_slots_free
    prompts = PROMPTS[:batch_size]
    params = [SamplingParams(max_new_tokens=60, regex=LONG_REGEX) for _ in prompts]
    want = plain.generate(prompt_token_ids=prompts, sampling_params=params)
    got = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for o in got:
        assert o.finish_reason == "stop" and re.fullmatch(LONG_REGEX, o.text), o.text
    queued = dict(llm.worker.queued_forwards)
    assert 0 < queued["used"] <= queued["queued"], queued
    names = {name for name, _, _ in llm.worker.graphs.captured}
    assert "round_greedy_constrained.draft_verify" in names, names
    # a schema's forced tokens: the queued draft takes them under the next roots' masks
    params = [SamplingParams(max_new_tokens=90, json_schema=SCHEMAS[0]) for _ in prompts]
    want = plain.generate(prompt_token_ids=prompts, sampling_params=params)
    got = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for p, o in zip(params, got):
        _check_output(p, o.text, o.finish_reason)
    assert llm.worker.queued_forwards["used"] > queued["used"], llm.worker.queued_forwards
    _mixed_batch_equals_plain(llm, plain)
    assert llm.kv_slots_free == free_before, "KV slots leaked"


FORCED = r"\{\"name\": \"(ab|cd)\", \"level\": \"[xy]\"\}"
"""A regex whose literal runs the grammar forces (a tiny random draft would not guess them)."""


@pytest.mark.parametrize("graphs", ["off", "on"])
@pytest.mark.parametrize("algorithm", ["self", "eagle3"])
def test_the_draft_proposes_the_forced_tokens(
    backend, backend_name, tiny_models, graphs, algorithm
):
    """With the draft masked at its root only (``constrained_draft`` "root"), where the
    grammar forces the next tokens the draft's levels propose them
    (:meth:`~polyspec.constrain.RoundMasks.draft_levels`), so the target accepts them: a
    round starting a forced run of at least S tokens commits S drafts and the bonus token
    (a random tiny draft proposes a given token at a level about once in the vocabulary's
    size). Outputs equal plain decoding's, eagerly and where rounds replay graphs."""
    if graphs == "on":
        require(backend.capabilities.static_metadata, "static_metadata (captured forwards)")
    topk = 2 if backend.capabilities.tree_attention else 1
    num_steps = 3
    llm = _llm(
        backend, backend_name, tiny_models, algorithm, graphs=graphs, constrained_draft="root",
        topk=topk, num_steps=num_steps,
    )  # fmt: skip
    plain = _llm(backend, backend_name, tiny_models)
    params = SamplingParams(max_new_tokens=60, regex=FORCED)
    want = plain.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    got = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for o in got:
        assert o.finish_reason == "stop" and re.fullmatch(FORCED, o.text), o.text
        per_round = o.stats.accepted_per_round
        # the output's first tokens are forced ('{"name": "'), more than S of them
        assert per_round[0] == num_steps + 1, per_round
        assert sum(n == num_steps + 1 for n in per_round) >= 3, per_round


@pytest.mark.parametrize("mode", ["off", "auto"])
def test_constrained_batches_run_the_rounds_chosen(backend, backend_name, tiny_models, plain, mode):
    """``constrained_speculation``: "off" runs plain rounds for every batch with a
    constrained request (its requests commit one token a round; the unconstrained ones
    speculate once the constrained ones have finished); "auto" measures both kinds (a range's
    first rounds speculate, the next are plain) and runs the one with more tokens a second.
    Greedy outputs equal plain decoding's either way."""
    topk = 2 if backend.capabilities.tree_attention else 1
    llm = _llm(
        backend, backend_name, tiny_models, "eagle3", constrained_speculation=mode,
        topk=topk, num_steps=3,
    )  # fmt: skip
    params, got = _mixed_batch_equals_plain(llm, plain)
    constrained = _accepted(params, got, True)
    assert max(_accepted(params, got, False)) > 1, "the unconstrained requests never speculated"
    rates = llm.scheduler.constrained.rates()
    if mode == "off":
        assert max(constrained) == 1 and rates == {}, (constrained, rates)
    else:  # both kinds measured (a range's first rounds: speculative, then plain)
        assert any(spec > 0 and plain_ > 0 for spec, plain_ in rates.values()), rates


@pytest.mark.parametrize("algorithm", ["self", "eagle3"])
def test_constrained_greedy_spec_equals_plain_in_bf16(
    backend, backend_name, tiny_models, algorithm
):
    """Where the backend claims row-invariant bf16 forwards (a verify row's logits do not
    depend on the rows beside it): greedy speculative == greedy plain under each constraint
    in bf16, token for token, with no allowance for near-ties."""
    require(backend.capabilities.tree_attention, "tree_attention (topk > 1)")
    if "bfloat16" not in backend.capabilities.dtypes or not backend.row_invariant(torch.bfloat16):
        pytest.skip("backend makes no row-invariance claim for bfloat16")
    plain = _llm(backend, backend_name, tiny_models, dtype="bfloat16")
    spec = _llm(backend, backend_name, tiny_models, algorithm, "bfloat16", topk=2, num_steps=3)
    params, got = _mixed_batch_equals_plain(spec, plain, run_on=False)
    assert spec.worker.constrained_rounds > 0
    accepted = _accepted(params, got, True)
    assert max(accepted) > 1, "no constrained round accepted a draft token: nothing proven"


# ---------------------------------------------------------------------------- sampling

SAMPLE_REGEX = r"[a-e]{2}"
TEMPERATURE = 1.3
NUM_SAMPLES = 1200


def _oracle_allowed(llm, text: str) -> list[int]:
    """Tokens that may follow ``text`` under SAMPLE_REGEX, decided character by character:
    a token is allowed when its text keeps the output a prefix of a match."""
    tok = llm.tokenizer
    out = []
    for t in range(tok.vocab_size):
        piece = tok.decode([t], skip_special_tokens=False)
        s = text + piece
        if piece and len(s) <= 2 and all(c in "abcde" for c in s):
            out.append(t)
    return out


def _exact_constrained(llm) -> dict[tuple[int, ...], float]:
    """P(the output's tokens) under the constraint: at each step the target's softmax at
    TEMPERATURE restricted to the oracle's tokens, renormalised; the output ends when its
    text is two characters long."""
    from polyspec.testing.forward import run_prefill

    dev = llm.backend.device()
    law: dict[tuple[int, ...], float] = {}
    frontier = [((), 1.0)]
    while frontier:
        path, pr = frontier.pop()
        text = llm.tokenizer.decode(list(path))
        if len(text) == 2:
            law[path] = pr
            continue
        ids = torch.tensor(PROMPTS[0] + list(path), device=dev)
        logits = run_prefill(llm.target, llm.backend, ids)[1][-1].double().cpu()
        allowed = torch.tensor(_oracle_allowed(llm, text))
        p = torch.softmax(logits[allowed] / TEMPERATURE, 0)
        frontier += [((*path, int(t)), pr * float(q)) for t, q in zip(allowed, p)]
    return law


@pytest.fixture(scope="module")
def exact_law(plain):
    law = _exact_constrained(plain)
    assert abs(sum(law.values()) - 1) < 1e-9 and len(law) >= 20
    return law


@pytest.mark.parametrize(
    "algorithm,topk,num_steps,graphs,draft_masks,overlap",
    [(None, 1, 0, "off", "auto", "off"), ("self", 2, 3, "off", "auto", "off"),
     ("eagle3", 2, 3, "off", "auto", "off"), ("eagle3", 2, 3, "on", "auto", "off"),
     ("eagle3", 2, 3, "on", "root", "off"), (None, 1, 0, "on", "auto", "on")],
)  # fmt: skip
def test_constrained_sampling_follows_the_constrained_target(
    backend, backend_name, tiny_models, exact_law, algorithm, topk, num_steps, graphs,
    draft_masks, overlap,
):  # fmt: skip
    """Seeded sampling, plain and speculative, under a regex: the outputs' law is the
    target's masked distribution (chi-square against the exact enumeration); a negative
    control (the law at another temperature) is rejected at this sample size. With graphs
    on, the speculative rounds replay the constrained round's phases; with the draft masked
    at its root only, its levels under the forced tokens' masks; with ``overlap_rounds``,
    plain rounds replay their two phases, each round's forward queued behind the last."""
    require(topk == 1 or backend.capabilities.tree_attention, "tree_attention (topk > 1)")
    if graphs == "on":
        require(backend.capabilities.static_metadata, "static_metadata (captured forwards)")
    if overlap == "on":
        require(not backend.capabilities.graph_needs_prepare, "graphs without prepare")
    spec = {} if algorithm is None else {"topk": topk, "num_steps": num_steps}
    llm = _llm(
        backend, backend_name, tiny_models, algorithm, graphs=graphs,
        constrained_draft=draft_masks, overlap_rounds=overlap, **spec,
    )  # fmt: skip
    params = [
        SamplingParams(max_new_tokens=6, temperature=TEMPERATURE, seed=i, regex=SAMPLE_REGEX)
        for i in range(NUM_SAMPLES)
    ]
    outs = llm.generate(prompt_token_ids=[PROMPTS[0]] * NUM_SAMPLES, sampling_params=params)
    counts: Counter = Counter()
    for o in outs:
        assert o.finish_reason == "stop" and re.fullmatch(SAMPLE_REGEX, o.text), o.text
        counts[tuple(o.token_ids)] += 1
    rejected, msg = chi_square_rejects(counts, exact_law, NUM_SAMPLES)
    assert not rejected, msg
    names = {n for n, _, _ in llm.worker.graphs.captured} if graphs == "on" else set()
    if graphs == "on" and algorithm is not None:
        assert "round_sampled_constrained.accept" in names, names
    if overlap == "on":
        assert "decode_sampled_constrained.next" in names, names
        assert llm.worker.queued_forwards["queued"] > 0, llm.worker.queued_forwards
    if algorithm is None and overlap == "off":  # negative control, once
        flat = {k: v**0.3 for k, v in exact_law.items()}
        total = sum(flat.values())
        wrong = {k: v / total for k, v in flat.items()}
        rejected, msg = chi_square_rejects(counts, wrong, NUM_SAMPLES)
        assert rejected, f"a wrong law was accepted: {msg}"
