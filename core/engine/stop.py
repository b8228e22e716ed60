"""Stop conditions: EOS, stop token ids, stop strings and max_new_tokens.

Tokens are appended one at a time, so a stop met in the middle of an accepted run of draft
tokens ends the request there: nothing after the stop is emitted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from polyspec.engine.request import Request


class StopChecker:
    def __init__(self, tokenizer, eos_token_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.eos = frozenset(eos_token_ids)

    def append(self, req: Request, tokens: Iterable[int]) -> None:
        """Append ``tokens`` to ``req`` until one of them finishes it."""
        p = req.params
        for t in tokens:
            req.output_ids.append(t)
            if (t in self.eos and not p.ignore_eos) or t in p.stop_token_ids:
                req.finish_reason = "stop"
            elif p.stop and self._match_stop_string(req):
                req.finish_reason = "stop"
            elif len(req.output_ids) >= p.max_new_tokens:
                req.finish_reason = "length"
            if req.finished:
                return

    def _match_stop_string(self, req: Request) -> bool:
        # Only the tail can contain a new match: decode a window covering the longest stop
        # string (a token decodes to at least one character or to nothing).
        longest = max(len(s) for s in req.params.stop)
        window = req.output_ids[-(longest + 8) :]
        tail = self.tokenizer.decode(window)
        if not any(s in tail for s in req.params.stop):
            return False
        text = self.tokenizer.decode(req.output_ids)
        hits = [text.find(s) for s in req.params.stop if s in text]
        req.stop_text_end = min(hits)
        return True

    def text(self, req: Request) -> str:
        text = self.tokenizer.decode(req.output_ids)
        return text if req.stop_text_end is None else text[: req.stop_text_end]
