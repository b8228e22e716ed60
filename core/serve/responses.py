"""ASGI responses that notice a client leaving while its request is still generating.

Both run the body's producer as a task and, beside it, wait for the ASGI ``http.disconnect``
message; whichever ends first wins, and ``on_close`` runs in every case (it aborts the
requests still running in the engine, so that their KV slots are freed at the next round).

- :class:`EventStream`: server-sent events, one ``data: <json>`` block per chunk, then
  ``data: [DONE]``;
- :class:`DeferredJSON`: one JSON body (or an error) computed while the client waits.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.responses import Response

from polyspec.serve.api_errors import ApiError

Send = Callable[[dict], Awaitable[None]]
Receive = Callable[[], Awaitable[dict]]


def sse(data: Any) -> bytes:
    """One server-sent event carrying ``data`` as JSON (or the literal ``[DONE]``)."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


async def _until_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _race(work: Awaitable[None], receive: Receive) -> bool:
    """Run ``work`` until it ends or the client disconnects; True when it ran to its end."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task in done and not task.cancelled():
        exc = task.exception()
        if exc is not None and not isinstance(exc, OSError):  # OSError: the socket went away
            raise exc
        return exc is None
    return False


def _internal(exc: Exception) -> ApiError:
    cause = f"{type(exc).__name__}: {exc}".splitlines()[0]
    logging.getLogger("polyspec.serve").error("internal error", exc_info=exc)
    return ApiError(500, f"internal error: {cause}", type="server_error")


class EventStream(Response):
    """``text/event-stream`` of the JSON chunks ``chunks`` yields, then ``data: [DONE]``."""

    def __init__(self, chunks: AsyncIterator[Any], on_close: Callable[[], None]):
        super().__init__(media_type="text/event-stream")
        self.chunks = chunks
        self.on_close = on_close

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                    (b"x-accel-buffering", b"no"),
                ],
            }
        )

        async def pump() -> None:
            try:
                async for chunk in self.chunks:
                    body = sse(chunk)
                    await send({"type": "http.response.body", "body": body, "more_body": True})
            except (OSError, asyncio.CancelledError):
                raise
            except Exception as exc:  # a bug: say so in the stream, never a traceback
                err = _internal(exc)
                await send({"type": "http.response.body", "body": sse(err.body()),
                            "more_body": True})  # fmt: skip
            await send({"type": "http.response.body", "body": sse("[DONE]"), "more_body": False})

        try:
            await _race(pump(), receive)
        finally:
            self.on_close()
            await self.chunks.aclose()


class DeferredJSON(Response):
    """A JSON response whose body ``compute`` produces while the client waits: a dict (status
    200) or an :class:`ApiError` raised inside it (its status and OpenAI error body)."""

    def __init__(self, compute: Callable[[], Awaitable[dict]], on_close: Callable[[], None]):
        super().__init__(media_type="application/json")
        self.compute = compute
        self.on_close = on_close

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        async def respond() -> None:
            status, headers = 200, {}
            try:
                body = await self.compute()
            except ApiError as err:
                status, headers, body = err.status, err.headers, err.body()
            except Exception as exc:  # a bug: an OpenAI-style 500, never a traceback
                err = _internal(exc)
                status, headers, body = err.status, err.headers, err.body()
            payload = json.dumps(body, separators=(",", ":")).encode()
            raw = [(b"content-type", b"application/json")]
            raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
            raw.append((b"content-length", str(len(payload)).encode()))
            await send({"type": "http.response.start", "status": status, "headers": raw})
            await send({"type": "http.response.body", "body": payload, "more_body": False})

        try:
            await _race(respond(), receive)
        finally:
            self.on_close()
