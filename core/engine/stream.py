"""A request's text as it grows: only the part that can no longer change is handed out.

Two things can still change the end of a running request's text: a multi-byte UTF-8 character
whose bytes span tokens decodes to U+FFFD until its last byte arrives, and the start of a stop
string may complete in a later round (the stop string and all after it are then cut). So the
stable text is the decoded text without trailing U+FFFD and without its longest suffix that is
a proper start of one of the request's stop strings; a finished request's text is final.

Decoding is incremental, so a round costs the same at token 10 and at token 10,000: the text is
extended by decoding a short window of the newest tokens together with a few before them (the
context a tokenizer's decoder needs at a boundary: byte fallback, a word's leading space) and
keeping what the window adds to its own prefix, as vLLM's detokenizer does. A finished
request's text is decoded whole, once.
"""

from __future__ import annotations

from polyspec.engine.request import Request
from polyspec.engine.stop import StopChecker

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 4  # tokens before the new ones that the window decodes with them


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of ``text`` that may still change: trailing U+FFFD, then the
    longest suffix that is a proper prefix of a stop string."""
    end = len(text.rstrip(_REPLACEMENT))
    keep = 0
    for s in stops:
        for n in range(min(len(s) - 1, end), keep, -1):
            if text.endswith(s[:n], 0, end):
                keep = n
                break
    return len(text) - end + keep


class TextStream:
    """Hands out a request's new stable text, one piece per call (:meth:`advance`)."""

    def __init__(self, stop: StopChecker):
        self.stop = stop
        self.sent = ""  # what was handed out so far
        self._text = ""  # decoded text of output_ids[:_read], complete characters only
        self._prefix = 0  # where the next window starts (a few tokens before _read)
        self._read = 0

    def _decoded(self, req: Request) -> str:
        """The text of the request's tokens so far, complete characters only."""
        ids = req.output_ids
        if len(ids) > self._read:
            decode = self.stop.tokenizer.decode
            before = decode(ids[self._prefix : self._read])
            window = decode(ids[self._prefix :])
            if len(window) > len(before) and not window.endswith(_REPLACEMENT):
                if window.startswith(before):
                    self._text += window[len(before) :]
                else:  # the decoder rewrote the boundary: decode everything once
                    full = decode(ids)
                    if full.endswith(_REPLACEMENT):
                        return self._text  # wait for the character to complete
                    self._text = full
                self._read = len(ids)
                self._prefix = max(self._read - _CONTEXT_TOKENS, 0)
        return self._text

    def advance(self, req: Request) -> str:
        """The text that became stable since the last call ("" without a tokenizer)."""
        if self.stop.tokenizer is None:
            return ""
        if req.finished:
            text = self.stop.text(req)  # whole and final: stop strings cut
        else:
            text = self._decoded(req)
            text = text[: len(text) - held_back(text, req.params.stop)]
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            # nothing new, or the decoder rewrote earlier text: wait for the final text
            if not req.finished or text.startswith(self.sent):
                return ""
        new = text[len(self.sent) :]
        self.sent = text
        return new
