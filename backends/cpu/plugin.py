"""Plugin for the cpu reference backend (entry point ``cpu`` in ``polyspec.backends``)."""

from __future__ import annotations

from polyspec.backend import BackendCapabilities
from polyspec.hookspecs import BackendSpec, ProbeResult, hookimpl

CAPABILITIES = BackendCapabilities(static_metadata=True, weight_quantization=("int8",))
"""The reference implements the whole contract (int8 draft weights included); its graph runner
is eager (no capture)."""


@hookimpl
def polyspec_backend_spec() -> BackendSpec:
    """The cpu reference backend: always available, lowest auto-detect priority."""
    return BackendSpec(
        name="cpu",
        factory="polyspec.backends.cpu.backend:CPUBackend",
        priority=0,
        capabilities=CAPABILITIES,
        device_type="cpu",
        description="plain-PyTorch reference backend (the oracle)",
    )


@hookimpl
def polyspec_backend_probe() -> ProbeResult:
    """A CPU is always present; torch is a dependency of polyspec itself."""
    return ProbeResult(available=True)
