"""K/V storage of the npu backend: the shared pool's layout on the NPU, with a paged view.

One ``[num_layers, num_slots, Hkv, D]`` tensor each for K and V. Slot ``s`` of a layer is row
``s`` of ``k_cache(layer)`` and, with ``page_size`` P, row ``s % P`` of block ``s // P`` of
``paged_k(layer, P)`` (``[num_slots // P, P, Hkv, D]``, the layout Ascend's fused attention and
``npu_scatter_pa_kv_cache`` take): both are views of the same memory.
"""

from __future__ import annotations

import torch

from polyspec.backends.common import TensorKVPool

from .runtime import import_torch_npu

PAGED_BLOCK = 128
"""Block size of the paged view the cache write uses (the npu page size)."""


class NPUKVPool(TensorKVPool):
    """Zero-initialised K/V tensors on an NPU; writes go through the paged cache operator."""

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
        """Store ``k``/``v`` at slots ``loc`` of ``layer``: ``npu_scatter_pa_kv_cache`` on the
        paged view (a pool of whole 128-slot blocks, what the attention uses), a plain
        ``index_copy_`` otherwise."""
        self._check_layer(layer)
        expected = (loc.shape[0], self.num_kv_heads, self.head_dim)
        if tuple(k.shape) != expected or tuple(v.shape) != expected:
            raise ValueError(
                f"KV pool write: k/v must have shape [T, Hkv, D] = {list(expected)}, got "
                f"k {list(k.shape)}, v {list(v.shape)}"
            )
        if loc.numel() == 0:
            return
        if self.num_slots % PAGED_BLOCK:
            index = loc.to(torch.int64)
            self.k_cache(layer).index_copy_(0, index, k.to(self.dtype))
            self.v_cache(layer).index_copy_(0, index, v.to(self.dtype))
            return
        store_paged(self.paged_k(layer, PAGED_BLOCK), self.paged_v(layer, PAGED_BLOCK), loc, k, v)


def store_paged(
    key_cache: torch.Tensor,  # [blocks, P, Hkv, D]
    value_cache: torch.Tensor,  # [blocks, P, Hkv, D]
    loc: torch.Tensor,  # [T] int32 slots
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
) -> None:
    """``cache[s // P, s % P] = k[t]`` for slot ``s = loc[t]``, with ``npu_scatter_pa_kv_cache``
    (the Atlas A2 / A3 cache write; ``cache_mode="Norm"``: ND caches, not the NZ format its
    default expects)."""
    torch_npu = import_torch_npu()
    torch_npu.npu_scatter_pa_kv_cache(
        k.to(key_cache.dtype).contiguous(), v.to(value_cache.dtype).contiguous(),
        key_cache, value_cache, loc.to(torch.int32).contiguous(), cache_mode="Norm",
    )  # fmt: skip
