"""The OpenAI wire format: request bodies in, response and chunk bodies out.

A request body is validated field by field into a :class:`ParsedRequest` (prompts as token ids
and one :class:`~polyspec.config.SamplingParams` per choice). A value of the wrong JSON type, or
a missing required field, is a 422; a value out of range, an unknown field, or a field polyspec
does not support yet is a 400; each message names the field, the value and what is allowed.
Fields left out take the server's defaults (``polyspec serve``'s sampling flags, its config
file, then :class:`~polyspec.config.SamplingParams`'s defaults: greedy, 128 new tokens).

The field names are OpenAI's (``openai.types.CompletionCreateParams`` and
``openai.types.chat.CompletionCreateParams``, checked by tests/core/test_serve.py) plus the
vLLM-style extensions ``top_k``, ``stop_token_ids`` and ``ignore_eos``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from polyspec.config import MAX_SEED, SamplingParams
from polyspec.errors import ConfigError
from polyspec.serve.api_errors import bad_request, wrong_type

MAX_N = 16
"""The largest ``n`` (choices per prompt) a request may ask for; each choice is a request."""

COMMON_FIELDS = frozenset(
    {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
     "ignore_eos", "n", "stream", "stream_options", "logprobs", "user", "frequency_penalty",
     "presence_penalty", "logit_bias", "json_schema", "regex", "grammar", "choice",
     "guided_json", "guided_regex", "guided_grammar", "guided_choice"}
)  # fmt: skip
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of"}
CHAT_FIELDS = COMMON_FIELDS | {
    "messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
    "tool_choice", "functions", "function_call", "parallel_tool_calls", "store", "metadata",
    "service_tier", "modalities", "audio", "prediction", "web_search_options",
    "reasoning_effort", "verbosity", "prompt_cache_key", "safety_identifier",
}  # fmt: skip
CONSTRAINT_ALIASES = {
    "json_schema": "json_schema", "regex": "regex", "grammar": "grammar", "choice": "choice",
    "guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "grammar",
    "guided_choice": "choice",
}  # fmt: skip
"""Structured-output request fields (polyspec's names, and vLLM's ``guided_*``) -> the
:class:`~polyspec.config.SamplingParams` field each sets."""
EXTENSION_FIELDS = frozenset({"top_k", "stop_token_ids", "ignore_eos", *CONSTRAINT_ALIASES})
"""Accepted fields that are not OpenAI's (vLLM and SGLang take them too)."""

