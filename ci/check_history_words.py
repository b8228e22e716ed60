#!/usr/bin/env python3
"""Fail when the tree tells its own history instead of what is true now.

The repository is read by users and contributors: code comments say why the code is as it
is, docs describe the current code, and the story of how it got there belongs to git
(``git log``, ``git blame``). This check guards against the wording of a work log creeping
back into tracked files:

- numbered work sittings or trained heads (an ordinal before "session", "head" or "lease"),
  and references to sittings or device loans ("earlier", "this" or "next" before "session" or
  "lease");
- references to an internal issue tracker a user does not have ("issue 6's targets"; an
  upstream one, "pytorch/pytorch issue 1234" or "triton issue 56", is fine);
- instructions for a particular tool that reaches a GPU ("the device tool", "run by the lead").

Legitimate uses of the same words are not flagged: pytest's ``scope="session"``, an HTTP or
database session, a training session, ``requests.Session``, a DHCP or lock lease, and words
that merely contain them (``release``, ``session_id``). A line that must keep a flagged
phrase can be listed in ``EXEMPT`` below with the reason.

    python ci/check_history_words.py            # every file git tracks; exit 1 on a finding
    python ci/check_history_words.py FILE ...   # only these files

Prints ``path:line: phrase (rule)`` for each finding.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
    "thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|"
    r"twenty-\w+|thirtieth|\d+(?:st|nd|rd|th)"
)

RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        "numbered sitting, head or lease",
        re.compile(rf"\b(?:{ORDINALS})\s+(?:sessions?|heads?|leases?|sittings?)\b", re.I),
    ),
    (
        "a work sitting",
        re.compile(
            r"\b(?:earlier|previous|prior|last|next|later|this|that|each|every|one|another|a|"
            r"same|current|whole)\s+sessions?\b|\bsessions?'s?\s+(?:code|start|end|work|note)\b"
            r"|\bsessions?'\s|\bsessions\s+(?:ago|since|before)\b|\bsince\s+the\s+\w+\s+session\b",
            re.I,
        ),
    ),
    ("a device loan", re.compile(r"\b(?:leases?|leased)\b", re.I)),
    ("an internal issue number", re.compile(r"\bissues?\s+#?\d+\b", re.I)),
    (
        "a particular GPU tool",
        re.compile(r"\bdevice tool\b|\brun by the lead\b|\bthe lead\b\s+(?:on|through)", re.I),
    ),
)

ALLOWED_CONTEXT = re.compile(
    r"scope\s*=\s*[\"']session[\"']"
    r"|\b(?:http|https|client|browser|ssh|tls|ssl|database|db|sql|onnx|inference|training|"
    r"interactive|login|user|web|tmux|shell)\s+sessions?\b"
    r"|\.Sessions?\b"
    r"|\b(?:dhcp|lock|etcd|file|kv)\s+leases?\b"
    r"|\b(?:upstream|github|pytorch|torch|triton|cuda|transformers|sglang|vllm|[\w.-]+/[\w.-]+)"
    r"\s+issues?\s+#?\d+",
    re.I,
)
"""Spans of a line that are ordinary uses of a flagged word; findings inside them are dropped."""

EXEMPT: dict[str, str] = {
    "ci/check_history_words.py": "defines the phrases it looks for",
    "tests/core/test_check_history_words.py": "feeds the phrases to the check",
}
"""Paths (relative to the repository root) not scanned, each with its reason."""

TEXT_SUFFIXES = {
    ".py", ".md", ".sh", ".toml", ".json", ".jsonl", ".cpp", ".h", ".txt", ".cfg", ".ini",
    ".yml", ".yaml", "",
}  # fmt: skip


def findings(text: str) -> list[tuple[int, str, str]]:
    """(line number, phrase, rule) for each flagged phrase in ``text``; a phrase may run over a
    line break (prose is wrapped), and is reported at the line where it starts."""
    allowed = [m.span() for m in ALLOWED_CONTEXT.finditer(text)]
    out = []
    for rule, pattern in RULES:
        for m in pattern.finditer(text):
            if any(a <= m.start() and m.end() <= b for a, b in allowed):
                continue
            phrase = " ".join(m.group(0).split())
            out.append((text.count("\n", 0, m.start()) + 1, phrase, rule))
    return sorted(out)


def tracked_files(root: Path) -> list[Path]:
    names = subprocess.run(
        ["git", "ls-files", "-z"], cwd=root, check=True, capture_output=True, text=True
    ).stdout.split("\0")
    return [root / n for n in names if n]


def main(argv: list[str]) -> int:
    root = Path(__file__).resolve().parent.parent
    paths = [Path(a).resolve() for a in argv] or tracked_files(root)
    count = 0
    for path in paths:
        try:
            rel = path.relative_to(root).as_posix()
        except ValueError:
            rel = str(path)
        if rel in EXEMPT or path.suffix not in TEXT_SUFFIXES or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary (weights, images)
        for lineno, phrase, rule in findings(text):
            print(f"{rel}:{lineno}: {phrase!r} ({rule})")
            count += 1
    if count:
        print(
            f"{count} history phrase(s): say what is true now and why; the history is in git",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
