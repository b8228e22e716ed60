"""Activation of the Ascend runtime: the one place ``torch_npu`` gets imported.

Importing ``torch_npu`` registers the ``npu`` device with torch and loads CANN's shared libraries
(``libascendcl.so`` ...). When CANN is missing or its environment is not sourced, that import
fails with a loader error that does not say what to do; :func:`import_torch_npu` turns it into a
:class:`~polyspec.errors.PluginError` with the fix.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

from polyspec.errors import PluginError

CANN_HINT = (
    "install the CANN toolkit matching your torch_npu and source its environment first, e.g. "
    "'source /usr/local/Ascend/ascend-toolkit/set_env.sh' (it sets ASCEND_HOME_PATH and "
    "LD_LIBRARY_PATH)"
)
"""How to fix an unusable Ascend install; shown by the probe and by activation errors."""


@functools.lru_cache(maxsize=1)
def import_torch_npu() -> ModuleType:
    """Import ``torch_npu`` (registers ``torch.npu``) or raise ``PluginError`` with the fix;
    the checks run once per process."""
    try:
        import torch_npu  # noqa: F401  (vendor import: only here, only at activation)
    except ImportError as exc:
        where = os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME")
        cann = f"CANN at {where}" if where else "ASCEND_HOME_PATH is unset"
        raise PluginError(
            f"the npu backend cannot import torch_npu ({type(exc).__name__}: {exc}; {cann}); "
            f"{CANN_HINT}. torch_npu also needs the CPU build of the torch version it was built "
            f"for, in an environment without a CUDA torch"
        ) from exc
    import torch

    if not hasattr(torch, "npu") or not torch.npu.is_available():
        raise PluginError(
            "torch_npu imported but torch.npu.is_available() is False: no usable Ascend device "
            f"(check the driver with npu-smi info and ASCEND_RT_VISIBLE_DEVICES); {CANN_HINT}"
        )
    return torch_npu


def device_type() -> str:
    """``npu``; ``cpu`` under polyspec's torch_npu simulator, which keeps tensors on the CPU
    (``torch_npu.SIMULATED_DEVICE_TYPE``; the real torch_npu has no such attribute)."""
    return getattr(import_torch_npu(), "SIMULATED_DEVICE_TYPE", "npu")