# Accepted and ignored: they change nothing about the text generated.
_IGNORED = frozenset(
    {"user", "parallel_tool_calls", "store", "metadata", "service_tier", "reasoning_effort",
     "verbosity", "prompt_cache_key", "safety_identifier"}
)  # fmt: skip
# Not supported yet: accepted only when absent, null or their no-op value.
_UNSUPPORTED_NOOP: dict[str, Callable[[Any], bool]] = {
    "tools": lambda v: v is None or v == [],
    "tool_choice": lambda v: v is None or v == "none",
    "functions": lambda v: v is None or v == [],
    "function_call": lambda v: v is None or v == "none",
    "audio": lambda v: v is None,
    "prediction": lambda v: v is None,
    "web_search_options": lambda v: v is None,
    "modalities": lambda v: v is None or v == ["text"],
    "frequency_penalty": lambda v: v is None or v == 0,
    "presence_penalty": lambda v: v is None or v == 0,
    "logit_bias": lambda v: v is None or v == {},
    "suffix": lambda v: v is None or v == "",
    "echo": lambda v: v is None or v is False,
    "best_of": lambda v: v is None or v == 1,
}
_CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """What request validation needs to know about the engine."""

    name: str  # the served model name
    vocab_size: int  # token ids must be in [0, vocab_size)
    default_sampling: SamplingParams
    encode: Callable[[str], list[int]]  # raw text -> token ids
    apply_chat_template: Callable[[list[dict]], list[int]]  # messages -> token ids


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
    """A validated request: ``prompts[i]`` is generated ``n`` times, choice ``i * n + j``
    with ``params[j]`` (the seed, when given, is ``seed + j``)."""

    kind: str  # "chat" | "completion"
    model: str
    prompts: list[list[int]]
    params: list[SamplingParams]  # one per choice of a prompt (length n)
    stream: bool
    include_usage: bool

    @property
    def n(self) -> int:
        """Choices per prompt."""
        return len(self.params)


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(body: Mapping, key: str, lo: int, hi: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not _is_int(value):
        raise wrong_type(f"{key} must be an integer, got {_type_name(value)} {_short(value)}", key)
    if value < lo or (hi is not None and value > hi):
        allowed = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise bad_request(f"{key} = {value} is invalid: must be an integer {allowed}", key)
    return value


def _number(body: Mapping, key: str, ok: Callable[[float], bool], allowed: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise wrong_type(f"{key} must be a number, got {_type_name(value)} {_short(value)}", key)
    value = float(value)
    if not math.isfinite(value) or not ok(value):
        raise bad_request(f"{key} = {value} is invalid: must be {allowed}", key)
    return value


def _bool(body: Mapping, key: str) -> bool | None:
    value = body.get(key)
    if value is None or isinstance(value, bool):
        return value
    raise wrong_type(f"{key} must be true or false, got {_type_name(value)} {_short(value)}", key)


def _stop(body: Mapping) -> tuple[str, ...] | None:
    value = body.get("stop")
    if value is None:
        return None
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise wrong_type(
            f"stop must be a string or an array of strings, got {_type_name(value)} "
            f"{_short(value)}",
            "stop",
        )
    if any(not s for s in items):
        raise bad_request("stop has an empty string: every stop string must be non-empty", "stop")
    return tuple(items)


def _token_ids(value: Any, key: str, vocab_size: int) -> list[int]:
    """A list of token ids in [0, vocab_size)."""
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        raise wrong_type(f"{key} must be an array of integers (token ids)", key)
    bad = [t for t in value if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(
            f"{key} has token id {bad[0]}, outside the vocabulary: ids must be in "
            f"0..{vocab_size - 1}",
            key,
        )
    return list(value)


def _check_fields(body: Mapping, allowed: frozenset[str], endpoint: str) -> None:
    unknown = sorted(k for k in body if k not in allowed)
    if unknown:
        raise bad_request(
            f"unknown field {unknown[0]!r} for {endpoint}: see docs/serving.md for the fields "
            "this server takes",
            unknown[0],
            code="unknown_field",
        )
    for key, noop in _UNSUPPORTED_NOOP.items():
        if key in body and not noop(body[key]):
            raise bad_request(
                f"{key} = {_short(body[key])} is not supported yet by polyspec serve; leave "
                f"{key} out",
                key,
                code="unsupported_field",
            )


def check_model(body: Mapping, served: str) -> str:
    """The ``model`` field: required, a string (the 404 for another name is the caller's)."""
    model = body.get("model")
    if model is None:
        raise wrong_type(f'model is required: send "model": {served!r}', "model")
    if not isinstance(model, str):
        raise wrong_type(
            f"model must be a string, got {_type_name(model)} {_short(model)}", "model"
        )
    return model


def _logprobs(body: Mapping, chat: bool) -> None:
    wants = body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None
    if chat and body.get("logprobs") not in (None, False, True):
        _bool(body, "logprobs")
    if wants:
        key = "logprobs" if body.get("logprobs") not in (None, False) else "top_logprobs"
        raise bad_request(
            f"{key} is not supported yet: the engine does not return the target's "
            "log-probabilities of speculatively accepted tokens; leave logprobs and "
            "top_logprobs out",
            key,
            code="unsupported_field",
        )


def _sampling(
    body: Mapping, model: ServedModel, max_tokens_keys: Sequence[str]
) -> list[SamplingParams]:
    """The n SamplingParams of one prompt's choices."""
    d = model.default_sampling
    given = {k: _int(body, k, 1) for k in max_tokens_keys}
    set_values = {k: v for k, v in given.items() if v is not None}
    if len(set(set_values.values())) > 1:
        a, b = set_values
        raise bad_request(
            f"{a} = {set_values[a]} and {b} = {set_values[b]} disagree: send one of them",
            b,
        )
    max_tokens = next(iter(set_values.values()), d.max_new_tokens)
    temperature = _number(
        body, "temperature", lambda v: v >= 0, "a finite number >= 0 (0 = greedy)"
    )
    top_p = _number(body, "top_p", lambda v: 0 < v <= 1, "a number in (0, 1] (1 = off)")
    top_k = body.get("top_k")
    if top_k == -1:  # vLLM's "off"
        top_k = 0
    else:
        top_k = _int(body, "top_k", 0)
    seed = _int(body, "seed", 0, MAX_SEED - (MAX_N - 1))
    stop = _stop(body)
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is not None:
        stop_token_ids = tuple(_token_ids(stop_token_ids, "stop_token_ids", model.vocab_size))
    ignore_eos = _bool(body, "ignore_eos")
    n = _int(body, "n", 1, MAX_N) or 1
    return _choices(
        n,
        **_constraint(body),
        max_new_tokens=max_tokens,
        temperature=d.temperature if temperature is None else temperature,
        top_k=d.top_k if top_k is None else top_k,
        top_p=d.top_p if top_p is None else top_p,
        stop=d.stop if stop is None else stop,
        stop_token_ids=d.stop_token_ids if stop_token_ids is None else stop_token_ids,
        ignore_eos=d.ignore_eos if ignore_eos is None else ignore_eos,
        seed=d.seed if seed is None else seed,
    )


def _constraint(body: Mapping) -> dict[str, Any]:
    """The structured-output field of a request: ``response_format`` (``text``,
    ``json_object``: any JSON object, ``json_schema``: its ``schema``) or one extension field
    (:data:`CONSTRAINT_ALIASES`); at most one of them."""
    given = {k: body[k] for k in CONSTRAINT_ALIASES if body.get(k) is not None}
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
            raise wrong_type(
                'response_format must be an object like {"type": "json_object"}', "response_format"
            )
        kind = fmt["type"]
        if kind == "json_object":
            given["response_format"] = {"type": "object"}
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, (dict, bool)):
                raise wrong_type(
                    'response_format "json_schema" needs {"json_schema": {"name": ..., '
                    '"schema": {...}}}',
                    "response_format",
                )
            given["response_format"] = schema
        elif kind != "text":
            raise bad_request(
                f"response_format type {kind!r} is not supported: use text, json_object or "
                "json_schema",
                "response_format",
            )
    if len(given) > 1:
        raise bad_request(
            f"only one structured-output field may be set, got {', '.join(sorted(given))}",
            sorted(given)[1],
        )
    if not given:
        return {}
    ((key, value),) = given.items()
    if key == "response_format":
        return {"json_schema": value}
    field = CONSTRAINT_ALIASES[key]
    if field == "choice" and not isinstance(value, list):
        raise wrong_type(f"{key} must be a list of strings", key)
    if field != "choice" and field != "json_schema" and not isinstance(value, str):
        raise wrong_type(f"{key} must be a string", key)
    if field == "json_schema" and not isinstance(value, (dict, str)):
        raise wrong_type(f"{key} must be a JSON Schema object", key)
    return {field: value}


def _choices(n: int, **fields: Any) -> list[SamplingParams]:
    """n SamplingParams, choice j seeded ``seed + j``; a value SamplingParams refuses is a
    400 naming the field."""
    try:
        base = SamplingParams(**fields)
    except ConfigError as exc:
        text = str(exc)
        param = next((f for f in fields if f"sampling.{f}" in text), None)
        wire = {"max_new_tokens": "max_tokens"}.get(param, param)
        raise bad_request(text.replace(f"sampling.{param}", str(wire)), wire) from None
    if base.seed is None:
        return [base] * n
    return [dataclasses.replace(base, seed=base.seed + j) for j in range(n)]


def _stream(body: Mapping) -> tuple[bool, bool]:
    stream = bool(_bool(body, "stream"))
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not isinstance(opts, dict):
        raise wrong_type(
            'stream_options must be an object like {"include_usage": true}', "stream_options"
        )
    if not stream:
        raise bad_request('stream_options is only allowed with "stream": true', "stream_options")
    unknown = sorted(set(opts) - {"include_usage"})
    if unknown:
        raise bad_request(
            f"stream_options has unknown key {unknown[0]!r}; allowed: include_usage",
            "stream_options",
        )
    return stream, bool(_bool(opts, "include_usage"))


def parse_completion(body: Mapping, model: ServedModel) -> ParsedRequest:
    """``POST /v1/completions``: ``prompt`` is a string, an array of strings, an array of token
    ids, or an array of arrays of token ids."""
    _check_fields(body, COMPLETION_FIELDS, "/v1/completions")
    name = check_model(body, model.name)
    _logprobs(body, chat=False)
    prompt = body.get("prompt")
    if prompt is None:
        raise wrong_type(
            "prompt is required: a string, an array of strings or of token ids", "prompt"
        )
    if isinstance(prompt, str):
        prompts = [model.encode(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = [model.encode(p) for p in prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        prompts = [_token_ids(prompt, "prompt", model.vocab_size)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = [_token_ids(p, "prompt", model.vocab_size) for p in prompt]
    elif isinstance(prompt, list) and not prompt:
        raise bad_request("prompt is an empty array: send at least one prompt", "prompt")
    else:
        raise wrong_type(
            f"prompt must be a string, an array of strings, an array of token ids or an array "
            f"of arrays of token ids, got {_type_name(prompt)} {_short(prompt)}",
            "prompt",
        )
    if any(not p for p in prompts):
        raise bad_request("prompt is empty: send at least one token of text", "prompt")
    params = _sampling(body, model, ("max_tokens",))
    stream, usage = _stream(body)
    return ParsedRequest("completion", name, prompts, params, stream, usage)


def _message(i: int, m: Any) -> dict:
    key = f"messages[{i}]"
    if not isinstance(m, dict):
        raise wrong_type(f"{key} must be an object with role and content", key)
    role = m.get("role")
    if role not in _CHAT_ROLES:
        raise bad_request(
            f"{key}.role = {_short(role)} is invalid: must be one of {', '.join(_CHAT_ROLES)}",
            f"{key}.role",
        )
    content = m.get("content")
    if isinstance(content, list):  # content parts: text only
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad_request(
                    f'{key}.content[{j}] is not a text part: only {{"type": "text", '
                    '"text": ...}} parts are supported',
                    f"{key}.content",
                )
            if not isinstance(part.get("text"), str):
                raise wrong_type(f"{key}.content[{j}].text must be a string", f"{key}.content")
            texts.append(part["text"])
        content = "".join(texts)
    elif content is None and role == "assistant":
        content = ""
    elif not isinstance(content, str):
        raise wrong_type(
            f"{key}.content must be a string or an array of text parts, got {_type_name(content)}",
            f"{key}.content",
        )
    return {"role": role, "content": content}


def parse_chat(body: Mapping, model: ServedModel) -> ParsedRequest:
    """``POST /v1/chat/completions``: ``messages`` rendered with the model's chat template."""
    _check_fields(body, CHAT_FIELDS, "/v1/chat/completions")
    name = check_model(body, model.name)
    _logprobs(body, chat=True)
    messages = body.get("messages")
    if messages is None:
        raise wrong_type("messages is required: an array of {role, content} objects", "messages")
    if not isinstance(messages, list):
        raise wrong_type(f"messages must be an array, got {_type_name(messages)}", "messages")
    if not messages:
        raise bad_request("messages is empty: send at least one message", "messages")
    conv = [_message(i, m) for i, m in enumerate(messages)]
    ids = model.apply_chat_template(conv)
    params = _sampling(body, model, ("max_tokens", "max_completion_tokens"))
    stream, usage = _stream(body)
    return ParsedRequest("chat", name, [list(ids)], params, stream, usage)


# -- response bodies -----------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's ``usage`` object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(
    rid: str, model: str, created: int, texts: list[str], reasons: list[str], use: dict
) -> dict[str, Any]:
    """``openai.types.Completion``."""
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {"index": i, "text": t, "finish_reason": r, "logprobs": None}
            for i, (t, r) in enumerate(zip(texts, reasons))
        ],
        "usage": use,
    }


def chat_body(
    rid: str, model: str, created: int, texts: list[str], reasons: list[str], use: dict
) -> dict[str, Any]:
    """``openai.types.chat.ChatCompletion``."""
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": t},
                "finish_reason": r,
                "logprobs": None,
            }
            for i, (t, r) in enumerate(zip(texts, reasons))
        ],
        "usage": use,
    }


def completion_chunk(
    rid: str, model: str, created: int, index: int, text: str, reason: str | None
) -> dict[str, Any]:
    """A streamed ``openai.types.Completion`` (one choice's new text)."""
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": index, "text": text, "finish_reason": reason, "logprobs": None}],
    }


def chat_chunk(
    rid: str, model: str, created: int, index: int, delta: dict, reason: str | None
) -> dict[str, Any]:
    """``openai.types.chat.ChatCompletionChunk`` (one choice's delta)."""
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": index, "delta": delta, "finish_reason": reason, "logprobs": None}],
    }


def usage_chunk(rid: str, model: str, created: int, kind: str, use: dict) -> dict[str, Any]:
    """The last chunk with ``stream_options.include_usage``: no choices, the usage."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": use}  # fmt: skip


def model_list(name: str, created: int) -> dict[str, Any]:
    """``GET /v1/models``: the one served model (``openai.types.Model``)."""
    return {
        "object": "list",
        "data": [{"id": name, "object": "model", "created": created, "owned_by": "polyspec"}],
    }


def now() -> int:
    """Unix seconds, for ``created``."""
    return int(time.time())
