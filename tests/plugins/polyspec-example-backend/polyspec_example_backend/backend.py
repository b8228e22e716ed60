"""The example backend: the whole contract from polyspec's shared pieces, one kernel its own.

A backend is a :class:`polyspec.backend.Backend` with capabilities, a KernelSet and four
factories. This one takes the allocator, KV pool, SDPA attention and eager graph runner from
``polyspec.backends.common`` and the kernels from ``polyspec.kernels.reference``, replacing
``silu_and_mul`` to show the override pattern. An accelerator backend replaces what it
accelerates the same way (its own attention, graph runner, kernels) and keeps the rest.
"""

from __future__ import annotations

import dataclasses

import torch

from polyspec.backend import Backend
from polyspec.backends.common import EagerGraphRunner, PagedAllocator, SDPAAttention, TensorKVPool
from polyspec.kernels.reference import reference_kernels

from .plugin import CAPABILITIES


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # x [T, 2I] -> [T, I]
    """Same contract as ``polyspec.kernels.reference.silu_and_mul``, written as x*sigmoid(x)."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dim, got {x.shape[-1]}")
    gate, up = x.float().chunk(2, dim=-1)
    return (gate * torch.sigmoid(gate) * up).to(x.dtype)


class ExampleBackend(Backend):
    """Plain PyTorch on the CPU; every piece but one kernel is polyspec's own."""

    name = "example"
    device_type = "cpu"

    def __init__(self) -> None:
        """The capabilities its plugin declares; the reference kernels, one replaced."""
        self.capabilities = CAPABILITIES
        self.kernels = dataclasses.replace(reference_kernels(), silu_and_mul=silu_and_mul)

    def make_allocator(self, num_slots: int, page_size: int) -> PagedAllocator:
        """Token slots or whole pages, as ``index_dtype`` tensors on the device."""
        return PagedAllocator(num_slots, page_size, self.device(), self.index_dtype)

    def make_kv_pool(
        self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> TensorKVPool:
        """Zero-initialised ``[num_layers, num_slots, Hkv, D]`` K and V tensors."""
        return TensorKVPool(num_slots, num_layers, num_kv_heads, head_dim, dtype, self.device())

    def make_attention(
        self, kv_pool: TensorKVPool, num_heads: int, num_kv_heads: int, head_dim: int, scale: float
    ) -> SDPAAttention:
        """SDPA attention over ``kv_pool`` for every forward mode, eager and captured."""
        return SDPAAttention(kv_pool, num_heads, num_kv_heads, head_dim, scale)

    def make_graph_runner(self) -> EagerGraphRunner:
        """Replays by rerunning, under the same rules as a capturing runner."""
        return EagerGraphRunner()
