"""``polyspec serve`` end to end: a real uvicorn server on 127.0.0.1 (a free port) over the tiny
random checkpoints, driven by the real ``openai`` client (and raw HTTP for malformed bodies)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from polyspec import LLM, SamplingParams  # noqa: E402
from polyspec.serve import protocol  # noqa: E402
from polyspec.serve.app import ServeSettings  # noqa: E402
from polyspec.serve.server import BackgroundServer  # noqa: E402

MODEL = "tiny"
PROMPTS = [
    "The sea",
    "Hello there, how are you",
    "a",
    "Tell me about the history of the world in a few words, please, and then stop.",
    "The cat sat on",
    "Once upon a time in a land far away there was",
    "1 2 3 4",
    "What is the answer?",
]


def _spec_llm(models, backend="cpu", dtype="float32", **kw) -> LLM:
    return LLM(
        target=models["target"],
        draft=models["eagle3"],
        speculative={"algorithm": "eagle3", "num_steps": 3, "topk": 2, "num_draft_tokens": 5},
        backend=backend,
        dtype=dtype,
        max_context=256,
        **kw,
    )


@pytest.fixture(scope="module")
def llm(tiny_models) -> LLM:
    out = _spec_llm(tiny_models, max_batch_size=32)
    yield out
    out.shutdown()


@pytest.fixture(scope="module")
def server(llm):
    settings = ServeSettings(served_model_name=MODEL)
    with BackgroundServer(llm, settings) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _reference(llm: LLM, prompts: list[str], max_tokens: int, chat: bool = False) -> list[str]:
    """LLM.generate's text for each prompt alone."""
    params = SamplingParams(max_new_tokens=max_tokens)
    if chat:
        return [llm.chat(p, params)[0].text for p in prompts]
    return [llm.generate([p], params)[0].text for p in prompts]


def _metrics(server) -> dict[str, float]:
    text = urllib.request.urlopen(server.url + "/metrics", timeout=30).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def _wait_idle(server, timeout_s: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = _metrics(server)
        idle = m["polyspec_requests_running"] == 0 and m["polyspec_requests_waiting"] == 0
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def test_wire_fields_are_openai_names():
    from openai.types import completion_create_params as cp
    from openai.types.chat import completion_create_params as ccp

    completion = set(cp.CompletionCreateParamsBase.__annotations__)
    chat = set(ccp.CompletionCreateParamsBase.__annotations__) | {"stream"}
    completion |= {"stream"}
    assert protocol.COMPLETION_FIELDS - protocol.EXTENSION_FIELDS <= completion
    assert protocol.CHAT_FIELDS - protocol.EXTENSION_FIELDS <= chat


def test_endpoints_with_the_openai_client(server, client, llm):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    ref = _reference(llm, PROMPTS[:2], 24)
    ref_chat = _reference(llm, PROMPTS[:1], 24, chat=True)[0]

    out = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=24)
    assert [c.text for c in out.choices] == ref
    assert [c.index for c in out.choices] == [0, 1]
    ref_ids = [
        llm.generate([p], SamplingParams(max_new_tokens=24))[0].token_ids for p in PROMPTS[:2]
    ]
    assert out.usage.completion_tokens == sum(len(t) for t in ref_ids)
    assert out.usage.prompt_tokens == sum(len(llm.tokenizer.encode(p)) for p in PROMPTS[:2])

    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=24
    )
    assert chat.choices[0].message.content == ref_chat
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason in ("stop", "length")

    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPTS[0]}],
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, reasons, usage = [], [], None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            reasons.append(c.finish_reason)
        usage = chunk.usage or usage
    assert "".join(pieces) == ref_chat
    assert reasons[-1] in ("stop", "length") and all(r is None for r in reasons[:-1])
    out_ids = llm.chat(PROMPTS[0], SamplingParams(max_new_tokens=24))[0].token_ids
    assert usage.completion_tokens == len(out_ids)

    texts = ["", ""]
    for chunk in client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=24, n=2, stream=True
    ):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [ref[1], ref[1]]  # greedy: both choices alike

    # a stop string from the middle of the greedy text: cut before it, streamed or not
    stop = next(ref[1][i : i + 2] for i in range(4, len(ref[1]) - 2)
                if ref[1][i : i + 2].isascii() and ref[1][i : i + 2].isalnum())  # fmt: skip
    cut = ref[1][: ref[1].index(stop)]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, stop=stop)
    assert (out.choices[0].text, out.choices[0].finish_reason) == (cut, "stop")
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=24, stop=[stop], stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut

    m = _metrics(server)
    for name in (
        "polyspec_requests_running", "polyspec_requests_waiting", "polyspec_kv_slots_used",
        "polyspec_kv_slots_free", "polyspec_prompt_tokens_total",
        "polyspec_generation_tokens_total", "polyspec_rounds_total",
        "polyspec_time_to_first_token_seconds_count", "polyspec_inter_token_latency_seconds_count",
        "polyspec_e2e_request_latency_seconds_count", "polyspec_acceptance_length_count",
        "polyspec_acceptance_rate_per_position{position=1}",
    ):  # fmt: skip
        assert name in m, name
    assert m["polyspec_e2e_request_latency_seconds_count"] >= 6
    assert m["polyspec_phase_seconds_per_round{phase=draft}"] > 0  # cpu: timed by default
    assert m["polyspec_phase_seconds_per_round{phase=verify}"] > 0
    assert m["polyspec_acceptance_length_count"] > 0


