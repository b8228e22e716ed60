"""Structured output's checks and pieces: the form of SamplingParams' constraint fields, the
grammar cache's errors, a dead end failing its request alone, llguidance missing, the draft
vocabulary's masks, and a request finishing where its grammar does."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from polyspec.config import SamplingParams
from polyspec.errors import ConfigError, RequestError

pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from polyspec.testing import builders

    return builders.build_tiny_target(tmp_path_factory.mktemp("so") / "target", seed=0)


@pytest.fixture(scope="module")
def llm(tiny):
    from polyspec.engine.llm import LLM

    return LLM(target=str(tiny), backend="cpu", dtype="float32", max_batch_size=4,
               max_context=160)  # fmt: skip


def test_sampling_params_constraint_form():
    p = SamplingParams(json_schema={"type": "object", "b": 1, "a": [1]})
    assert p.json_schema == '{"a":[1],"b":1,"type":"object"}' and p.constrained
    assert SamplingParams(choice=["x", "y"]).choice == ("x", "y")
    assert not SamplingParams().constrained
    with pytest.raises(ConfigError, match="only one of"):
        SamplingParams(regex="a", choice=["a"])
    with pytest.raises(ConfigError, match="sampling.choice"):
        SamplingParams(choice=[])
    with pytest.raises(ConfigError, match="sampling.choice"):
        SamplingParams(choice=["a", 3])
    with pytest.raises(ConfigError, match="sampling.regex"):
        SamplingParams(regex="")
    with pytest.raises(ConfigError, match="sampling.json_schema"):
        SamplingParams(json_schema=3)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("regex", "a(b", "unclosed group"),
        ("json_schema", '{"type": "foo"}', "Invalid type: foo"),
        ("json_schema", "{bad", "line 1 column 2"),
        ("json_schema", "[1]", "an object or a boolean"),
        ("grammar", "start: x", 'unknown name: "x"'),
    ],
)
def test_an_invalid_constraint_is_a_request_error(llm, field, value, message):
    """Refused at submit, naming the field and llguidance's (or the JSON parser's) message;
    the engine runs on."""
    with pytest.raises(RequestError, match=message) as info:
        llm.generate(prompt_token_ids=[[5, 6]], sampling_params=SamplingParams(**{field: value}))
    assert info.value.field == f"sampling.{field}"
    out = llm.generate(prompt_token_ids=[[5, 6]], sampling_params=SamplingParams(
        max_new_tokens=8, choice=["ok"]))[0]  # fmt: skip
    assert (out.text, out.finish_reason) == ("ok", "stop")


def test_a_dead_end_fails_its_request_alone(llm):
    """A grammar no token can start fails its own request with a clear error; a constrained
    and an unconstrained request in the same batch finish normally."""
    params = [
        SamplingParams(max_new_tokens=8, regex=r"a[^\s\S]"),
        SamplingParams(max_new_tokens=8, regex=r"[xyz]{3}"),
        SamplingParams(max_new_tokens=5, ignore_eos=True),
    ]
    outs = llm.generate(prompt_token_ids=[[5, 6], [7, 8], [9, 10]], sampling_params=params)
    assert outs[0].finish_reason == "error"
    assert "no token of the vocabulary can continue" in outs[0].error
    assert outs[1].finish_reason == "stop" and len(outs[1].text) == 3
    assert set(outs[1].text) <= set("xyz")
    assert outs[2].finish_reason == "length" and len(outs[2].token_ids) == 5


def test_missing_llguidance_names_the_extra(tiny, monkeypatch):
    from polyspec.engine.llm import LLM

    monkeypatch.setitem(sys.modules, "llguidance", None)  # import fails
    fresh = LLM(target=str(tiny), backend="cpu", dtype="float32", max_batch_size=2,
                max_context=160)  # fmt: skip
    with pytest.raises(RequestError, match=r"polyspec\[grammar\]") as info:
        fresh.generate(prompt_token_ids=[[5]], sampling_params=SamplingParams(regex="a"))
    assert info.value.field == "sampling.regex"
    out = fresh.generate(prompt_token_ids=[[5]], sampling_params=SamplingParams(max_new_tokens=2))
    assert len(out[0].token_ids) <= 2  # unconstrained requests need no grammar engine


def test_grammar_cache_compiles_once_and_evicts(llm):
    cache = llm.scheduler.grammars
    a = cache.compile(("regex", "ab+"))
    assert cache.compile(("regex", "ab+")) is a
    m1, m2 = cache.matcher(("regex", "ab+")), cache.matcher(("regex", "ab+"))
    assert m1 is not m2  # each request its own state
    small = type(cache)(cache.tokenizer, cache.vocab_size, capacity=2)
    first = small.compile(("regex", "a"))
    small.compile(("regex", "b"))
    small.compile(("regex", "c"))
    assert small.compile(("regex", "a")) is not first  # evicted, compiled again


def test_matcher_stops_at_the_grammar_end(llm):
    """advance takes the tokens up to the one that completes the grammar; the rest of an
    accepted run is not output."""
    tok = llm.tokenizer
    m = llm.scheduler.grammars.matcher(("choice", ("ab",)))
    ids = tok.encode("ab", add_special_tokens=False) + tok.encode("cd", add_special_tokens=False)
    taken = m.advance(ids)
    assert tok.decode(ids[:taken]) == "ab" and m.done


def test_draft_vocabulary_masks():
    """A target-vocabulary mask read through an EAGLE-3 head's d2t map."""
    import torch

    from polyspec.constrain import DraftVocab, RoundMasks

    vocab = 100
    allowed = {3, 31, 32, 64, 99}
    row = np.zeros(4, dtype=np.int32)
    for t in allowed:
        row.view(np.uint32)[t // 32] |= np.uint32(1 << (t % 32))
    d2t = np.array([0, 3, 5, 31, 32, 33, 64, 98, 99] + list(range(40, 70)), dtype=np.int64)
    masks = RoundMasks([None], vocab, torch.from_numpy, lambda t: t, DraftVocab(d2t))
    out = masks._to_draft(np.stack([row, np.full(4, -1, dtype=np.int32)]))
    assert out.shape == (2, (len(d2t) + 31) // 32) and out.dtype == np.int32
    bits = np.unpackbits(out.view(np.uint8), axis=1, bitorder="little")
    assert [int(d2t[j]) for j in np.flatnonzero(bits[0])] == [3, 31, 32, 64, 99, 64]
    # an unconstrained row allows every draft token and nothing past the draft's vocabulary
    assert np.flatnonzero(bits[1]).tolist() == list(range(len(d2t)))


def test_draft_bitmask_on_the_device_equals_the_host_conversion():
    """``draft_bitmask`` (a phased round's conversion, tensor ops) gives the words of
    ``DraftVocab.to_draft`` (the host's) for random masks, all-ones and all-zeros rows, with a
    draft vocabulary that is not a multiple of 32 and sign bits set."""
    import torch

    from polyspec.constrain import DraftVocab, draft_bitmask

    rng = np.random.default_rng(0)
    vocab, size = 1000, 613
    d2t = np.sort(rng.choice(vocab, size, replace=False)).astype(np.int64)
    width = (vocab + 31) // 32
    rows = rng.integers(-(2**31), 2**31, (6, width), dtype=np.int64).astype(np.int32)
    rows[1] = -1
    rows[2] = 0
    want = DraftVocab(d2t).to_draft(rows)
    got = draft_bitmask(torch.from_numpy(rows), torch.from_numpy(d2t)).numpy()
    assert got.dtype == np.int32 and np.array_equal(got, want)


def _fresh_mask(cache, constraint, path):
    """The mask after ``path`` from a new matcher of ``constraint``; all ones where no output
    reaches it (a token the grammar refuses, or past its end)."""
    from polyspec.constrain import ConstraintViolation

    f = cache.matcher(constraint)
    try:
        if f.advance(path) == len(path) and not f.done:
            return f.next_mask()
    except ConstraintViolation:
        pass
    return np.full((cache.vocab_size + 31) // 32, -1, dtype=np.int32)


def test_round_masks_compute_each_node_once(llm):
    """A round's masks equal masks computed afresh for every node's path (a refused token
    and the grammar's end give all-ones rows, and so does everything below them), while
    each mask is computed once: the tree takes its lanes' masks instead of walking them
    again, and nothing below an unreachable node is computed."""
    import torch

    from polyspec.constrain import RoundMasks

    tok, cache = llm.tokenizer, llm.scheduler.grammars
    constraint = ("regex", "[ab][xy]z")
    ids = {}
    for ch in "abqxyz":
        (ids[ch],) = tok.encode(ch, add_special_tokens=False)
    m = cache.matcher(constraint)
    m.next_mask()
    computed = []
    fork = m.fork

    def counting(path):  # the real fork, counted where a mask is computed from it
        state = fork(path)
        if state is not None:
            computed.append(tuple(path))
        return state

    m.fork = counting
    masks = RoundMasks([m, None], cache.vocab_size, torch.from_numpy, llm.backend.read_async)
    K = 2
    # level 0: lanes "a" and "q" (refused); level 1: both lanes continue "a"
    lane0 = masks.lanes(0, torch.tensor([ids["a"], ids["q"], 0, 0]), None, K)
    lane1 = masks.lanes(1, torch.tensor([ids["x"], ids["y"], 0, 0]), torch.tensor([[2, 3]] * 2), K)
    lanes_computed = len(computed)
    # the tree: 1 a, 2 b, 3 q under the root; 4 x, 5 y under a; 6 x under b; 7 x under q;
    # 8 z (the grammar's end), 9 x (refused) under a-x
    tokens = [0, ids["a"], ids["b"], ids["q"], ids["x"], ids["y"], ids["x"], ids["x"]]
    tokens += [ids["z"], ids["x"]]
    first_child = [1, 4, 6, 7, 8, -1, -1, -1, -1, -1]
    next_sibling = [-1, 2, 3, -1, 5, -1, -1, -1, 9, -1]
    n = len(tokens)
    none = [-1] * n
    masks.start_tree(torch.tensor([[tokens, first_child, next_sibling], [[0] * n, none, none]]))
    tree = masks.tree().numpy()
    parents = {c: p for p, c in enumerate(first_child) if c != -1}
    for node, sib in enumerate(next_sibling):
        if sib != -1:
            parents[sib] = parents[node]

    def path(node):
        return [] if node == 0 else path(parents[node]) + [tokens[node]]

    def fresh(p):
        return _fresh_mask(cache, constraint, p)

    for node in range(n):
        assert np.array_equal(tree[node], fresh(path(node))), node
    assert (tree[n:] == -1).all()  # the unconstrained request
    lane_paths = [["a"], ["q"], ["a", "x"], ["a", "y"]]
    lane_rows = np.concatenate([lane0.numpy()[:K], lane1.numpy()[:K]])
    for row, p in zip(lane_rows, lane_paths):
        assert np.array_equal(row, fresh([ids[c] for c in p])), p
    assert (lane0.numpy()[K:] == -1).all() and (lane1.numpy()[K:] == -1).all()
    # lanes: a, a-x, a-y (q is refused); the tree: b and b-x only
    assert (lanes_computed, len(computed)) == (3, 5)
    assert masks.seconds > 0


def _bitmask(tokens, width):
    """A mask that allows ``tokens`` alone."""
    bits = np.zeros(width * 32, dtype=np.uint8)
    bits[list(tokens)] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def test_greedy_choice_is_the_masked_argmax_or_none():
    """The token of the target's top logits that greedy decoding under a grammar takes: the
    first allowed one, the lowest id among allowed ones tied with it, and None where no top
    token is allowed or the allowed value ties with the last (more may tie past it)."""
    from polyspec.constrain.matcher import allowed_by, greedy_choice, masked_argmax

    def allowed(*tokens):
        return lambda t: t in tokens

    assert greedy_choice(allowed(2, 9), [5.0, 4.0, 3.0], [7, 2, 9]) == 2
    assert greedy_choice(allowed(9, 2), [5.0, 4.0, 4.0, 1.0], [7, 9, 2, 3]) == 2
    assert greedy_choice(allowed(9, 3), [5.0, 4.0, 4.0, 1.0], [7, 9, 2, 3]) == 9
    assert greedy_choice(allowed(9), [5.0, 4.0, 4.0], [7, 9, 2]) is None
    assert greedy_choice(allowed(1), [5.0, 4.0, 3.0], [7, 9, 2]) is None
    assert greedy_choice(allowed(2), [5.0, 4.0, 3.0], [7, 9, 2]) is None  # the C-th
    # a mask's bits as the verdict (bit 31 of a word: the int32 sign bit)
    by_mask = allowed_by(_bitmask([63, 40], 2))
    assert greedy_choice(by_mask, [5.0, 4.0, 3.0, 1.0], [7, 63, 40, 3]) == 63
    assert not by_mask(62) and not by_mask(7)
    # the masked argmax over a whole row: the lowest id of the largest allowed value
    logits = np.array([1.0, 9.0, 3.0, 3.0] + [0.0] * 60 + [3.0], dtype=np.float32)
    assert masked_argmax(_bitmask([2, 3, 64], 3), logits) == 2
    assert masked_argmax(_bitmask([64, 0], 3), logits) == 64  # a word past the first


def test_allows_agrees_with_the_mask_where_no_bytes_are_forced(llm):
    """``Matcher.allows`` (the grammar's verdict on one token, which the greedy walk asks
    instead of computing a mask) gives every token of the vocabulary the mask's bit at the
    states of a JSON-schema output where the grammar forces no bytes; where it does
    (``Matcher.forced``: the walk computes the mask there), the mask allows no more, and at
    some of them fewer."""
    cache = llm.scheduler.grammars
    schema = '{"type": "object", "properties": {"sing": {"type": "string"}}, "required": ["sing"]}'
    m = cache.matcher(("json_schema", schema))
    vocab, kinds = np.arange(cache.vocab_size), set()
    for token in llm.tokenizer.encode('{"sing":"Ann Lee"}', add_special_tokens=False):
        bits = np.unpackbits(m.next_mask().view(np.uint8), bitorder="little")
        bits = bits[: cache.vocab_size].astype(bool)
        allows = np.array([m.allows(t) for t in vocab])
        if m.forced():
            assert (allows | ~bits).all()
            kinds.add("narrower" if (allows & ~bits).any() else "forced")
        else:
            assert np.array_equal(allows, bits)
            kinds.add("free")
        m.advance([token])
    assert "narrower" in kinds and "free" in kinds


def test_greedy_walk_takes_the_masked_argmax_and_commits_it(llm):
    """A greedy round's walk: at each node it reaches, the token greedy decoding under the
    grammar takes (from the target's top logits where they settle it, else the node's mask
    and logits row, one mask computed), committed to the matcher as it is chosen, into the
    child that drafted it; -1 at every other node and for an unconstrained request. The
    round's tokens are then checked against the walk's, not committed again; the next
    round's root masks are computed from the walked state."""
    import torch

    from polyspec.constrain import RoundMasks

    tok, cache = llm.tokenizer, llm.scheduler.grammars
    constraint = ("regex", "[ab][xy]z")
    ids = {}
    for ch in "abqxyz":
        (ids[ch],) = tok.encode(ch, add_special_tokens=False)
    matchers = [cache.matcher(constraint), None, cache.matcher(constraint)]
    matchers.append(cache.matcher(constraint))
    for m in matchers:
        if m is not None:
            m.next_mask()
    masks = RoundMasks(matchers, cache.vocab_size, torch.from_numpy, llm.backend.read_async)
    # the tree: 1 a, 2 b under the root; 3 x, 4 y under a; 5 z under a-x
    tokens = [0, ids["a"], ids["b"], ids["x"], ids["y"], ids["z"]]
    first_child = [1, 3, -1, 5, -1, -1]
    next_sibling = [-1, 2, -1, 4, -1, -1]
    n, none = len(tokens), [-1] * len(tokens)
    tree, empty = [tokens, first_child, next_sibling], [[0] * n, none, none]
    masks.start_tree(torch.tensor([tree, empty, tree, tree]))
    C = 3
    top = torch.zeros(4, n, 2 * C)
    logits = torch.zeros(4, n, cache.vocab_size)

    def top_of(request, node, pairs):  # the node's top C (value, token), descending
        top[request, node, :C] = torch.tensor([float(v) for v, _ in pairs])
        top[request, node, C:] = torch.tensor([float(ids[c]) for _, c in pairs])

    assert ids["a"] < ids["b"] and ids["x"] < ids["y"]  # the ties below take a and x
    # request 0: q is refused, a is taken; x and y tie (both allowed): x; then z, which
    # completes the grammar
    top_of(0, 0, [(9, "q"), (8, "a"), (1, "b")])
    top_of(0, 1, [(7, "x"), (7, "y"), (1, "z")])
    top_of(0, 3, [(5, "z"), (2, "q"), (1, "a")])
    # request 2: nothing of the root's top is allowed: its mask and logits row give b; below
    # b (no top logits: all zeros) the row's argmax of x and y, x, is the bonus token
    top_of(2, 0, [(9, "q"), (8, "z"), (7, "x")])
    logits[2, 0, ids["q"]], logits[2, 0, ids["b"]], logits[2, 0, ids["a"]] = 9, 3, 2
    # request 3: the allowed a ties with the C-th value: the row's argmax of a and b, a; then
    # y, then the bonus z
    top_of(3, 0, [(9, "q"), (8, "a"), (8, "b")])
    logits[3, 0, ids["a"]] = logits[3, 0, ids["b"]] = 8
    logits[3, 0, ids["q"]] = 9
    top_of(3, 1, [(6, "y"), (1, "x"), (0, "z")])
    top_of(3, 4, [(5, "z"), (2, "q"), (1, "a")])
    got = masks.greedy_walk(top.view(4 * n, 2 * C), logits.view(4 * n, -1)).view(4, n)
    want = torch.full((4, n), -1, dtype=torch.int32)
    want[0, 0], want[0, 1], want[0, 3] = ids["a"], ids["x"], ids["z"]
    want[2, 0], want[2, 2] = ids["b"], ids["x"]
    want[3, 0], want[3, 1], want[3, 4] = ids["a"], ids["y"], ids["z"]
    assert torch.equal(got, want)
    assert masks.computed == 3  # request 2's root and b, request 3's root
    assert matchers[0].done and matchers[3].done and not matchers[2].done
    masks.next_roots()
    want_next = _fresh_mask(cache, constraint, [ids["b"], ids["x"]])
    assert np.array_equal(matchers[2].next_mask(), want_next)
    # the round's tokens: the walk's (past the grammar's end, more are not output)
    assert matchers[0].advance([ids["a"], ids["x"], ids["z"], ids["q"]]) == 3
    assert matchers[2].advance([ids["b"], ids["x"]]) == 2
    with pytest.raises(RuntimeError, match="grammar walk"):
        matchers[3].advance([ids["a"], ids["x"], ids["z"]])  # not the walk's


def test_draft_levels_are_the_forced_tokens_then_the_grammars_mask(llm):
    """A draft masked at its root only gets one mask per level below it: where the grammar
    forces the next tokens, each level's row allows only its forced token, which is the
    only token the grammar's own mask allows there; the level after the last forced token
    gets the grammar's mask at that state; deeper levels, a request without forced tokens
    and an unconstrained request allow every token. A draft vocabulary without a forced
    token ends the run there."""
    import torch

    from polyspec.constrain import RoundMasks
    from polyspec.constrain.masks import DraftVocab

    cache = llm.scheduler.grammars
    forced, free = ("regex", "abc[xy]z"), ("regex", "[ab][xy]z")
    matchers = [cache.matcher(forced), None, cache.matcher(free), cache.matcher(forced)]
    matchers[3].advance(llm.tokenizer.encode("ab", add_special_tokens=False))
    width = (cache.vocab_size + 31) // 32
    ones = np.full(width, -1, dtype=np.int32)

    def levels(matchers, num_steps, draft_vocab=None):
        masks = RoundMasks(
            matchers, cache.vocab_size, torch.from_numpy, llm.backend.read_async, draft_vocab
        )
        masks.next_roots(num_steps)  # (computed ahead, as after a walked round)
        out = masks.draft_levels(num_steps, draft_vocab=False).numpy()
        assert out.shape == (len(matchers), num_steps - 1, width)
        return out

    out = levels(matchers, 5)
    run = matchers[0].forced_tokens()
    assert len(run) >= 2, run  # "abc" is forced at the start
    path = []
    for level in range(1, 4):  # each row: the one token the grammar allows after the last
        path.append(run[level - 1])
        want = _fresh_mask(cache, forced, path)
        if level < len(run):
            assert np.array_equal(want, _bitmask([run[level]], width))
            assert np.array_equal(out[0, level - 1], want)
        elif level == len(run):  # the free token after the run: the grammar's mask
            assert np.array_equal(out[0, level - 1], want)
            assert not np.array_equal(want, ones)
        else:
            assert np.array_equal(out[0, level - 1], ones)
    assert (out[1] == -1).all() and (out[2] == -1).all()
    (c,) = llm.tokenizer.encode("c", add_special_tokens=False)
    assert matchers[3].forced_tokens() == (c,)  # after "ab": "c" alone, then [xy]
    want = _fresh_mask(cache, forced, llm.tokenizer.encode("abc", add_special_tokens=False))
    assert np.array_equal(out[3, 0], want) and (out[3, 1:] == -1).all()
    # a head whose vocabulary lacks the run's second token: no row below the first level
    ids = np.array([t for t in range(cache.vocab_size) if t != run[1]])
    fresh = [cache.matcher(forced)]
    assert (levels(fresh, 3, DraftVocab(ids))[0] == -1).all()


def test_mask_cost_script_times_copies_and_masks(tiny):
    """``benchmarks/mask_cost.py`` on the tiny model with a regex: one state per position of
    the output that leaves a path below it, and a time for the copies, the masks one at a
    time and the masks on the executor at each thread count asked for."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "mask_cost.py"
    spec = importlib.util.spec_from_file_location("mask_cost", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = script.main(
        ["--target", str(tiny), "--backend", "cpu", "--regex", "[a-z]{12}", "--threads", "1,2",
         "--max-new-tokens", "16", "--repeats", "1"]
    )  # fmt: skip
    assert out["states"] == out["tokens"] - 2 > 0
    assert out["fork_us"] > 0 and out["one_at_a_time_us"] > 0 and out["allows_us"] > 0
    assert out["forced_tokens_us"] > 0
    assert set(out["executor_us"]) == {1, 2} and all(v > 0 for v in out["executor_us"].values())


@pytest.mark.parametrize("plain", [False, True])
def test_round_host_time_script_times_the_parts(tiny, plain):
    """``benchmarks/round_host_time.py`` on the tiny model (its own standalone draft) with a
    regex: per decode round, the worker's decode, the waits for the device and the grammar's
    work (a speculative round's greedy walk, a plain step's next masks), each part within its
    caller's time; the timers are taken off after."""
    import importlib.util
    from pathlib import Path

    from polyspec.spec.base import WorkerBase

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "round_host_time.py"
    spec = importlib.util.spec_from_file_location("round_host_time", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    decode = WorkerBase.decode
    flags = ["--plain"] if plain else ["--draft", str(tiny), "--algorithm", "standalone"]
    out = script.main(
        ["--target", str(tiny), *flags, "--backend", "cpu", "--dtype", "float32",
         "--regex", "[a-z]{12}", "--batch-size", "2", "--max-new-tokens", "12"]
    )  # fmt: skip
    ms = out["ms_per_round"]
    assert out["rounds"] > 0 and out["tokens"] > 0
    assert 0 < ms["worker decode"] <= ms["scheduler decode"] <= ms["scheduler step"]
    grammar = "scheduler next masks" if plain else "greedy walk (its waits included)"
    assert 0 < ms[grammar] < ms["scheduler step"]
    assert WorkerBase.decode is decode


@pytest.mark.parametrize("mode", ["root", "levels", "plain"])
def test_constrained_host_script_counts_masks_and_host_time(tiny, mode):
    """``benchmarks/constrained_host.py`` on the tiny model (its own standalone draft) with a
    regex: a speculative engine's constrained rounds spend host time on the grammar (with
    ``levels`` computing its lanes' masks; with ``root`` the greedy walk computes only those
    its top logits do not settle); a plain engine's steps compute none beyond their
    roots'."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "constrained_host.py"
    spec = importlib.util.spec_from_file_location("constrained_host", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = script.main(
        ["--target", str(tiny), "--draft", str(tiny), "--algorithm", "standalone",
         "--backend", "cpu", "--dtype", "float32", "--regex", "[a-z]{12}",
         "--constrained-draft", mode, "--batch-size", "2", "--max-new-tokens", "12"]
    )  # fmt: skip
    assert out["mode"] == mode and out["tokens_per_s"] > 0
    assert out["constrained_rounds"] > 0 and out["mask_ms_per_round"] > 0
    if mode == "plain":
        assert out["masks_per_round"] == 0
    elif mode == "levels":
        assert out["masks_per_round"] > 0
