"""K/V storage shared by the backends: one ``[num_layers, num_slots, Hkv, D]`` tensor each for K and V.

Stacking the layers lets :meth:`TensorKVPool.move` copy every layer in one gather and one
scatter (it runs each round to compact accepted tokens), while ``k_cache(layer)`` is still a
contiguous ``[num_slots, Hkv, D]`` view.
"""

from __future__ import annotations

import torch

from polyspec.backend import KVPool


class TensorKVPool(KVPool):
    """Zero-initialised K/V tensors on one device; writes and moves by plain tensor indexing."""

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        """Allocate ``2 * num_layers * num_slots * num_kv_heads * head_dim`` elements."""
        for name, value in (
            ("num_slots", num_slots),
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if value < 1:
                raise ValueError(f"KV pool: {name} must be >= 1, got {value}")
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self._k = torch.zeros(shape, dtype=dtype, device=self.device)  # [L, slots, Hkv, D]
        self._v = torch.zeros(shape, dtype=dtype, device=self.device)  # [L, slots, Hkv, D]
        # Per-layer views made once: every layer of every forward asks for its two caches.
        self._k_layers = self._k.unbind(0)
        self._v_layers = self._v.unbind(0)

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"KV pool: layer {layer} out of range [0, {self.num_layers})")

    def k_cache(self, layer: int) -> torch.Tensor:  # [num_slots, Hkv, D]
        """The K tensor of ``layer`` (a view: writes to it land in the pool)."""
        self._check_layer(layer)
        return self._k_layers[layer]

    def v_cache(self, layer: int) -> torch.Tensor:  # [num_slots, Hkv, D]
        """The V tensor of ``layer`` (a view: writes to it land in the pool)."""
        self._check_layer(layer)
        return self._v_layers[layer]

    def write(
        self,
        layer: int,
        loc: torch.Tensor,  # [T] slots
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
    ) -> None:
        """Store ``k``/``v`` at slots ``loc`` of ``layer`` (cast to the pool dtype)."""
        self._check_layer(layer)
        expected = (loc.shape[0], self.num_kv_heads, self.head_dim)
        if tuple(k.shape) != expected or tuple(v.shape) != expected:
            raise ValueError(
                f"KV pool write: k/v must have shape [T, Hkv, D] = {list(expected)}, got "
                f"k {list(k.shape)}, v {list(v.shape)}"
            )
        write_kv(self._k[layer], self._v[layer], loc, k, v)

    def move(
        self,
        dst_loc: torch.Tensor,  # [n]
        src_loc: torch.Tensor,  # [n]
    ) -> None:
        """Copy every layer's K/V from ``src_loc`` to ``dst_loc``; overlap-safe because the
        gather builds new tensors before the scatter writes."""
        if dst_loc.shape != src_loc.shape or dst_loc.dim() != 1:
            raise ValueError(
                f"KV pool move: dst_loc and src_loc must be 1-D of equal length, got "
                f"{list(dst_loc.shape)} and {list(src_loc.shape)}"
            )
        if dst_loc.numel() == 0:
            return
        dst = dst_loc.to(device=self.device, dtype=torch.int64)
        src = src_loc.to(device=self.device, dtype=torch.int64)
        k_src = self._k.index_select(1, src)  # [L, n, Hkv, D]
        v_src = self._v.index_select(1, src)  # [L, n, Hkv, D]
        self._k.index_copy_(1, dst, k_src)
        self._v.index_copy_(1, dst, v_src)


def write_kv(
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,  # [slots, Hkv, D]
    loc: torch.Tensor,  # [T]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
) -> None:
    """``k_cache[loc] = k``, ``v_cache[loc] = v``; ``loc`` may be int32 or int64."""
    if loc.dtype != torch.int64:
        loc = loc.long()
    k_cache.index_copy_(0, loc, k.to(k_cache.dtype))
    v_cache.index_copy_(0, loc, v.to(v_cache.dtype))