def test_32_staggered_greedy_requests_match_generate_alone(server, client, llm):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
    ref = dict(zip(PROMPTS, _reference(llm, PROMPTS, 20)))
    ref = [ref[p] for p in prompts]

    def one(i: int) -> str:
        time.sleep(0.01 * i)  # staggered: requests join a running batch
        if i % 2:
            out = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=20)
            return out.choices[0].text
        stream = client.completions.create(
            model=MODEL, prompt=prompts[i], max_tokens=20, stream=True
        )
        return "".join(c.choices[0].text for c in stream if c.choices)

    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(one, range(32)))
    assert got == ref


def test_bf16_where_row_invariant(tiny_models):
    from polyspec.plugins import create_backend

    torch = pytest.importorskip("torch")
    if not create_backend("cpu").row_invariant(torch.bfloat16):
        pytest.skip("the cpu backend is not row-invariant in bf16 here")
    llm = _spec_llm(tiny_models, dtype="bfloat16", max_batch_size=8)
    ref = _reference(llm, PROMPTS, 16)
    with BackgroundServer(llm, ServeSettings(served_model_name=MODEL)) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        with ThreadPoolExecutor(8) as pool:
            got = list(
                pool.map(
                    lambda p: (
                        c.completions.create(model=MODEL, prompt=p, max_tokens=16).choices[0].text
                    ),
                    PROMPTS,
                )
            )
    assert got == ref


def test_200_streams_a_third_cancelled_then_nothing_held(server, llm):
    lengths = (4, 9, 16)
    ref = {
        (p, n): t
        for n in lengths
        for p, t in zip(PROMPTS, _reference(llm, PROMPTS, n))
    }  # fmt: skip

    async def run_all():
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                                timeout=120)  # fmt: skip

        async def one(i: int):
            p, n = PROMPTS[i % len(PROMPTS)], lengths[i % len(lengths)]
            await asyncio.sleep(0.002 * (i % 50))
            stream = await ac.completions.create(model=MODEL, prompt=p, max_tokens=n, stream=True)
            text, reason = "", None
            async for chunk in stream:
                for c in chunk.choices:
                    text += c.text
                    reason = c.finish_reason or reason
                if i % 3 == 0 and text:  # cancelled mid-stream
                    await stream.close()
                    return None
            return p, n, text, reason

        results = await asyncio.gather(*(one(i) for i in range(200)))
        await ac.close()
        return results

    results = asyncio.run(run_all())
    done = [r for r in results if r is not None]
    assert len(done) >= 120
    for p, n, text, reason in done:
        assert reason in ("stop", "length")
        assert text == ref[(p, n)]
    m = _wait_idle(server)
    assert m["polyspec_requests_running"] == 0
    assert m["polyspec_kv_slots_used"] == 0
    assert m["polyspec_engine_requests_finished_total{finish_reason=abort}"] >= 1


