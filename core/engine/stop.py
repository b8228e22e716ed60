"""Stop conditions: EOS, stop token ids, stop strings and max_new_tokens.

Tokens are appended one at a time, so a stop met in the middle of an accepted run of draft
tokens ends the request there: nothing after the stop is emitted. The text ends just before
the stop (a stop string, or the text of a stop token), as OpenAI's API and vLLM return it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from polyspec.engine.request import Request


class StopChecker:
    def __init__(self, tokenizer, eos_token_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.eos = frozenset(eos_token_ids)

    def append(self, req: Request, tokens: Iterable[int]) -> None:
        """Append ``tokens`` to ``req`` until one of them finishes it. A stop token (EOS or
        one of ``stop_token_ids``) stays in ``output_ids`` but not in the text; a stop string
        ends the text just before it (the tokens that completed it stay in ``output_ids``)."""
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
        # Only the tail can hold a new match (one ending in the newest token's text): decode a
        # window of the newest tokens, widened until its text covers the longest stop string
        # before the newest token's own text, plus one character that may be a multi-byte
        # character cut by the window's start. Tokens may decode to nothing (special tokens)
        # or to a fraction of a character (byte tokens), so a fixed number of tokens is not
        # enough: a stop string of 10 CJK characters can span 30 byte tokens.
        stops = req.params.stop
        ids = req.output_ids
        need = max(len(s) for s in stops) + len(self.tokenizer.decode(ids[-1:])) + 1
        width = need + 8
        while True:
            tail = self.tokenizer.decode(ids[-width:])
            if width >= len(ids) or len(tail) > need:
                break
            width *= 2
        if not any(s in tail for s in stops):
            return False
        text = self.tokenizer.decode(ids)
        hits = [text.find(s) for s in stops if s in text]
        if not hits:  # only the window's cut first character made it (a stop holding U+FFFD)
            return False
        req.stop_text_end = min(hits)
        return True

    def text(self, req: Request) -> str:
        """The output text, ended before the stop string or stop token that finished it."""
        ids = req.output_ids
        if req.finish_reason == "stop" and req.stop_text_end is None:
            # a stop token: the text of the tokens before it (decoded alone, so a multi-byte
            # character the stop token would have completed stays incomplete)
            return self.tokenizer.decode(ids[:-1])
        text = self.tokenizer.decode(ids)
        return text if req.stop_text_end is None else text[: req.stop_text_end]
