"""The example backend: the cpu reference with ``silu_and_mul`` replaced by its own kernel."""

from __future__ import annotations

import dataclasses

import torch

from polyspec.backends.cpu.backend import CPUBackend


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # x [T, 2I] -> [T, I]
    """Same contract as ``polyspec.kernels.reference.silu_and_mul``, written as x*sigmoid(x)."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dim, got {x.shape[-1]}")
    gate, up = x.float().chunk(2, dim=-1)
    return (gate * torch.sigmoid(gate) * up).to(x.dtype)


class ExampleBackend(CPUBackend):
    """A backend overrides the kernels it accelerates and inherits the rest."""

    name = "example"

    def __init__(self) -> None:
        super().__init__()
        self.kernels = dataclasses.replace(self.kernels, silu_and_mul=silu_and_mul)
