"""Plugin for the Ascend NPU backend (entry point ``npu`` in ``polyspec.backends``).

The probe tells the truth about this machine without importing ``torch_npu`` or initialising a
device: it looks for the torch_npu distribution, Ascend device nodes, the CANN environment, and
a torch build torch_npu can run on. The backend itself (:mod:`.backend`) is imported only when
selected; an install that passes the probe but cannot load CANN fails there with the same hint.
"""

from __future__ import annotations

import importlib.metadata
import sys

from polyspec.backend import BackendCapabilities
from polyspec.backends.probing import device_nodes, has_module, torch_build_info
from polyspec.hookspecs import BackendSpec, ProbeResult, hookimpl

PAGE_SIZE = 128
"""KV page (block) size: what Ascend's paged attention and vllm-ascend use."""

CAPABILITIES = BackendCapabilities(
    graph_capture=True,
    graph_needs_prepare=True,
    static_metadata=True,
    max_graph_shapes=16,
    tree_attention=True,
    page_sizes=(PAGE_SIZE,),
    index_dtype="int32",
    dtypes=("float32", "bfloat16", "float16"),
    async_execution=True,
    distributed_backend="hccl",
)
"""Ascend: int32 indices, 128-slot pages. The attention reads the host-side sequence lengths
every eager ``ForwardBatch`` carries. float32 models run the portable attention path (the fused
operator takes float16 / bfloat16). NPU graphs (at most 16: each holds device memory) need a
prepare before each replay: it re-issues the captured attention tasks with the replay's host
sequence lengths (docs/backends/npu.md)."""

MIN_TORCH_NPU = (2, 10, 0)
"""The torch_npu release the backend is written and simulated against (vllm-ascend's pin:
torch 2.10.0, torch-npu 2.10.0.post4, triton-ascend 3.2.2)."""

CANN_SETUP = "source /usr/local/Ascend/ascend-toolkit/set_env.sh (CANN toolkit)"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def probe(env: dict[str, str]) -> ProbeResult:
    """Why (not) Ascend here: torch_npu installed and recent enough, NPU device nodes, the CANN
    toolkit, and a torch build that torch_npu accepts. polyspec's torch_npu simulator (the
    test suite's ``--polyspec-npu-sim``, a module already in ``sys.modules``) is reported as
    available, named as the simulator."""
    loaded = sys.modules.get("torch_npu")
    if getattr(loaded, "SIMULATED_DEVICE_TYPE", None) is not None:
        return ProbeResult(
            available=True,
            reason=f"polyspec's torch_npu simulator {loaded.__version__} (CPU, not an NPU)",
        )
    problems = []
    if not has_module("torch_npu"):
        problems.append(
            "torch_npu is not installed (pip install 'polyspec[npu]' in an environment of its "
            "own: torch_npu needs the CPU build of torch)"
        )
    nodes = device_nodes("/dev/davinci*")
    if not nodes:
        problems.append("no Ascend NPU (no /dev/davinci[0-9]* device node)")
    cann = env.get("ASCEND_HOME_PATH") or env.get("ASCEND_TOOLKIT_HOME")
    if not cann:
        problems.append(f"CANN toolkit not set up (ASCEND_HOME_PATH is unset; {CANN_SETUP})")
    version, build = torch_build_info()
    if build.get("cuda"):
        problems.append(
            f"torch {version} is a CUDA build; torch_npu refuses it: use a separate environment "
            f"with the CPU build of torch and torch_npu"
        )
    npu_version = _version("torch-npu") or _version("torch_npu")
    if (
        version
        and npu_version
        and npu_version.split("+")[0].split(".")[:2] != version.split("+")[0].split(".")[:2]
    ):
        problems.append(
            f"torch_npu {npu_version} does not match torch {version} (their major.minor must "
            f"agree); install the torch_npu built for this torch"
        )
    if npu_version and _release(npu_version) < MIN_TORCH_NPU:
        problems.append(
            f"torch_npu {npu_version} is older than {'.'.join(map(str, MIN_TORCH_NPU))}, the "
            f"release this backend is written against (pip install torch==2.10.0 "
            f"torch-npu==2.10.0.post4 triton-ascend==3.2.2)"
        )
    if problems:
        return ProbeResult(available=False, reason="; ".join(problems))
    return ProbeResult(available=True)


@hookimpl
def polyspec_backend_spec() -> BackendSpec:
    """The Ascend NPU backend: preferred to cpu when it is available."""
    return BackendSpec(
        name="npu",
        factory="polyspec.backends.npu.backend:NPUBackend",
        priority=100,
        capabilities=CAPABILITIES,
        device_type="npu",
        description="Huawei Ascend NPUs (torch_npu fused attention, NPU graphs, triton-ascend)",
    )


@hookimpl
def polyspec_backend_probe(env: dict[str, str]) -> ProbeResult:
    """See :func:`probe`."""
    return probe(env)
