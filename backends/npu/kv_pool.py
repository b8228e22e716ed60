"""K/V storage of the npu backend: the shared pool's layout on the NPU, with a paged view.

One ``[num_layers, num_slots, Hkv, D]`` tensor each for K and V. Slot ``s`` of a layer is row
``s`` of ``k_cache(layer)`` and, with ``page_size`` P, row ``s % P`` of block ``s // P`` of
``paged_k(layer, P)`` (``[num_slots // P, P, Hkv, D]``, the layout Ascend's paged attention and
``_npu_reshape_and_cache`` take): both are views of the same memory.
"""

from __future__ import annotations

import torch

from polyspec.backends.common import TensorKVPool

from .runtime import import_torch_npu


class NPUKVPool(TensorKVPool):
    """Zero-initialised K/V tensors on an NPU; writes scatter rows at int32 slots."""

    def paged_k(self, layer: int, page_size: int) -> torch.Tensor:  # [blocks, P, Hkv, D]
        """Layer ``layer``'s K cache as blocks of ``page_size`` slots (a view)."""
        return self.k_cache(layer).view(-1, page_size, self.num_kv_heads, self.head_dim)

    def paged_v(self, layer: int, page_size: int) -> torch.Tensor:  # [blocks, P, Hkv, D]
        """Layer ``layer``'s V cache as blocks of ``page_size`` slots (a view)."""
        return self.v_cache(layer).view(-1, page_size, self.num_kv_heads, self.head_dim)

    def write(
        self,
        layer: int,
        loc: torch.Tensor,  # [T] int32 slots
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
    ) -> None:
        """Store ``k``/``v`` at slots ``loc`` of ``layer`` with ``npu_scatter_nd_update_``."""
        self._check_layer(layer)
        expected = (loc.shape[0], self.num_kv_heads, self.head_dim)
        if tuple(k.shape) != expected or tuple(v.shape) != expected:
            raise ValueError(
                f"KV pool write: k/v must have shape [T, Hkv, D] = {list(expected)}, got "
                f"k {list(k.shape)}, v {list(v.shape)}"
            )
        if loc.numel() == 0:
            return
        store_rows(self.k_cache(layer), self.v_cache(layer), loc, k, v)


def store_rows(
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,  # [slots, Hkv, D]
    loc: torch.Tensor,  # [T] int32 or int64
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
) -> None:
    """``k_cache[loc] = k``, ``v_cache[loc] = v`` with the in-place scatter of torch_npu (the
    store of :meth:`NPUKVPool.write`)."""
    torch_npu = import_torch_npu()
    index = loc.to(torch.int32).view(-1, 1)  # [T, 1]: one index per row
    torch_npu.npu_scatter_nd_update_(k_cache, index, k.to(k_cache.dtype).contiguous())
    torch_npu.npu_scatter_nd_update_(v_cache, index, v.to(v_cache.dtype).contiguous())
