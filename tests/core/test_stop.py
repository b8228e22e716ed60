"""Stop conditions as behaviour: where ``.text`` ends, which tokens ``token_ids`` keeps, and
``finish_reason``, for stop strings (split across tokens, inside an accepted run of several
tokens, several at once, one the prefix of another, multi-byte ones) and stop token ids.

Every expectation comes from :func:`expected_stop`, the definition written as a loop over
prefixes of the unstopped output: the first prefix whose text holds a stop string ends the
request, and the text ends where the earliest of them begins.
"""

from __future__ import annotations

import pytest

from polyspec.config import SamplingParams, SpeculativeConfig
from polyspec.engine.request import Request
from polyspec.engine.stop import StopChecker

MAX_NEW = 40


def expected_stop(
    tokenizer, ids: list[int], stop=(), stop_token_ids=(), max_new: int = MAX_NEW
) -> tuple[list[int], str, str]:
    """(token_ids, text, finish_reason) of a request whose unstopped output is ``ids``."""
    for k in range(1, min(len(ids), max_new) + 1):
        if ids[k - 1] in stop_token_ids:
            return ids[:k], tokenizer.decode(ids[: k - 1]), "stop"
        text = tokenizer.decode(ids[:k])
        hits = [text.find(s) for s in stop if s in text]
        if hits:
            return ids[:k], text[: min(hits)], "stop"
    k = min(len(ids), max_new)
    return ids[:k], tokenizer.decode(ids[:k]), "length"


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from polyspec.testing import builders

    return builders.build_tiny_target(tmp_path_factory.mktemp("stop") / "target", seed=0)


@pytest.fixture(scope="module")
def tokenizer(target):
    from polyspec.model.loader import load_tokenizer

    return load_tokenizer(target)


# ------------------------------------------------------------------------- the checker alone


def _feed(tokenizer, ids: list[int], runs: list[int], **params) -> Request:
    """Append ``ids`` in runs of the given sizes (a verify round commits a run at once)."""
    checker = StopChecker(tokenizer, eos_token_ids=(2,))
    req = Request(0, None, [1], SamplingParams(max_new_tokens=len(ids) + 5, **params))
    at = 0
    for size in runs:
        checker.append(req, ids[at : at + size])
        at += size
        if req.finished:
            break
    return req, checker


@pytest.mark.parametrize(
    "stop",
    [
        ("cat",),  # inside one run, split over byte tokens
        ("dog", "at s"),  # several: the one met first wins, whatever the order given
        ("the mat", "the m"),  # one a prefix of the other: the shorter completes first
        ("日本語のテキスト",),  # 8 characters, 24 byte tokens: longer than any fixed window
        ("キスト x",),  # multi-byte characters followed by ASCII
        ("never there",),
    ],
)
@pytest.mark.parametrize("runs", ["one", "fives"])
def test_checker_cuts_text_exactly_before_the_stop(tokenizer, stop, runs):
    text = " the cat sat on the mat 日本語のテキスト xyz"
    ids = tokenizer.encode(text, add_special_tokens=False)
    sizes = [len(ids)] if runs == "one" else [5] * len(ids)
    req, checker = _feed(tokenizer, ids, sizes, stop=stop)
    want_ids, want_text, reason = expected_stop(tokenizer, ids, stop=stop, max_new=len(ids) + 5)
    assert req.output_ids == want_ids
    assert checker.text(req) == want_text
    assert (req.finish_reason or "length") == reason
    if stop != ("never there",):
        assert reason == "stop" and len(want_ids) < len(ids), "the stop must cut the run"
        first = min(text.find(s) for s in stop if s in text)
        assert want_text == text[:first], "expected_stop disagrees with the plain text"


def test_checker_stop_token_ids_keep_the_token_not_its_text(tokenizer):
    ids = tokenizer.encode(" the cat sat on the mat", add_special_tokens=False)
    stop_id = ids[6]
    req, checker = _feed(tokenizer, ids, [4, 4, 4, 4, 4, 4], stop_token_ids=(stop_id,))
    assert req.output_ids == ids[: ids.index(stop_id) + 1]
    assert checker.text(req) == tokenizer.decode(ids[: ids.index(stop_id)])
    assert req.finish_reason == "stop"
    # EOS likewise (unless ignore_eos), and a special EOS has no text anyway
    req, checker = _feed(tokenizer, ids[:3] + [2] + ids[3:], [8])
    assert req.output_ids == ids[:3] + [2] and req.finish_reason == "stop"
    assert checker.text(req) == tokenizer.decode(ids[:3])
    req, _ = _feed(tokenizer, ids[:3] + [2] + ids[3:], [8], ignore_eos=True)
    assert req.output_ids == (ids[:3] + [2] + ids[3:])[:8] and not req.finished


