"""Plugin for the CUDA backend (entry point ``cuda`` in ``polyspec.backends``).

The probe tells the truth about this machine without importing ``torch.cuda``, Triton, or
initialising a device: an NVIDIA device node or ``nvidia-smi``, a CUDA build of torch and an
installed ``triton``. The factory imports the backend (torch.cuda, Triton) only when it is
selected and refuses with ``NotImplementedError`` when no CUDA device is usable after all.
"""

from __future__ import annotations

from polyspec.backend import Backend, BackendCapabilities
from polyspec.backends.probing import device_nodes, has_module, torch_build_info, which
from polyspec.hookspecs import BackendSpec, ProbeResult, hookimpl

CAPABILITIES = BackendCapabilities(
    graph_capture=True,
    static_metadata=True,
    tree_attention=True,
    page_sizes=None,
    index_dtype="int64",
    dtypes=("float32", "bfloat16", "float16"),
    async_execution=True,
    async_host_reads=True,
    distributed_backend="nccl",
    graph_collectives=True,
)
"""The capabilities of :class:`polyspec.backends.cuda.backend.CUDABackend`, declared statically
(a test checks that they match the backend's)."""


def _device_evidence(env: dict[str, str]) -> str | None:
    nodes = device_nodes("/dev/nvidia*")
    if nodes:
        return f"{len(nodes)} device node(s) {', '.join(nodes[:4])}"
    smi = which("nvidia-smi", env)
    if smi:
        return f"nvidia-smi at {smi}"
    return None


def probe(env: dict[str, str]) -> ProbeResult:
    """Why (not) CUDA here: device presence, a CUDA build of torch, Triton installed."""
    evidence = _device_evidence(env)
    version, build = torch_build_info()
    problems = []
    if evidence is None:
        problems.append("no CUDA device (no /dev/nvidia[0-9]* device node, no nvidia-smi on PATH)")
    if version is None:
        problems.append("torch is not installed")
    elif build.get("cuda") is None:
        problems.append(
            f"torch {version} is built without CUDA (torch.version.cuda is None); "
            f"install a CUDA build of torch"
        )
    if not has_module("triton"):
        problems.append("triton is not installed (pip install 'polyspec[cuda]')")
    if problems:
        return ProbeResult(available=False, reason="; ".join(problems))
    return ProbeResult(available=True)


@hookimpl
def polyspec_backend_spec() -> BackendSpec:
    """The CUDA backend: preferred to cpu when it is available."""
    return BackendSpec(
        name="cuda",
        factory="polyspec.backends.cuda.plugin:make_backend",
        priority=100,
        capabilities=CAPABILITIES,
        device_type="cuda",
        description="NVIDIA GPUs (CUDA graphs, Triton kernels)",
    )


@hookimpl
def polyspec_backend_probe(env: dict[str, str]) -> ProbeResult:
    """See :func:`probe`."""
    return probe(env)


def make_backend() -> Backend:
    """Create the :class:`~polyspec.backends.cuda.backend.CUDABackend` (imports torch.cuda and
    Triton now). Raises ``NotImplementedError`` when no CUDA device is usable."""
    import torch

    if not torch.cuda.is_available():
        raise NotImplementedError(
            "the cuda backend needs a usable CUDA device, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, CUDA {torch.version.cuda}); check the driver and "
            "CUDA_VISIBLE_DEVICES, or select the cpu backend"
        )
    from polyspec.backends.cuda.backend import CUDABackend

    return CUDABackend()
