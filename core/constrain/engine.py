"""The grammar engine, llguidance, imported on first use (``pip install 'polyspec[grammar]'``)."""

from __future__ import annotations

from types import ModuleType

from polyspec.errors import RequestError

EXTRA = "grammar"
"""The pyproject extra that installs the grammar engine."""


def llguidance(field: str, value: object) -> ModuleType:
    """The ``llguidance`` module; a :class:`RequestError` on ``field`` naming the extra to
    install when it is missing."""
    try:
        import llguidance as ll
    except ImportError:
        raise RequestError(
            field,
            value,
            f"{field} needs the grammar engine llguidance, which is not installed: "
            f"pip install 'polyspec[{EXTRA}]'",
        ) from None
    return ll
