"""The engine loop: streaming events, requests that fail alone, abort, shutdown, threads."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polyspec import LLM, SamplingParams, SpeculativeConfig
from polyspec.engine.loop import EngineLoop, QueueFull, RequestError
from polyspec.engine.stream import held_back
from polyspec.testing.builders import build_tiny_eagle3, build_tiny_target

VOCAB = 300  # the tiny checkpoints' vocabulary


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("loop")
    target = build_tiny_target(root / "t", seed=0)
    return target, build_tiny_eagle3(root / "e3", target, seed=2)


def _plain(paths, **kw) -> LLM:
    kw = {"backend": "cpu", "dtype": "float32", "max_batch_size": 4, "max_context": 128, **kw}
    return LLM(target=str(paths[0]), **kw)


def _warm(llm: LLM) -> LLM:
    """Run once (scratch lanes are allocated on first use), then note the idle free slots."""
    llm.generate(prompt_token_ids=[[5]], sampling_params=SamplingParams(max_new_tokens=2))
    llm._idle_slots = llm.kv_slots_free
    return llm


@pytest.fixture(scope="module")
def plain(paths):
    llm = _warm(_plain(paths))
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def spec(paths):
    llm = _plain(
        paths,
        draft=str(paths[1]),
        speculative=SpeculativeConfig(algorithm="eagle3", num_steps=3, topk=2),
    )
    yield _warm(llm)
    llm.shutdown()


def _idle(llm: LLM) -> None:
    """Nothing left in the scheduler or the worker, and every KV slot free again."""
    sched = llm.scheduler
    assert not (sched.waiting or sched.prefilling or sched.decoding or sched.reserved)
    assert not llm.worker.states
    assert llm.kv_slots_free == llm._idle_slots


GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


def test_events_join_to_the_output(plain):
    want = plain.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=GREEDY)[0]
    handle = plain.engine.submit([5, 6, 7], GREEDY)
    events = list(handle)
    assert [e.finished for e in events] == [False] * (len(events) - 1) + [True]
    assert events[-1].finish_reason == "length" and events[-1].error is None
    assert sum((e.token_ids for e in events), []) == want.token_ids
    assert "".join(e.text for e in events) == want.text == handle.result().text
    assert handle.result().token_ids == want.token_ids
    _idle(plain)


def test_stop_string_is_never_streamed(plain):
    """Joined event texts equal the final text, so no part of a cut stop string was sent."""
    full = plain.generate("the cat", SamplingParams(max_new_tokens=30, ignore_eos=True))[0].text
    clean = full.replace("\ufffd", "")
    stop = clean[len(clean) // 2 : len(clean) // 2 + 3]
    assert len(stop) == 3
    params = SamplingParams(max_new_tokens=30, ignore_eos=True, stop=(stop,))
    ids = plain.tokenizer.encode("the cat")
    handle = plain.engine.submit(ids, params)
    events = list(handle)
    out = handle.result()
    assert out.finish_reason == "stop" and stop not in out.text
    assert "".join(e.text for e in events) == out.text
    assert full.startswith(out.text)


def test_text_stream_never_splits_a_character(plain):
    """Byte-level tokens split multi-byte characters: the pieces handed out hold whole
    characters only, and joined they are the final text (the stop string cut)."""
    from polyspec.engine.request import Request
    from polyspec.engine.stream import TextStream

    stop = plain.scheduler.stop
    text = "héllo wörld, ça va? 😀 naïve café — the end of it"
    ids = plain.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.encode()) // 2  # the non-ASCII bytes are tokens of their own
    params = SamplingParams(max_new_tokens=len(ids), ignore_eos=True, stop=("end of",))
    req, stream, pieces = Request(0, None, [1], params), TextStream(stop), []
    for t in ids:
        stop.append(req, [t])
        pieces.append(stream.advance(req))
        if req.finished:
            break
    assert req.finish_reason == "stop"
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == stop.text(req) == text[: text.index("end of")]


def test_held_back():
    assert held_back("abc\ufffd", ()) == 1
    assert held_back("xx ST", ("STOP",)) == 2
    assert held_back("xx S", ("STOP", "Sa")) == 1
    assert held_back("xxSTOP", ("STOP",)) == 0  # a whole stop string is the checker's business


def test_async_iteration(plain):
    want = plain.generate(prompt_token_ids=[[9, 8]], sampling_params=GREEDY)[0]

    async def run():
        handle = plain.engine.submit([9, 8], GREEDY)
        ids = [t async for e in handle for t in e.token_ids]
        return ids, await handle.result_async()

    ids, out = asyncio.run(run())
    assert ids == want.token_ids == out.token_ids


def test_bad_requests_are_refused_before_admission(plain):
    engine = plain.engine
    cases = [
        ([5, VOCAB], GREEDY, "prompt_token_ids", "outside the vocabulary"),
        ([5, -1], GREEDY, "prompt_token_ids", "outside the vocabulary"),
        ([], GREEDY, "prompt_token_ids", "empty"),
        ([5, 1.5], GREEDY, "prompt_token_ids", "not an integer"),
        ("hello", GREEDY, "prompt_token_ids", "list of token ids"),
        ([5], {"max_new_tokens": 3}, "sampling_params", "SamplingParams"),
        ([5] * 100, SamplingParams(max_new_tokens=40), "max_new_tokens", "max_context = 128"),
        ([5], SamplingParams(stop_token_ids=(VOCAB,)), "sampling.stop_token_ids", "vocabulary"),
    ]
    for ids, params, field, words in cases:
        with pytest.raises(RequestError, match=words) as info:
            engine.submit(ids, params)
        assert info.value.field == field
        assert "\n" not in str(info.value)
    _idle(plain)


def test_generate_names_the_bad_request_and_runs_none(plain):
    submitted = plain.engine.stats().requests_finished_total
    with pytest.raises(RequestError, match=r"^request 2: prompt_token_ids\[1\] = 400") as info:
        plain.generate(prompt_token_ids=[[5], [6], [7, 400]], sampling_params=GREEDY)
    assert info.value.index == 2
    assert plain.engine.stats().requests_finished_total == submitted  # none ran
    _idle(plain)
    out = plain.generate(prompt_token_ids=[[5]], sampling_params=GREEDY)[0]  # still serving
    assert out.finish_reason == "length"
    with pytest.raises(RequestError, match=r"^request 1: prompts\[1\] is a int, not a string"):
        plain.generate(["fine", 5])
    with pytest.raises(RequestError, match=r"^request 0: sampling params must be"):
        plain.generate(["fine"], sampling_params=[{"max_new_tokens": 3}])
    _idle(plain)


def test_seed_out_of_range_is_a_config_error():
    from polyspec.errors import ConfigError

    with pytest.raises(ConfigError, match=r"sampling.seed = 9223372036854775808 is invalid"):
        SamplingParams(seed=2**63)
    SamplingParams(seed=2**63 - 1)


def _failing_once(obj, name: str, after: int = 0):
    """Make ``obj.name`` raise on its ``after + 1``-th call only."""
    real = getattr(obj, name)
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == after + 1:
            raise RuntimeError("injected device fault\nsecond line")
        return real(*args, **kwargs)

    setattr(obj, name, wrapper)
    return lambda: delattr(obj, name)


@pytest.mark.parametrize("which", ["plain", "spec"])
def test_a_failing_round_fails_only_its_requests(which, request):
    llm = request.getfixturevalue(which)
    want = llm.generate(prompt_token_ids=[[5, 6], [7]], sampling_params=GREEDY)
    undo = _failing_once(llm.worker, "decode", after=3)
    try:
        outs = llm.generate(prompt_token_ids=[[5, 6], [7]], sampling_params=GREEDY)
    finally:
        undo()
    assert [o.finish_reason for o in outs] == ["error", "error"]
    assert outs[0].error == "RuntimeError: injected device fault"
    assert len(outs[0].token_ids) == 4  # prefill token + 3 good rounds' tokens kept
    _idle(llm)
    again = llm.generate(prompt_token_ids=[[5, 6], [7]], sampling_params=GREEDY)
    assert [o.token_ids for o in again] == [o.token_ids for o in want]


def test_a_failing_prefill_spares_running_requests(plain):
    long = SamplingParams(max_new_tokens=60, ignore_eos=True)
    want = plain.generate(prompt_token_ids=[[5, 6]], sampling_params=long)[0]
    engine = plain.engine
    first = engine.submit([5, 6], long)
    next(iter(first))  # decoding now
    undo = _failing_once(plain.worker, "prefill")
    try:
        second = engine.submit([7, 8], GREEDY).result(timeout=30)
    finally:
        undo()
    assert second.finish_reason == "error" and "injected" in second.error
    assert first.result(timeout=30).token_ids == want.token_ids
    _idle(plain)


def test_abort_frees_the_request(plain):
    engine = plain.engine
    handle = engine.submit([5, 6], SamplingParams(max_new_tokens=100, ignore_eos=True))
    next(iter(handle))
    handle.abort()
    out = handle.result(timeout=30)
    assert out.finish_reason == "abort" and len(out.token_ids) < 100
    _idle(plain)


def test_queue_full_and_shutdown(paths):
    llm = _plain(paths, max_batch_size=1)
    idle = llm.kv_slots_free
    engine = EngineLoop(llm, max_queued_requests=2)
    assert llm.engine is engine  # generate uses the loop built for the LLM
    with pytest.raises(RuntimeError, match="already has an engine loop"):
        EngineLoop(llm)
    slow = SamplingParams(max_new_tokens=100, ignore_eos=True)
    running = engine.submit([5], slow)
    next(iter(running))  # admitted: it holds the one batch row
    waiting = [engine.submit([6], slow), engine.submit([7], slow)]
    with pytest.raises(QueueFull, match="max_queued_requests = 2"):
        engine.submit([8], slow)
    engine.shutdown(grace_s=0.0)
    outs = [h.result(timeout=30) for h in [running, *waiting]]
    assert [o.finish_reason for o in outs] == ["abort"] * 3
    assert len(outs[0].token_ids) < 100 and outs[1].token_ids == outs[2].token_ids == []
    assert llm.kv_slots_free == idle and not engine.alive
    with pytest.raises(RuntimeError, match="shut down"):
        engine.submit([5], slow)
    assert llm.engine is not engine  # a fresh loop after a shutdown
    assert llm.generate(prompt_token_ids=[[5]], sampling_params=GREEDY)[0].finish_reason == "length"


def test_threads_share_one_llm(plain):
    """8 threads x 16 greedy requests of mixed lengths on one LLM: each output equals the
    request's output when it runs alone."""
    rng = random.Random(0)
    pool = [
        ([rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 12))],
         SamplingParams(max_new_tokens=rng.randint(1, 24)))
        for _ in range(24)
    ]  # fmt: skip
    alone = [plain.generate(prompt_token_ids=[ids], sampling_params=p)[0] for ids, p in pool]
    picks = [[rng.randrange(len(pool)) for _ in range(16)] for _ in range(8)]
    got: dict[int, list] = {}
    errors = []

    def worker(t: int) -> None:
        try:
            order = picks[t]
            # half the threads make one call of 16, the others 16 calls of one
            if t % 2:
                outs = plain.generate(
                    prompt_token_ids=[pool[i][0] for i in order],
                    sampling_params=[pool[i][1] for i in order],
                )
            else:
                outs = [
                    plain.generate(prompt_token_ids=[pool[i][0]], sampling_params=pool[i][1])[0]
                    for i in order
                ]
            got[t] = outs
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not errors, errors
    for t in range(8):
        for i, out in zip(picks[t], got[t]):
            assert out.token_ids == alone[i].token_ids
            assert out.text == alone[i].text
            assert out.finish_reason == alone[i].finish_reason
    _idle(plain)


