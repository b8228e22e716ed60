"""Plugin for the cpu reference backend (entry point ``cpu`` in ``polyspec.backends``)."""

from __future__ import annotations

from polyspec.backend import BackendCapabilities
from polyspec.hookspecs import BackendSpec, KernelBuild, ProbeResult, hookimpl

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


@hookimpl
def polyspec_build_kernels() -> KernelBuild:
    """Compile the row-invariant bf16 kernels (``rowinv.cpp``) into torch's extension directory
    (``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``)."""
    from . import rowinv  # imports torch: only this command pays for it

    result = rowinv.build()
    if result.module is None:
        return KernelBuild(
            built=False,
            detail=f"{result.reason}; bf16 runs will use stock PyTorch (slower, not row-invariant)",
        )
    how = f"compiled in {result.seconds:.0f} s" if result.compiled else "already built"
    return KernelBuild(built=True, location=result.location, detail=how)
