"""Plugin for the CUDA backend (entry point ``cuda`` in ``polyspec.backends``).

The probe tells the truth about this machine without importing ``torch.cuda`` or initialising a
device; the backend itself is not implemented in this version, so even on a machine with an
NVIDIA GPU the probe reports it unavailable and the factory refuses.
"""

from __future__ import annotations

from polyspec.backend import BackendCapabilities
from polyspec.backends.probing import NOT_IMPLEMENTED, device_nodes, torch_build_info, which
from polyspec.hookspecs import BackendSpec, ProbeResult, hookimpl

CAPABILITIES = BackendCapabilities(
    graph_capture=True,
    tree_attention=True,
    index_dtype="int64",
    dtypes=("float32", "bfloat16", "float16"),
)
"""Planned capabilities (CUDA graphs, tree attention); listed so users see what is coming."""


def _device_evidence(env: dict[str, str]) -> str | None:
    nodes = device_nodes("/dev/nvidia*")
    if nodes:
        return f"{len(nodes)} device node(s) {', '.join(nodes[:4])}"
    smi = which("nvidia-smi", env)
    if smi:
        return f"nvidia-smi at {smi}"
    return None


def probe(env: dict[str, str]) -> ProbeResult:
    """Why (not) CUDA here: device presence, then whether torch was built with CUDA."""
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
    if problems:
        return ProbeResult(available=False, reason="; ".join(problems))
    return ProbeResult(
        available=False,
        reason=(
            f"NVIDIA GPU found ({evidence}, torch {version} with CUDA {build['cuda']}), but the "
            f"cuda backend is {NOT_IMPLEMENTED} of polyspec; use --backend cpu"
        ),
    )


@hookimpl
def polyspec_backend_spec() -> BackendSpec:
    """The CUDA backend: preferred to cpu when it is available."""
    return BackendSpec(
        name="cuda",
        factory="polyspec.backends.cuda.plugin:make_backend",
        priority=100,
        capabilities=CAPABILITIES,
        device_type="cuda",
        description=f"NVIDIA GPUs (CUDA graphs, Triton kernels) -- {NOT_IMPLEMENTED}",
    )


@hookimpl
def polyspec_backend_probe(env: dict[str, str]) -> ProbeResult:
    """See :func:`probe`."""
    return probe(env)


def make_backend() -> None:
    """Factory placeholder: refuses, since the backend does not exist in this version."""
    raise NotImplementedError(
        f"the cuda backend is {NOT_IMPLEMENTED} of polyspec; select the cpu backend instead"
    )
