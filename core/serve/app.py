"""The FastAPI application: OpenAI's endpoints over one :class:`~polyspec.engine.loop.EngineLoop`.

No model work runs on the event loop: a request is validated and tokenized here, submitted to
the engine loop's thread (one request per choice), and its events come back through the
handle's asyncio iterator as each round ends. A client that disconnects has its requests
aborted at once (:mod:`polyspec.serve.responses`), which frees their KV slots at the next round.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from polyspec.config import SamplingParams
from polyspec.errors import RequestError
from polyspec.serve import api_errors, protocol
from polyspec.serve.api_errors import ApiError
from polyspec.serve.metrics import CONTENT_TYPE, ServerMetrics
from polyspec.serve.responses import DeferredJSON, EventStream

if TYPE_CHECKING:
    from polyspec.engine.llm import LLM
    from polyspec.engine.loop import EngineLoop, RequestHandle

_log = logging.getLogger("polyspec.serve")


@dataclasses.dataclass(frozen=True)
class ServeSettings:
    """The server's own settings (the engine's come from the engine flags / config file).

    ``served_model_name`` None: the target's file or directory name. ``api_key``: when set,
    every ``/v1`` request must send ``Authorization: Bearer <api_key>``.
    ``max_queued_requests``: requests (choices) that may wait for admission before new ones
    get a 429 (None: no limit). ``max_request_bytes``: larger bodies get a 413.
    ``shutdown_grace_s``: on SIGTERM, how long running requests may go on before they are
    aborted. ``phase_times``: time the worker's phases (draft, verify, ...) for ``/metrics``:
    "on", "off", or "auto" = where the backend runs kernels synchronously (the timer
    synchronises the device at each phase boundary, which would slow an asynchronous one)."""

    served_model_name: str | None = None
    api_key: str | None = None
    max_queued_requests: int | None = None
    max_request_bytes: int = 16 * 1024 * 1024
    shutdown_grace_s: float = 30.0
    phase_times: str = "auto"


def default_model_name(llm: LLM) -> str:
    """The target's file name without its extension, or its directory name."""
    path = llm.target_path
    if path is None:
        return "polyspec"
    path = Path(path)
    return path.stem if path.is_file() else path.name


class ServerState:
    """What the app serves. The engine arrives once the model is loaded (:meth:`attach`);
    until then every ``/v1`` request and ``/health`` answer 503."""

    def __init__(self, settings: ServeSettings):
        self.settings = settings
        self.llm: LLM | None = None
        self.model: protocol.ServedModel | None = None
        self.stopping = False
        self.created = protocol.now()
        self.metrics = ServerMetrics(self._stats, self._num_steps, self._reserved_kv)
        self._ids = itertools.count()

    def attach(self, llm: LLM, default_sampling: SamplingParams | None = None) -> None:
        """Serve ``llm`` through its engine loop (``llm.engine``, which ``LLM.generate`` uses
        too, so both may run at once). ``default_sampling``: the values of the sampling fields
        a request leaves out (None: ``SamplingParams()``)."""
        mode = self.settings.phase_times
        llm.worker.timer.enabled = mode == "on" or (
            mode == "auto" and not llm.backend.capabilities.async_execution
        )
        tok = llm.tokenizer
        if tok is None:

            def no_text(*_: Any) -> list[int]:
                raise api_errors.bad_request(
                    "this model was loaded without a tokenizer: send prompt as token ids to "
                    "/v1/completions",
                    "prompt",
                )

            encode, chat = no_text, no_text
        else:
            encode = tok.encode

            def chat(messages: list[dict]) -> list[int]:
                if not tok.chat_template:
                    raise api_errors.bad_request(
                        "this model has no chat template: use /v1/completions", "messages"
                    )
                try:
                    return list(tok.apply_chat_template(messages, tokenize=True))
                except Exception as exc:  # the template's own checks (role order, ...)
                    raise api_errors.bad_request(
                        f"messages: the model's chat template refused them: {exc}", "messages"
                    ) from None

        self.model = protocol.ServedModel(
            name=self.settings.served_model_name or default_model_name(llm),
            vocab_size=int(llm.target.config.vocab_size),
            default_sampling=default_sampling or SamplingParams(),
            encode=encode,
            apply_chat_template=chat,
        )
        self.llm = llm

    @property
    def engine(self) -> EngineLoop | None:
        """The LLM's engine loop (None before :meth:`attach`), with this server's queue limit."""
        if self.llm is None:
            return None
        engine = self.llm.engine
        engine.max_queued_requests = self.settings.max_queued_requests
        return engine

    def shutdown(self, grace_s: float = 0.0) -> None:
        """Stop the engine loop (blocking: call it off the event loop)."""
        self.stopping = True
        if self.llm is not None:
            self.llm.shutdown(grace_s)

    def next_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}-{secrets.token_hex(4)}"

    def _stats(self):
        return None if self.llm is None else self.engine.stats()

    def _reserved_kv(self) -> int:
        return 0 if self.llm is None else int(getattr(self.llm.worker, "scratch_kv", 0))

    def _num_steps(self) -> int:
        spec = None if self.llm is None else self.llm.config.speculative
        if spec is None or self.llm.draft is None:
            return 0
        return max(t[1] for t in spec.trees)