_GOOD = [([5, 6, 7], 6), ([9], 3), ([11, 12], 8)]


@st.composite
def _bad_request(draw):
    kind = draw(st.sampled_from(["vocab", "negative", "empty", "long", "type", "params", "float"]))
    if kind == "vocab":
        return [5, draw(st.integers(VOCAB, 2**70))], GREEDY
    if kind == "negative":
        return [draw(st.integers(-(2**70), -1))], GREEDY
    if kind == "empty":
        return [], GREEDY
    if kind == "long":
        n = draw(st.integers(120, 300))
        return [5] * n, SamplingParams(max_new_tokens=4)
    if kind == "type":
        return draw(st.sampled_from([None, "abc", 5, {"a": 1}, [None], [[1]], ["1"]])), GREEDY
    if kind == "float":
        return [5, draw(st.floats(allow_nan=True))], GREEDY
    return [5], draw(st.sampled_from([3, "greedy", {"max_new_tokens": 2}]))


@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(st.lists(st.one_of(st.sampled_from(range(len(_GOOD))), _bad_request()), max_size=6))
def test_fuzz_bad_requests_among_good_ones(spec, want_good, mix):
    """Random malformed requests among good ones, on one engine: each bad one is refused with a
    RequestError (no other exception escapes), the good ones finish with their text, and
    every KV slot comes back."""
    engine = spec.engine
    handles = []
    for item in mix:
        if isinstance(item, int):
            ids, n = _GOOD[item]
            handles.append((item, engine.submit(ids, SamplingParams(max_new_tokens=n))))
        else:
            ids, params = item
            with pytest.raises(RequestError):
                engine.submit(ids, params)
    for i, h in handles:
        out = h.result(timeout=60)
        assert (out.token_ids, out.text) == want_good[i]
    _idle(spec)


@pytest.fixture(scope="module")
def want_good(spec):
    outs = [
        spec.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_new_tokens=n))[0]
        for ids, n in _GOOD
    ]
    return [(o.token_ids, o.text) for o in outs]
