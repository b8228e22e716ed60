"""Exceptions polyspec raises for problems a user can fix.

The CLI prints any :class:`PolyspecError` as ``polyspec: error: <message>`` (exit status 2) with
no traceback, so every message must say what was wrong and how to fix it.
"""

from __future__ import annotations


class PolyspecError(Exception):
    """Base class of every error polyspec reports to the user."""


class ConfigError(PolyspecError, ValueError):
    """An invalid configuration value or an unknown configuration key."""


class PluginError(PolyspecError, RuntimeError):
    """A backend plugin failed to import, register, probe, or build its backend."""


class BackendSelectionError(PolyspecError, RuntimeError):
    """No backend could be selected: unknown name, unavailable, or ambiguous auto-detection."""


class ModelLoadError(PolyspecError, RuntimeError):
    """A checkpoint (target or draft) could not be found or does not match the expected layout."""


class RequestError(PolyspecError, ValueError):
    """One generation request is invalid (checked before it is admitted, so nothing else is
    affected). ``field`` names what was wrong (``"prompt_token_ids"``, ``"sampling.seed"``,
    ...), ``value`` is the offending value and ``message`` the whole one-line explanation.
    ``index``: the request's position in a batch call (``LLM.generate``), else None."""

    def __init__(self, field: str, value: object, message: str, index: int | None = None):
        self.field = field
        self.value = value
        self.index = index
        self.message = message if index is None else f"request {index}: {message}"
        super().__init__(self.message)


class RankFailure(PolyspecError, RuntimeError):
    """A rank of a tensor-parallel engine failed, died or decided differently from rank 0;
    the message names the rank. Fatal for the engine: every rank stops (docs/distributed.md)."""
