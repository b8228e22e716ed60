"""The plugin module named by the entry point: a spec and a probe, nothing heavy.

Importing this module must stay cheap: the backend class lives in ``backend.py`` and is only
imported when the backend is created through the factory path below.
"""

from __future__ import annotations

from polyspec.backend import BackendCapabilities
from polyspec.hookspecs import BackendSpec, ProbeResult, hookimpl

CAPABILITIES = BackendCapabilities(static_metadata=True)
"""Eager graphs (captured forwards replay by rerunning), tree attention, any page size, the
three float dtypes, no quantized draft weights."""


@hookimpl
def polyspec_backend_spec() -> BackendSpec:
    """Negative priority: never auto-detected, only selected by name."""
    return BackendSpec(
        name="example",
        factory="polyspec_example_backend.backend:ExampleBackend",
        priority=-1,
        capabilities=CAPABILITIES,
        device_type="cpu",
        description="example out-of-tree plugin (shared pieces + one overridden kernel)",
    )


@hookimpl
def polyspec_backend_probe(env: dict[str, str]) -> ProbeResult:
    """Available unless POLYSPEC_EXAMPLE_UNAVAILABLE is set (lets tests see an unavailable one)."""
    if env.get("POLYSPEC_EXAMPLE_UNAVAILABLE"):
        return ProbeResult(available=False, reason="POLYSPEC_EXAMPLE_UNAVAILABLE is set")
    return ProbeResult(available=True)
