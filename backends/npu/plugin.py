"""Plugin for the Ascend NPU backend (entry point ``npu`` in ``polyspec.backends``).

The probe tells the truth about this machine without importing ``torch_npu`` or initialising a
device; the backend itself is not implemented in this version, so even on a machine with an
Ascend NPU the probe reports it unavailable and the factory refuses.
"""

from __future__ import annotations

from polyspec.backend import BackendCapabilities, TreeMaskMode
from polyspec.backends.probing import NOT_IMPLEMENTED, device_nodes, has_module
from polyspec.hookspecs import BackendSpec, ProbeResult, hookimpl

CAPABILITIES = BackendCapabilities(
    graph_capture=True,
    graph_needs_prepare=True,
    tree_attention=True,
    index_dtype="int32",
    dtypes=("float32", "bfloat16", "float16"),
    host_seq_lens=True,
    tree_mask_mode=TreeMaskMode.TREE_ONLY,
)
"""Planned capabilities: Ascend graphs need host-side sequence lengths before each replay."""


def probe(env: dict[str, str]) -> ProbeResult:
    """Why (not) Ascend here: torch_npu installed, NPU device nodes, the CANN toolkit."""
    problems = []
    if not has_module("torch_npu"):
        problems.append("torch_npu is not installed (pip install 'polyspec[npu]')")
    nodes = device_nodes("/dev/davinci*")
    if not nodes:
        problems.append("no Ascend NPU (no /dev/davinci[0-9]* device node)")
    cann = env.get("ASCEND_HOME_PATH") or env.get("ASCEND_TOOLKIT_HOME")
    if not cann:
        problems.append("CANN toolkit not set up (ASCEND_HOME_PATH is unset; source set_env.sh)")
    if problems:
        return ProbeResult(available=False, reason="; ".join(problems))
    return ProbeResult(
        available=False,
        reason=(
            f"Ascend NPU found ({len(nodes)} device node(s), CANN at {cann}), but the npu backend "
            f"is {NOT_IMPLEMENTED} of polyspec; use --backend cpu"
        ),
    )


@hookimpl
def polyspec_backend_spec() -> BackendSpec:
    """The Ascend NPU backend: preferred to cpu when it is available."""
    return BackendSpec(
        name="npu",
        factory="polyspec.backends.npu.plugin:make_backend",
        priority=100,
        capabilities=CAPABILITIES,
        device_type="npu",
        description=f"Huawei Ascend NPUs (torch_npu, triton-ascend) -- {NOT_IMPLEMENTED}",
    )


@hookimpl
def polyspec_backend_probe(env: dict[str, str]) -> ProbeResult:
    """See :func:`probe`."""
    return probe(env)


def make_backend() -> None:
    """Factory placeholder: refuses, since the backend does not exist in this version."""
    raise NotImplementedError(
        f"the npu backend is {NOT_IMPLEMENTED} of polyspec; select the cpu backend instead"
    )
