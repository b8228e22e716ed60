"""The Ascend NPU backend object (factory ``polyspec.backends.npu.backend:NPUBackend``).

Creating it activates the Ascend runtime (imports ``torch_npu``); importing this module does not.
Device ops go through ``torch.npu``; slots are int32 (Ascend's cache and paged-attention
operators take int32 indices); KV pages are 128 slots; attention, graphs and kernels live in
:mod:`.attention`, :mod:`.graph` and :mod:`.kernels`.
"""

from __future__ import annotations

import os

import torch

from polyspec.backend import Backend
from polyspec.backends.common import PagedAllocator

from .attention import FIA_DTYPES, NPUAttention
from .graph import NPUGraphRunner
from .kernels import build_kernels
from .kv_pool import NPUKVPool
from .plugin import CAPABILITIES, PAGE_SIZE
from .runtime import device_type, import_torch_npu


class NPUBackend(Backend):
    """Huawei Ascend NPUs through torch_npu (CANN) and triton-ascend."""

    name = "npu"
    device_type = "npu"

    def __init__(self, use_triton: bool | None = None) -> None:
        """Activate the runtime (``PluginError`` with the CANN hint when it is unusable) and
        build the kernel set (``use_triton=False``: reference kernels only; None: Triton
        unless the environment sets ``POLYSPEC_NPU_TRITON=0``)."""
        if use_triton is None:
            use_triton = os.environ.get("POLYSPEC_NPU_TRITON", "1") != "0"
        import_torch_npu()
        self.capabilities = CAPABILITIES
        built = build_kernels(use_triton)
        self.kernels = built.kernels
        self.kernel_sources = built.sources
        self.device_type = device_type()

    def device(self, rank: int | None = None) -> torch.device:
        """``npu:rank`` of local rank ``rank`` (None: this process's; ``cpu`` under the
        torch_npu simulator of the test suite)."""
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, self.local_rank if rank is None else rank)

    def device_count(self) -> int | None:
        """The NPUs this process sees (None under the simulator: ranks share the CPU)."""
        if self.device_type == "cpu":
            return None
        return int(torch.npu.device_count())

    def bind_local_rank(self, rank: int) -> None:
        """Local rank ``rank`` runs on ``npu:rank``, made current for HCCL."""
        self.local_rank = rank
        if self.device_type != "cpu":
            torch.npu.set_device(self.device())

    def synchronize(self) -> None:
        """Wait for the current NPU's queued work."""
        torch.npu.synchronize()

    def memory_info(self) -> tuple[int, int]:
        """(free bytes, total bytes) of the current NPU."""
        free, total = torch.npu.mem_get_info()
        return int(free), int(total)

    def make_allocator(self, num_slots: int, page_size: int) -> PagedAllocator:
        """Whole 128-slot pages handed out as int32 slots on the NPU."""
        if not self.capabilities.supports_page_size(page_size):
            raise ValueError(
                f"npu backend: page_size {page_size} is not supported; use page_size={PAGE_SIZE} "
                f"(the block size of Ascend's paged attention)"
            )
        return PagedAllocator(num_slots, page_size, self.device(), self.index_dtype)

    def make_kv_pool(
        self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> NPUKVPool:
        """Zero-initialised K/V tensors on the NPU (the fused attention needs ``num_slots`` a
        multiple of 128)."""
        if str(dtype).removeprefix("torch.") not in self.capabilities.dtypes:
            raise ValueError(
                f"npu backend: unsupported KV dtype {dtype}; use one of "
                f"{list(self.capabilities.dtypes)}"
            )
        return NPUKVPool(num_slots, num_layers, num_kv_heads, head_dim, dtype, self.device())

    def make_attention(
        self, kv_pool: NPUKVPool, num_heads: int, num_kv_heads: int, head_dim: int, scale: float
    ) -> NPUAttention:
        """Paged fused attention (float16 / bfloat16) or the portable SDPA path (float32)."""
        if not isinstance(kv_pool, NPUKVPool):
            raise TypeError(
                f"npu backend: make_attention needs a pool from make_kv_pool, got "
                f"{type(kv_pool).__name__}"
            )
        if kv_pool.dtype in FIA_DTYPES and (head_dim % 16 or kv_pool.num_slots % PAGE_SIZE):
            raise ValueError(
                f"npu backend: the fused attention needs head_dim a multiple of 16 (got "
                f"{head_dim}) and a pool of whole {PAGE_SIZE}-slot blocks (got "
                f"{kv_pool.num_slots} slots)"
            )
        return NPUAttention(kv_pool, num_heads, num_kv_heads, head_dim, scale, PAGE_SIZE)

    def make_graph_runner(self) -> NPUGraphRunner:
        """An NPU graph runner (its ``prepare`` updates the captured attention tasks)."""
        return NPUGraphRunner(self.capabilities.max_graph_shapes or 16)
