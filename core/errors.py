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