def test_seeded_sampling_alone_or_among_others(client):
    body = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=0.9, top_p=0.95,
                seed=1234)  # fmt: skip
    alone = client.completions.create(**body).choices[0].text

    def other(i: int) -> str:
        kw = dict(model=MODEL, prompt=PROMPTS[i % 8], max_tokens=12 + i)
        if i % 2:
            kw.update(temperature=1.0, seed=i)
        return client.completions.create(**kw).choices[0].text

    with ThreadPoolExecutor(9) as pool:
        futures = [pool.submit(other, i) for i in range(8)]
        mixed = pool.submit(lambda: client.completions.create(**body).choices[0].text)
        assert mixed.result() == alone
        assert all(isinstance(f.result(), str) for f in futures)
    again = [client.completions.create(**{**body, "seed": s}).choices[0].text for s in (1, 2, 3)]
    assert len({alone, *again}) > 1  # the seed decides the text: it is really sampled


BAD_REQUESTS = [
    # (endpoint, raw body, status, text the message must hold, param)
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": "ten"}, 422, "max_tokens", "max_tokens"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens = -1", "max_tokens"),
    ("completions", '{"model": "tiny", "prompt": "x", "temperature": NaN}', 400, "temperature = nan", "temperature"),
    ("completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p = 0.0", "top_p"),
    ("completions", {"model": "gpt-9", "prompt": "x"}, 404, "'gpt-9' is not served", "model"),
    ("completions", {"model": MODEL, "prompt": "word " * 300}, 400, "max_context = 256", "max_tokens"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": 255}, 400, "max_context", "max_tokens"),
    ("completions", '{"model": "tiny", "prompt": ', 400, "not valid JSON", None),
    ("completions", "[" * 100_000, 400, "not valid JSON", None),
    ("completions", {"model": MODEL, "prompt": "x", "seed": 2**64}, 400, "seed = 18446744073709551616", "seed"),
    ("completions", [1, 2], 422, "JSON object", None),
    ("completions", {"model": MODEL}, 422, "prompt is required", "prompt"),
    ("completions", {"model": MODEL, "prompt": [1, 99999]}, 400, "outside the vocabulary", "prompt"),
    ("completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n = 0", "n"),
    ("completions", {"model": MODEL, "prompt": "x", "logprobs": 2}, 400, "logprobs is not supported", "logprobs"),
    ("completions", {"model": MODEL, "prompt": "x", "frobnicate": 1}, 400, "unknown field 'frobnicate'", "frobnicate"),
    ("completions", {"model": MODEL, "prompt": "x", "stop": [""]}, 400, "empty string", "stop"),
    ("completions", {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream", "stream_options"),
    ("chat/completions", {"model": MODEL, "messages": "hi"}, 422, "messages must be an array", "messages"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", "messages[0].role"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, 400, "response_format type 'xml'", "response_format"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}}, 422, "json_schema", "response_format"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}, "regex": "a"}, 400, "only one structured-output field", "response_format"),
    ("completions", {"model": MODEL, "prompt": "x", "regex": "a(b"}, 400, "unclosed group", "regex"),
    ("completions", {"model": MODEL, "prompt": "x", "guided_json": {"type": "foo"}}, 400, "Invalid type: foo", "json_schema"),
    ("completions", {"model": MODEL, "prompt": "x", "grammar": "start: x"}, 400, "unknown name", "grammar"),
    ("completions", {"model": MODEL, "prompt": "x", "choice": []}, 400, "choice", "choice"),
    ("completions", {"model": MODEL, "prompt": "x", "choice": "a"}, 422, "list of strings", "choice"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400, "tools", "tools"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "max_completion_tokens": 6}, 400, "disagree", "max_completion_tokens"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": True}, 422, "temperature must be a number", "temperature"),
]  # fmt: skip


@pytest.mark.parametrize("endpoint,body,status,says,param", BAD_REQUESTS)
def test_bad_request_table(server, endpoint, body, status, says, param):
    data = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{server.url}/v1/{endpoint}", content=data,
                   headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert says in err["message"], err
    assert err["param"] == param
    assert set(err) == {"message", "type", "param", "code"}
    assert "Traceback" not in r.text


def test_key_size_route_and_starting(tiny_models, llm):
    settings = ServeSettings(served_model_name=MODEL, api_key="sesame", max_request_bytes=2048)
    with BackgroundServer(None, settings) as srv:
        url = srv.url
        r = httpx.get(url + "/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "starting"
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x"},
                       headers={"authorization": "Bearer sesame"})  # fmt: skip
        assert r.status_code == 503 and r.headers["retry-after"]
        srv.state.attach(llm)
        good = openai.OpenAI(base_url=url + "/v1", api_key="sesame", max_retries=0)
        bad = openai.OpenAI(base_url=url + "/v1", api_key="open", max_retries=0)
        assert (
            good.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text
            is not None
        )
        with pytest.raises(openai.AuthenticationError, match="invalid API key"):
            bad.completions.create(model=MODEL, prompt="x", max_tokens=2)
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x" * 4000},
                       headers={"authorization": "Bearer sesame"})  # fmt: skip
        assert (
            r.status_code == 413 and "over the limit of 2048 bytes" in r.json()["error"]["message"]
        )
        r = httpx.get(url + "/v1/nothing-here")
        assert r.status_code == 404 and "no route" in r.json()["error"]["message"]
        assert httpx.get(url + "/health").status_code == 200


def test_full_queue_answers_429_with_retry_after(tiny_models):
    small = LLM(target=tiny_models["target"], backend="cpu", dtype="float32", max_batch_size=1,
                max_context=256)  # fmt: skip
    settings = ServeSettings(served_model_name=MODEL, max_queued_requests=1)
    with BackgroundServer(small, settings) as srv:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 200, "ignore_eos": True}

        def post():
            return httpx.post(srv.url + "/v1/completions", json=body, timeout=120)

        with ThreadPoolExecutor(6) as pool:
            answers = [f.result() for f in [pool.submit(post) for _ in range(6)]]
    statuses = sorted(a.status_code for a in answers)
    assert 200 in statuses and 429 in statuses, statuses
    limited = next(a for a in answers if a.status_code == 429)
    assert limited.headers["retry-after"] == "1"
    assert "--max-queued-requests" in limited.json()["error"]["message"]
    small.shutdown()


def test_a_failing_round_fails_its_requests_only(server, client, llm):
    worker = llm.worker
    real = worker.decode
    calls = {"n": 0}

    def flaky(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected device fault")
        return real(*args, **kw)

    worker.decode = flaky
    try:
        with pytest.raises(openai.InternalServerError, match="injected device fault"):
            client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8)
        with pytest.raises(openai.APIError, match="injected device fault"):
            calls["n"] = 0
            for _ in client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8,
                                               stream=True):  # fmt: skip
                pass
    finally:
        worker.decode = real
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8)
    assert out.choices[0].text == _reference(llm, PROMPTS[:1], 8)[0]


