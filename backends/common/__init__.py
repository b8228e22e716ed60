"""Mechanism every backend may share (DESIGN.md section 6): no backend imports another.

- :mod:`.allocator`: :class:`PagedAllocator`, token slots or whole pages from a free stack;
- :mod:`.kv_pool`: :class:`TensorKVPool`, one ``[num_layers, num_slots, Hkv, D]`` tensor each
  for K and V, on any torch device;
- :mod:`.attention`: :class:`SDPAAttention`, every forward mode over that pool with
  ``scaled_dot_product_attention`` (plain torch, any device, eager and captured metadata);
- :mod:`.graph`: the rules every graph runner enforces, and :class:`EagerGraphRunner`.

cpu uses all four; cuda the allocator, the pool and the SDPA layout under its Triton
attentions; npu the allocator, the pool and SDPA for float32 models; the Ascend-shaped test
backend (``polyspec.testing.ascend_like``) all four behind its checks.
"""

from .allocator import PagedAllocator
from .attention import SDPAAttention, SDPAMetadata
from .graph import EagerGraphRunner
from .kv_pool import TensorKVPool, write_kv

__all__ = [
    "EagerGraphRunner",
    "PagedAllocator",
    "SDPAAttention",
    "SDPAMetadata",
    "TensorKVPool",
    "write_kv",
]
