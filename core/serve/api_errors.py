"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status.

Every status the server answers on purpose has a constructor here, so the error table in
docs/serving.md is this file.
"""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An error answered to the client: the HTTP status and the OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body: OpenAI's error object."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    """400: the JSON is well formed but a value is not allowed (or not supported)."""
    return ApiError(400, message, param=param, code=code)


def wrong_type(message: str, param: str | None = None) -> ApiError:
    """422: a field has the wrong JSON type, or a required field is missing."""
    return ApiError(422, message, param=param, code="invalid_type")


def unauthorized() -> ApiError:
    """401: --api-key is set and the request's bearer token differs."""
    return ApiError(
        401,
        "invalid API key: send the key given to `polyspec serve --api-key` as "
        "'Authorization: Bearer KEY'",
        type="authentication_error",
        code="invalid_api_key",
    )


def model_not_found(model: str, served: str) -> ApiError:
    """404: the request names another model than the one served."""
    return ApiError(
        404,
        f"model = {model!r} is not served here; this server serves {served!r} (GET /v1/models)",
        param="model",
        code="model_not_found",
    )


def too_large(size: int, limit: int) -> ApiError:
    """413: the request body is over the server's limit."""
    return ApiError(
        413,
        f"request body of {size} bytes is over the limit of {limit} bytes; send a shorter prompt",
        code="request_too_large",
    )


def queue_full(limit: int, retry_after_s: int = 1) -> ApiError:
    """429: --max-queued-requests requests are already waiting."""
    return ApiError(
        429,
        f"the server is busy: {limit} requests are already waiting (--max-queued-requests); "
        f"retry after {retry_after_s} s",
        type="rate_limit_error",
        code="queue_full",
        headers={"Retry-After": str(retry_after_s)},
    )


def starting(retry_after_s: int = 2) -> ApiError:
    """503: the model is still loading (or the server is shutting down)."""
    return ApiError(
        503,
        "the server is starting: the model is still loading; retry shortly (GET /health "
        "answers 200 once it is ready)",
        type="server_error",
        code="starting",
        headers={"Retry-After": str(retry_after_s)},
    )


def stopping() -> ApiError:
    """503: SIGTERM was received; no new requests are admitted."""
    return ApiError(
        503,
        "the server is shutting down and admits no new requests",
        type="server_error",
        code="shutting_down",
    )


def engine_failed(cause: str) -> ApiError:
    """500: the engine failed in this request's round (other requests keep running)."""
    return ApiError(
        500, f"the engine failed on this request: {cause}", type="server_error", code="engine_error"
    )
