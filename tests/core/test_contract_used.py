"""The contract is what the engine uses: every BackendCapabilities field is read, and every
KernelSet entry called, by the engine's own code (not only by the conformance suite)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from polyspec.backend import BackendCapabilities, KernelSet

CORE = Path(__file__).resolve().parents[2] / "core"
ENGINE = ("engine", "spec", "runtime", "model", "bench")
"""The folders of core/ that run a model (the listing command and the test suite do not count)."""


def _attributes_read() -> dict[str, set[str]]:
    """Attribute name -> files of the engine that read it (``x.name``)."""
    seen: dict[str, set[str]] = {}
    for folder in ENGINE:
        for path in sorted((CORE / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Attribute):
                    seen.setdefault(node.attr, set()).add(str(path.relative_to(CORE)))
    return seen


def test_every_capability_is_read_by_the_engine():
    seen = _attributes_read()
    unread = [f.name for f in dataclasses.fields(BackendCapabilities) if f.name not in seen]
    assert not unread, f"capabilities no engine code reads (remove them or use them): {unread}"


def test_every_kernel_is_called_by_the_engine():
    seen = _attributes_read()
    uncalled = [name for name in KernelSet.names() if name not in seen]
    assert not uncalled, f"KernelSet entries no engine code calls (remove or call): {uncalled}"