@dataclasses.dataclass
class _Choice:
    """One choice of a request: its engine handle and what the server measured."""

    index: int
    prompt_index: int
    handle: RequestHandle
    arrival: float
    texts: list[str] = dataclasses.field(default_factory=list)
    num_tokens: int = 0
    last: float | None = None  # time of the last event that brought tokens
    finish_reason: str | None = None
    error: str | None = None


_ENGINE_FIELDS = {"max_new_tokens": "max_tokens", "prompt_token_ids": "prompt"}


def _wire_field(field: str, kind: str) -> str:
    name = field.removeprefix("sampling.")
    name = _ENGINE_FIELDS.get(name, name)
    return "messages" if kind == "chat" and name == "prompt" else name


def create_app(state: ServerState) -> FastAPI:
    """The FastAPI app over ``state`` (its engine may be attached later)."""
    app = FastAPI(title="polyspec", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.polyspec = state
    metrics = state.metrics

    def error_response(err: ApiError) -> JSONResponse:
        metrics.http_errors.labels(str(err.status)).inc()
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, err: ApiError) -> JSONResponse:
        return error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}: see docs/serving.md"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return error_response(ApiError(exc.status_code, message, code=f"http_{exc.status_code}"))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        cause = f"{type(exc).__name__}: {exc}".splitlines()[0]
        _log.exception("internal error")
        return error_response(ApiError(500, f"internal error: {cause}", type="server_error"))

    def ready() -> None:
        if state.stopping:
            raise api_errors.stopping()
        if state.engine is None:
            raise api_errors.starting()

    def authorize(request: Request) -> None:
        key = state.settings.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        token = given[7:] if given[:7].lower() == "bearer " else ""
        if not secrets.compare_digest(token.encode(), key.encode()):
            raise api_errors.unauthorized()

    async def read_json(request: Request) -> dict:
        limit = state.settings.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise api_errors.too_large(int(declared), limit)
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise api_errors.too_large(len(body), limit)
        try:
            data = json.loads(body)
        except (ValueError, RecursionError) as exc:
            raise api_errors.bad_request(
                f"the body is not valid JSON ({exc}); send a JSON object", code="invalid_json"
            ) from None
        if not isinstance(data, dict):
            raise api_errors.wrong_type("the body must be a JSON object, got a JSON array or value")
        return data

    @app.get("/health")
    async def health() -> Response:
        ready()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        authorize(request)
        ready()
        return JSONResponse(protocol.model_list(state.model.name, state.created))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, protocol.parse_completion, "cmpl")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, protocol.parse_chat, "chatcmpl")

    async def generate(request: Request, parse: Callable, prefix: str) -> Response:
        authorize(request)
        ready()
        arrival = time.perf_counter()
        body = await read_json(request)
        model = state.model
        name = protocol.check_model(body, model.name)
        if name != model.name:
            raise api_errors.model_not_found(name, model.name)
        parsed: protocol.ParsedRequest = parse(body, model)
        choices = submit(parsed, arrival)
        rid, created = state.next_id(prefix), protocol.now()

        def abort_unfinished() -> None:
            for c in choices:
                if c.finish_reason is None:
                    c.handle.abort()

        if parsed.stream:
            chunks = stream_chunks(parsed, choices, rid, created)
            return EventStream(chunks, on_close=abort_unfinished)

        async def compute() -> dict:
            async for _ in events(choices):
                pass
            failed = [c for c in choices if c.finish_reason in ("error", "abort")]
            if failed:
                err = _failure(failed[0])
                metrics.http_errors.labels(str(err.status)).inc()
                raise err
            texts = ["".join(c.texts) for c in choices]
            reasons = [c.finish_reason for c in choices]
            use = _usage(parsed, choices)
            make = protocol.chat_body if parsed.kind == "chat" else protocol.completion_body
            return make(rid, name, created, texts, reasons, use)

        return DeferredJSON(compute, on_close=abort_unfinished)

    def submit(parsed: protocol.ParsedRequest, arrival: float) -> list[_Choice]:
        """One engine request per choice; all or none (a refused one aborts the others)."""
        engine = state.engine
        choices: list[_Choice] = []
        try:
            for i, ids in enumerate(parsed.prompts):
                for j, params in enumerate(parsed.params):
                    handle = engine.submit(ids, params)
                    choices.append(_Choice(i * parsed.n + j, i, handle, arrival))
        except BaseException as exc:
            for c in choices:
                c.handle.abort()
            raise _submit_error(exc, parsed.kind) from None
        return choices

    def _submit_error(exc: BaseException, kind: str) -> BaseException:
        from polyspec.engine.loop import QueueFull

        if isinstance(exc, RequestError):
            field = _wire_field(exc.field, kind)
            return api_errors.bad_request(f"{field}: {exc.message}", field)
        if isinstance(exc, QueueFull):
            return api_errors.queue_full(state.settings.max_queued_requests or 0)
        if isinstance(exc, RuntimeError) and state.stopping:
            return api_errors.stopping()
        return exc

    def _failure(c: _Choice) -> ApiError:
        if c.finish_reason == "abort":
            return (
                api_errors.stopping()
                if state.stopping
                else ApiError(500, "the request was aborted", type="server_error", code="aborted")
            )
        return api_errors.engine_failed(c.error or "unknown cause")

    async def events(choices: list[_Choice]) -> AsyncIterator[tuple[_Choice, Any]]:
        """Every choice's events as they come (merged), with the server's measurements."""

        def record(c: _Choice, ev) -> None:
            now = time.perf_counter()
            k = len(ev.token_ids)
            if k:
                if c.last is None:
                    metrics.ttft.observe(now - c.arrival)
                    k_gaps, start = k - 1, now
                else:
                    k_gaps, start = k, c.last
                for _ in range(k_gaps):
                    metrics.itl.observe((now - start) / k)
                c.last = now
                c.num_tokens += k
            if ev.text:
                c.texts.append(ev.text)
            if ev.finished:
                c.finish_reason, c.error = ev.finish_reason, ev.error
                metrics.e2e.observe(now - c.arrival)
                metrics.requests.labels(ev.finish_reason or "unknown").inc()

        if len(choices) == 1:
            c = choices[0]
            async for ev in c.handle:
                record(c, ev)
                yield c, ev
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def drain(c: _Choice) -> None:
            async for ev in c.handle:
                await queue.put((c, ev))

        tasks = [asyncio.ensure_future(drain(c)) for c in choices]
        try:
            left = len(choices)
            while left:
                c, ev = await queue.get()
                record(c, ev)
                left -= ev.finished
                yield c, ev
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def stream_chunks(
        parsed: protocol.ParsedRequest, choices: list[_Choice], rid: str, created: int
    ) -> AsyncIterator[dict]:
        chat = parsed.kind == "chat"
        name = parsed.model
        if chat:
            for c in choices:
                yield protocol.chat_chunk(rid, name, created, c.index,
                                          {"role": "assistant", "content": ""}, None)  # fmt: skip
        async for c, ev in events(choices):
            if ev.finished and ev.finish_reason in ("error", "abort"):
                yield _failure(c).body()
                return
            if ev.text:
                if chat:
                    yield protocol.chat_chunk(rid, name, created, c.index,
                                              {"content": ev.text}, None)  # fmt: skip
                else:
                    yield protocol.completion_chunk(rid, name, created, c.index, ev.text, None)
            if ev.finished:
                if chat:
                    yield protocol.chat_chunk(rid, name, created, c.index, {}, ev.finish_reason)
                else:
                    yield protocol.completion_chunk(rid, name, created, c.index, "",
                                                    ev.finish_reason)  # fmt: skip
        if parsed.include_usage:
            yield protocol.usage_chunk(rid, name, created, parsed.kind, _usage(parsed, choices))

    return app


def _usage(parsed: protocol.ParsedRequest, choices: list[_Choice]) -> dict[str, int]:
    prompt_tokens = sum(len(p) for p in parsed.prompts)  # each prompt once, whatever n
    return protocol.usage(prompt_tokens, sum(c.num_tokens for c in choices))
