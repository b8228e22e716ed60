"""A torch_npu simulator for tests: the operators and graph API the npu backend calls, on the CPU.

Never installed under the real name: :func:`simulated` puts a module object into
``sys.modules["torch_npu"]`` and a :class:`~.device.SimulatedNPU` at ``torch.npu`` for the
duration of a ``with`` block (the conformance suite's ``--polyspec-npu-sim`` option holds it
for the whole pytest run), and removes both afterwards. With it the real ``polyspec.backends.npu``
runs on the CPU: its operator calls are checked against the documented contracts
(:mod:`.ops`) and its NPU graphs are recorded and replayed with task-group updates
(:mod:`.device`). What it cannot show: kernel speed, the numerics of the fused operators on
the NPU (the simulator computes in float32 and rounds once), triton-ascend compilation, NZ
formats and CANN's tiling limits (docs/backends/npu.md).
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch

from . import ops
from .device import SimulatedNPU
from .ops import NPUContractError

SIMULATED_VERSION = "2.10.0.post4"
"""The torch_npu release whose documentation the simulator follows."""

_FIA_SAME = ("query", "key", "value", "workspace", "out")


class _FusedAttentionOp:
    """``torch_npu.npu_fused_infer_attention_score`` and its ``.out`` overload."""

    def __init__(self, sim: SimulatedNPU) -> None:
        self._sim = sim

    def __call__(self, query, key, value, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty_like(query)
        lse = torch.zeros(1, dtype=torch.float32, device=query.device)
        workspace = None
        if self._sim.capturing is not None:
            # [IFA-HANDLER] under capture torch_npu sizes a workspace and swaps to ``.out``
            workspace = ops.get_max_workspace(query, key, value, **kwargs)
        self.out(query, key, value, workspace=workspace, out=[out, lse], **kwargs)
        return out, lse

    def out(self, query, key, value, *, workspace=None, out=None, **kwargs: Any) -> list:
        """[IFA-HANDLER] the ``.out`` overload: results into ``out = [attn_out, lse]``."""
        if not isinstance(out, list | tuple) or len(out) != 2:
            raise NPUContractError(
                "simulated torch_npu.npu_fused_infer_attention_score.out needs out=[out, lse]"
            )
        if self._sim.capturing is not None and workspace is None:
            raise NPUContractError(
                "npu_fused_infer_attention_score.out under graph capture needs the workspace "
                "of _npu_fused_infer_attention_score_get_max_workspace (no allocation in a graph)"
            )
        if tuple(out[0].shape) != tuple(query.shape) or out[0].dtype != query.dtype:
            raise NPUContractError("npu_fused_infer_attention_score.out: out[0] must match query")
        params = dict(query=query, key=key, value=value, workspace=workspace, out=out, **kwargs)
        self._sim.issue("npu_fused_infer_attention_score", _run_fia, params, _FIA_SAME)
        return list(out)


def _run_fia(query, key, value, workspace, out, **kwargs: Any) -> None:
    unsupported = {k: kwargs.pop(k) for k in list(kwargs) if k not in _FIA_KWARGS}
    ops.fia_compute(query, key, value, out[0], unsupported=unsupported, **kwargs)


_FIA_KWARGS = (
    "atten_mask", "actual_seq_lengths", "actual_seq_lengths_kv", "block_table", "num_heads",
    "scale", "input_layout", "num_key_value_heads", "sparse_mode", "block_size",
    "softmax_lse_flag",
)  # fmt: skip


def build_module(sim: SimulatedNPU) -> types.ModuleType:
    """A fresh simulated ``torch_npu`` module bound to ``sim``."""
    module = types.ModuleType("torch_npu")
    module.__doc__ = "polyspec's torch_npu simulator (polyspec.backends.npu.sim); not torch_npu"
    module.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    module.__version__ = SIMULATED_VERSION
    module.SIMULATED_DEVICE_TYPE = "cpu"
    module.npu = sim
    module.npu_fused_infer_attention_score = _FusedAttentionOp(sim)
    module._npu_fused_infer_attention_score_get_max_workspace = ops.get_max_workspace

    def npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, **kwargs):
        """[DOC-SPA] one device task: its checks read the slots at every run, replays too."""
        params = dict(key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                      slot_mapping=slot_mapping, **kwargs)  # fmt: skip
        sim.issue("npu_scatter_pa_kv_cache", ops.npu_scatter_pa_kv_cache, params, ())

    module.npu_scatter_pa_kv_cache = npu_scatter_pa_kv_cache
    return module


@contextlib.contextmanager
def simulated() -> Iterator[SimulatedNPU]:
    """Install the simulator as ``torch_npu`` / ``torch.npu`` for the block; restore after."""
    if "torch_npu" in sys.modules and not _is_simulator(sys.modules["torch_npu"]):
        raise RuntimeError("a real torch_npu is imported; the simulator cannot replace it")
    sim = SimulatedNPU()
    saved_module = sys.modules.get("torch_npu")
    had_npu = hasattr(torch, "npu")
    saved_npu = getattr(torch, "npu", None)
    sys.modules["torch_npu"] = build_module(sim)
    setattr(torch, "npu", sim)  # noqa: B010  (by name: core code names no vendor API)
    _clear_runtime_cache()
    try:
        yield sim
    finally:
        if saved_module is None:
            sys.modules.pop("torch_npu", None)
        else:
            sys.modules["torch_npu"] = saved_module
        if had_npu:
            setattr(torch, "npu", saved_npu)  # noqa: B010
        else:
            delattr(torch, "npu")
        _clear_runtime_cache()


def _is_simulator(module: Any) -> bool:
    return getattr(module, "SIMULATED_DEVICE_TYPE", None) is not None


def _clear_runtime_cache() -> None:
    """The backend caches its torch_npu import once per process."""
    runtime = sys.modules.get("polyspec.backends.npu.runtime")
    if runtime is not None:
        runtime.import_torch_npu.cache_clear()


__all__ = ["NPUContractError", "SimulatedNPU", "build_module", "simulated", "SIMULATED_VERSION"]