def test_ascend_like_backend_serves_the_same_greedy_texts(tiny_models, llm):
    from plugin_packages import ensure_test_plugins_installed

    ensure_test_plugins_installed()
    ref = _reference(llm, PROMPTS[:4], 12)
    other = _spec_llm(tiny_models, backend="ascend-like", max_batch_size=4, page_size=128)
    with BackgroundServer(other, ServeSettings(served_model_name=MODEL)) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(
                lambda p: c.completions.create(model=MODEL, prompt=p, max_tokens=12)
                .choices[0].text, PROMPTS[:4]))  # fmt: skip
    other.shutdown()
    assert got == ref


def test_cli_serves_and_exits_0_on_sigterm(tiny_models, tmp_path):
    cmd = [sys.executable, "-m", "polyspec", "serve", "--port", "0", "--target",
           str(tiny_models["target"]), "--algorithm", "none", "--backend", "cpu", "--dtype",
           "float32", "--served-model-name", MODEL, "--shutdown-grace", "30"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=env)  # fmt: skip
    try:
        url = None
        for line in proc.stderr:
            if line.startswith("polyspec serve: ready on "):
                url = line.split()[4]
                assert "backend cpu" in line and "plain decoding" in line
                break
        assert url, "no ready line"
        threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        stream = c.completions.create(model=MODEL, prompt="x", max_tokens=60, stream=True,
                                      extra_body={"ignore_eos": True})  # fmt: skip
        it = iter(stream)
        first = next(it)
        proc.send_signal(signal.SIGTERM)
        reasons = [first.choices[0].finish_reason] + [ch.choices[0].finish_reason for ch in it]
        assert reasons[-1] == "length"  # the running request finished within the grace
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bench_serve_against_a_running_server(server, tmp_path):
    from polyspec.cli import main

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:4]))
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(["bench-serve", "--base-url", server.url + "/v1", "--dataset", str(data),
               "--concurrency", "1,2", "--max-new-tokens", "8", "--json", str(out), "--plot",
               str(png), "--no-progress"])  # fmt: skip
    assert rc == 0
    rep = json.loads(out.read_text())
    runs = rep["systems"]["server"]
    assert set(runs) == {"1", "2"}
    for r in runs.values():
        assert r["completed"] == 4 and r["failed"] == 0
        assert r["output_tokens"] > 0 and r["output_tokens_per_s"] > 0
        assert r["ttft_ms"]["p50"] > 0 and r["e2e_ms"]["p99"] >= r["e2e_ms"]["p50"]
        assert r["mean_acceptance_length"] >= 1.0
    assert png.stat().st_size > 1000


