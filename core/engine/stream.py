"""A request's text as it grows: only the part that can no longer change is handed out.

Two things can still change the end of a running request's text: a multi-byte UTF-8 character
whose bytes span tokens decodes to U+FFFD until its last byte arrives, and the start of a stop
string may complete in a later round (the stop string and all after it are then cut). So the
stable text is the decoded text without trailing U+FFFD and without its longest suffix that is
a proper start of one of the request's stop strings; a finished request's text is final.
"""

from __future__ import annotations

from polyspec.engine.request import Request
from polyspec.engine.stop import StopChecker

_REPLACEMENT = "\ufffd"


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

    def advance(self, req: Request) -> str:
        """The text that became stable since the last call ("" without a tokenizer)."""
        if self.stop.tokenizer is None:
            return ""
        text = self.stop.text(req)
        if not req.finished:
            text = text[: len(text) - held_back(text, req.params.stop)]
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            # nothing new, or the decoder rewrote earlier text: wait for the final text
            if not req.finished or text.startswith(self.sent):
                return ""
        new = text[len(self.sent) :]
        self.sent = text
        return new
