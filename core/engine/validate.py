"""Every check a request passes before it is admitted, so that a bad one fails alone.

A request that reached the scheduler can only fail through a bug or a device error; whatever a
caller can get wrong (a token id outside the vocabulary, a prompt too long for the context,
stop strings without a tokenizer, the wrong type) is refused here with a
:class:`~polyspec.errors.RequestError` naming the field, the value and what is allowed.
"""

from __future__ import annotations

import operator
from typing import Any

from polyspec.config import SamplingParams
from polyspec.constrain import constraint_of
from polyspec.errors import RequestError


def _token(t: Any) -> int | None:
    """``t`` as an int when it is an integer (Python, numpy or a 0-d torch tensor), else None."""
    if isinstance(t, bool):
        return None
    try:
        return operator.index(t)
    except TypeError:
        return None


def check_prompt_ids(prompt_token_ids: Any, vocab_size: int) -> list[int]:
    """The prompt as a list of ints in ``[0, vocab_size)``, else :class:`RequestError`."""
    field = "prompt_token_ids"
    ids = None
    if not isinstance(prompt_token_ids, (str, bytes, dict)):
        try:
            ids = list(prompt_token_ids)
        except TypeError:
            pass
    if ids is None:
        raise RequestError(
            field,
            prompt_token_ids,
            f"prompt_token_ids must be a list of token ids, got {type(prompt_token_ids).__name__}",
        )
    if not ids:
        raise RequestError(field, ids, "the prompt is empty: give at least one token id")
    out = []
    for i, t in enumerate(ids):
        v = _token(t)
        if v is None:
            raise RequestError(field, t, f"prompt_token_ids[{i}] = {t!r} is not an integer")
        if not 0 <= v < vocab_size:
            raise RequestError(
                field,
                v,
                f"prompt_token_ids[{i}] = {v} is outside the vocabulary: token ids must be from "
                f"0 to {vocab_size - 1}",
            )
        out.append(v)
    return out


def check_request(
    prompt_token_ids: Any,
    params: Any,
    *,
    vocab_size: int,
    has_tokenizer: bool,
    scheduler,
) -> list[int]:
    """Check one request against this engine; -> its prompt as a list of ints.

    ``scheduler``: the engine's :class:`~polyspec.engine.scheduler.Scheduler` (its
    ``check`` compares the request's size with ``max_context`` and the KV pool, and its
    ``grammars`` compile a structured-output constraint, cached for admission)."""
    if not isinstance(params, SamplingParams):
        raise RequestError(
            "sampling_params",
            params,
            f"sampling params must be a polyspec.SamplingParams, got {type(params).__name__}",
        )
    ids = check_prompt_ids(prompt_token_ids, vocab_size)
    if params.stop and not has_tokenizer:
        raise RequestError(
            "sampling.stop",
            params.stop,
            "stop strings need a tokenizer; this engine has none (use stop_token_ids, or build "
            "it with tokenizer=)",
        )
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise RequestError(
            "sampling.stop_token_ids",
            bad[0],
            f"stop token id {bad[0]} is outside the vocabulary: token ids must be from 0 to "
            f"{vocab_size - 1}",
        )
    scheduler.check(len(ids), params.max_new_tokens)
    constraint = constraint_of(params)
    if constraint is not None:
        if scheduler.config.tensor_parallel_size > 1:
            field, value = constraint
            raise RequestError(
                f"sampling.{field}",
                value,
                f"{field} (structured output) does not run under tensor parallelism "
                f"(tensor_parallel_size = {scheduler.config.tensor_parallel_size}): its masks "
                "are built from rank 0's tokenizer; serve constrained requests from an engine "
                "with tensor_parallel_size = 1",
            )
        grammars = getattr(scheduler, "grammars", None)
        if grammars is None:
            field, value = constraint
            raise RequestError(
                f"sampling.{field}",
                value,
                f"{field} needs a tokenizer (the grammar is over its tokens); this engine has "
                "none (build it with tokenizer=)",
            )
        grammars.compile(constraint)  # RequestError: the field and the grammar's message
    return ids
