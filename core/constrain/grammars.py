"""Constraints compiled once per (tokenizer, constraint): a request's grammar is checked when
it is submitted and each admitted request gets its own matcher, copied from the cached one."""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from polyspec.config import CONSTRAINT_FIELDS
from polyspec.constrain.engine import llguidance
from polyspec.constrain.matcher import Matcher
from polyspec.errors import RequestError

Constraint = tuple[str, Any]
"""(field, value): ``("json_schema", text)``, ``("regex", text)``, ``("grammar", lark)`` or
``("choice", (str, ...))``; hashable, the cache's key."""


def constraint_of(params: Any) -> Constraint | None:
    """The structured-output constraint of a :class:`~polyspec.config.SamplingParams`, or
    None for an unconstrained request."""
    for field in CONSTRAINT_FIELDS:
        value = getattr(params, field, None)
        if value is not None:
            return field, value
    return None


def grammar_text(ll: Any, constraint: Constraint) -> str:
    """llguidance's grammar for ``constraint``. JSON is compact (no free whitespace between
    tokens): a small model given free whitespace can spend its whole budget on it."""
    field, value = constraint
    if field == "json_schema":
        schema = json.loads(value)  # a ValueError names the line and column of the schema's text
        if not isinstance(schema, (dict, bool)):
            raise ValueError(
                f"a JSON Schema is an object or a boolean, got {type(schema).__name__}"
            )
        return ll.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}
        )
    if field == "regex":
        return ll.LLMatcher.grammar_from_regex(value)
    if field == "grammar":
        return ll.LLMatcher.grammar_from_lark(value)
    if field == "choice":  # JSON string literals are Lark string literals
        return ll.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
        )
    raise ValueError(f"unknown constraint field {field!r}")


class GrammarCache:
    """Compiled constraints of one tokenizer (an engine's), least recently used dropped past
    ``capacity``. Thread-safe: requests are checked on the submitting threads and admitted on
    the engine loop's."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int] = (),
        capacity: int = 256,
    ):
        """``tokenizer``: a :class:`polyspec.model.tokenizer.Tokenizer`; ``vocab_size``: the
        target's logits width (masks are that wide; ids past the tokenizer's are never
        allowed); ``eos_token_ids``: the engine's end-of-sequence ids (the grammar allows
        them where the output may end; the tokenizer's when empty)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids) or tuple(tokenizer.eos_token_ids)
        self.capacity = capacity
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        self._compiled: OrderedDict[Constraint, Any] = OrderedDict()
        self._executor: Any = None

    def _llt(self, ll: Any) -> Any:
        if self._ll_tokenizer is None:  # ~0.4 s for a 49k vocabulary: once per engine
            eos = list(self.eos_token_ids) or None
            self._ll_tokenizer = ll.LLTokenizer(
                self.tokenizer.to_json(), n_vocab=self.vocab_size, eos_token=eos
            )
        return self._ll_tokenizer

    def compile(self, constraint: Constraint) -> Any:
        """The compiled matcher of ``constraint`` (a template: :meth:`matcher` copies it).
        :raises RequestError: the constraint is invalid (the field and llguidance's message),
        or llguidance is not installed."""
        field, value = constraint
        key = f"sampling.{field}"
        with self._lock:
            hit = self._compiled.get(constraint)
            if hit is not None:
                self._compiled.move_to_end(constraint)
                return hit
            ll = llguidance(key, value)
            try:
                grammar = grammar_text(ll, constraint)
            except ValueError as exc:
                raise RequestError(key, value, f"invalid {field}: {exc}") from None
            llt = self._llt(ll)
            is_error, messages = ll.LLMatcher.validate_grammar_with_warnings(grammar, llt)
            if is_error:
                raise RequestError(key, value, f"invalid {field}: {_one_line(messages[0])}")
            template = ll.LLMatcher(llt, grammar, log_level=0)
            if template.is_error():
                message = _one_line(template.get_error())
                raise RequestError(key, value, f"invalid {field}: {message}")
            self._compiled[constraint] = template
            if len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
            return template

    def matcher(self, constraint: Constraint) -> Matcher:
        """A fresh matcher of ``constraint`` for one request."""
        template = self.compile(constraint)
        with self._lock:
            if self._executor is None and _mask_threads() > 1:
                ll = llguidance(f"sampling.{constraint[0]}", None)
                self._executor = ll.LLExecutor(num_threads=_mask_threads())
        return Matcher(template.deep_copy(), self.vocab_size, self._executor)


def _mask_threads() -> int:
    """Threads that compute a round's masks in parallel: llguidance's default (80 % of the
    CPUs, at most 32). With one, masks are computed in turn on the calling thread (a
    dispatch to a pool of one thread cost ~140 us per 15 masks on a 2-core host)."""
    return min(32, int(0.8 * (os.cpu_count() or 1)))


def _one_line(message: str) -> str:
    """llguidance's message on one line: its first line and any ``error:`` line, without the
    grammar excerpt and caret lines between them."""
    lines = [line.strip() for line in message.strip().splitlines()]
    if not lines:
        return "rejected by llguidance"
    return " ".join([lines[0], *(line for line in lines[1:] if line.startswith("error:"))])
