"""Structured output: grammars compiled per (tokenizer, constraint), one matcher per request,
and the token bitmasks a round applies (docs/structured-output.md).

The round (``polyspec.spec``) and the scheduler (``polyspec.engine``) call into this package;
it never calls them. The grammar engine, llguidance, is imported on first use, so polyspec
runs without it until a request asks for a constraint.
"""

from polyspec.constrain.grammars import GrammarCache, constraint_of
from polyspec.constrain.masks import DraftVocab, RoundMasks, draft_bitmask
from polyspec.constrain.matcher import ConstraintViolation, Matcher, next_masks

__all__ = [
    "ConstraintViolation",
    "DraftVocab",
    "GrammarCache",
    "Matcher",
    "RoundMasks",
    "constraint_of",
    "draft_bitmask",
    "next_masks",
]
