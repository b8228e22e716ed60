"""Hooks of the ``ascend-like`` backend: a static spec and an always-true probe.

The backend runs on the CPU, so nothing here can be missing; it is never auto-detected
(negative priority) and is selected by name only:
``pytest --pyargs polyspec.testing --polyspec-backend ascend-like``.
"""

from __future__ import annotations

from polyspec.hookspecs import BackendSpec, ProbeResult, hookimpl
from polyspec.testing.ascend_like import ASCEND_LIKE_CAPABILITIES


@hookimpl
def polyspec_backend_spec() -> BackendSpec:
    """The Ascend-shaped CPU backend: selected by name only."""
    return BackendSpec(
        name="ascend-like",
        factory="polyspec.testing.ascend_like:AscendLikeBackend",
        priority=-1,
        capabilities=ASCEND_LIKE_CAPABILITIES,
        device_type="cpu",
        description="cpu reference under Ascend's constraints (int32 indices, host seq lens, "
        "page size 128, prepare-before-replay graphs, fp32 sampling)",
    )


@hookimpl
def polyspec_backend_probe() -> ProbeResult:
    """Always available: it needs only torch on the CPU."""
    return ProbeResult(available=True)