def test_wire_parsing_without_a_server():
    model = protocol.ServedModel(MODEL, 300, SamplingParams(max_new_tokens=7), lambda t: [1] * len(t),
                                 lambda m: [2])  # fmt: skip
    p = protocol.parse_completion({"model": MODEL, "prompt": [[5, 6], [7]], "n": 2, "seed": 3},
                                  model)  # fmt: skip
    assert p.prompts == [[5, 6], [7]] and p.n == 2
    assert [q.seed for q in p.params] == [3, 4] and p.params[0].max_new_tokens == 7
    c = protocol.parse_chat({"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}]}], "max_completion_tokens": 3, "top_k": -1}, model)  # fmt: skip
    assert c.prompts == [[2]] and c.params[0].max_new_tokens == 3 and c.params[0].top_k == 0


def test_bench_serve_flags():
    from polyspec.cli import build_parser
    from polyspec.commands.bench_serve import engine_argv, parse_concurrency, parse_systems

    assert parse_concurrency("1,4,16") == [1, 4, 16]
    assert parse_systems("spec") == [("spec", False)]
    with pytest.raises(Exception, match="--systems 'spec,spec' is invalid"):
        parse_systems("spec,spec")
    with pytest.raises(Exception, match="'0' is not a positive integer"):
        parse_concurrency("1,0")
    args = build_parser().parse_args(
        ["bench-serve", "--draft", "h", "--algorithm", "eagle3", "--topk", "2", "--dtype",
         "float32", "--max-batch-size", "4"]
    )  # fmt: skip
    spec = engine_argv(args, plain=False)
    assert spec[spec.index("--draft") + 1] == "h" and "--topk" in spec
    plain = engine_argv(args, plain=True)
    assert "--draft" not in plain and "--topk" not in plain
    assert plain[-2:] == ["--algorithm", "none"] and "--max-batch-size" in plain


def test_structured_output_over_http(server, client):
    """response_format json_schema / json_object and the regex / choice extensions through
    the openai client on the speculative engine: the outputs follow their constraints."""
    pytest.importorskip("llguidance")
    jsonschema = pytest.importorskip("jsonschema")
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 5},
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "n", "ok"],
        "additionalProperties": False,
    }
    messages = [{"role": "user", "content": "Give me a record"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": schema}}
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=60, response_format=fmt, seed=3
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), schema)
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, response_format={"type": "json_object"}
    )
    assert r.choices[0].message.content.startswith("{")
    r = client.completions.create(
        model=MODEL, prompt="Mail:", max_tokens=30, extra_body={"regex": r"[a-c]{3}@d\.org"}
    )
    assert r.choices[0].finish_reason == "stop"
    assert re.fullmatch(r"[a-c]{3}@d\.org", r.choices[0].text), r.choices[0].text
    r = client.completions.create(
        model=MODEL, prompt="Pick:", max_tokens=30, n=3, temperature=1.0, seed=1,
        extra_body={"guided_choice": ["left", "right"]},
    )  # fmt: skip
    assert [c.text in ("left", "right") for c in r.choices] == [True] * 3