# ------------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def engines(target):
    from polyspec.engine.llm import LLM

    common = dict(target=target, backend="cpu", dtype="float32", max_batch_size=8,
                  max_context=128)  # fmt: skip
    plain = LLM(**common)
    # The target drafting for itself: every draft token is accepted, so each round commits
    # num_steps + 1 tokens and most stops fall inside an accepted run.
    spec = LLM(
        draft=target, speculative=SpeculativeConfig("standalone", num_steps=4, topk=1), **common
    )
    return {"plain": plain, "spec": spec}


@pytest.fixture(scope="module")
def unstopped(engines, tokenizer):
    prompts = [" the cat", " a c c", " once upon"]
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    outs = engines["plain"].generate(prompts, params)
    return prompts, [o.token_ids for o in outs]


def _ascii_span(tokenizer, ids: list[int], start_token: int) -> str | None:
    """A printable-ASCII string of 3 characters made of the end of token ``start_token``'s
    text and the start of the next tokens' (so split across tokens), if there is one."""
    pieces = [tokenizer.decode([t]) for t in ids]
    for i in range(start_token, len(ids) - 2):
        a, b, c = pieces[i], pieces[i + 1], pieces[i + 2]
        s = (a[-1:] + b + c)[:3]
        if len(s) == 3 and all(32 <= ord(ch) < 127 for ch in s) and a[-1:] and b:
            return s
    return None


def _cases(tokenizer, prompts, outputs):
    """(prompt, SamplingParams, description) covering each kind of stop."""
    cases = []
    for prompt, ids in zip(prompts, outputs):
        text = tokenizer.decode(ids)
        span = _ascii_span(tokenizer, ids, 6)
        if span is not None and text.find(span) > 0:
            cases.append((prompt, SamplingParams(stop=span), "split across tokens"))
            early = _ascii_span(tokenizer, ids, 2)
            if early is not None and early != span:
                cases.append((prompt, SamplingParams(stop=(span, early)), "several"))
            longer = text[text.find(span) : text.find(span) + 5]
            cases.append((prompt, SamplingParams(stop=(longer, span[:2])), "prefix of another"))
        later = [t for j, t in enumerate(ids) if j >= 5 and t not in ids[:j]]
        if later:
            cases.append((prompt, SamplingParams(stop_token_ids=(later[0],)), "stop token id"))
    cases.append((prompts[0], SamplingParams(stop="\x00never"), "never met"))
    return [
        (p, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, stop=s.stop,
                           stop_token_ids=s.stop_token_ids), what)
        for p, s, what in cases
    ]  # fmt: skip


@pytest.mark.parametrize("engine", ["plain", "spec"])
def test_engine_stops_exactly(engines, tokenizer, unstopped, engine):
    prompts, outputs = unstopped
    cases = _cases(tokenizer, prompts, outputs)
    kinds = {what for _, _, what in cases}
    assert kinds >= {"split across tokens", "several", "prefix of another", "stop token id"}, (
        f"the greedy outputs gave too few stop cases: {kinds}"
    )
    full = dict(zip(prompts, outputs))
    llm = engines[engine]
    outs = llm.generate([p for p, _, _ in cases], [s for _, s, _ in cases])
    cut_inside_a_run = 0
    for (prompt, params, what), out in zip(cases, outs):
        want_ids, want_text, reason = expected_stop(
            tokenizer, full[prompt], params.stop, params.stop_token_ids
        )
        assert out.token_ids == want_ids, what
        assert out.text == want_text, what
        assert out.finish_reason == reason, what
        if what != "never met":
            assert reason == "stop" and len(want_ids) < MAX_NEW, f"{what}: the stop was not met"
        # tokens of the last round after the stop were dropped
        cut_inside_a_run += 1 + sum(out.stats.accepted_per_round) > len(out.token_ids)
    if engine == "spec":
        assert cut_inside_a_run >= 3, f"only {cut_inside_a_run} stops fell inside a run"
