"""Ascend NPU backend (torch_npu, triton-ascend).

Nothing in this package imports ``torch_npu`` at import time: :mod:`.plugin` probes without it,
and the other modules import it inside functions, through :func:`.runtime.import_torch_npu`,
when the backend is activated (``create_backend("npu")``).
"""
