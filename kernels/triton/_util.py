"""Small host-side helpers shared by the Triton kernel wrappers (no Triton import here)."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch


def check(condition: bool, message: str) -> None:
    """Raise ValueError with ``message`` unless ``condition`` (shape checks only: no host sync)."""
    if not condition:
        raise ValueError(message)


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``, CI on the CPU).
    The interpreter multiplies with numpy, which has no bf16, so kernels with ``tl.dot`` widen
    16-bit inputs to fp32 there (their products are exact in fp32 either way)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_pow2(n: int) -> int:
    """The smallest power of two >= max(n, 1) (Triton block sizes must be powers of two)."""
    n = max(int(n), 1)
    return 1 << (n - 1).bit_length()


def writable(out: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
    """A contiguous tensor a kernel may write for ``out``, and a function that finishes the
    write (a no-op when ``out`` is already contiguous; a copy back otherwise), so the wrappers
    accept any ``out`` layout the reference accepts."""
    if out.is_contiguous():
        return out, lambda: None
    buf = torch.empty(out.shape, dtype=out.dtype, device=out.device)

    def finish() -> None:
        out.copy_(buf)

    return buf, finish


def rows_2d(x: torch.Tensor, what: str) -> torch.Tensor:  # [..., H] -> [rows, H]
    """``x`` as a 2-D ``[rows, H]`` tensor whose last dim is contiguous (a copy only if needed)."""
    check(x.dim() >= 1, f"{what} must have at least one dimension")
    flat = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    return flat
