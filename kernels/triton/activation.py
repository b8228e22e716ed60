"""Triton ``silu_and_mul``: ``silu(x[:, :I]) * x[:, I:]`` in fp32, stored in ``x.dtype``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from polyspec.kernels.triton._util import check, next_pow2, rows_2d
from polyspec.kernels.triton.pdl import launch_options, wait_for_previous


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [rows, 2I]
    out_ptr,  # [rows, I] contiguous
    inter,  # I
    stride_x,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=m, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * inter + offs, out.to(out_ptr.dtype.element_ty), mask=m)


def silu_and_mul(x: torch.Tensor, pdl: bool = False) -> torch.Tensor:  # x [T, 2I] -> [T, I]
    """Triton ``silu_and_mul``; see :func:`polyspec.kernels.reference.silu_and_mul`. ``pdl``:
    launch with programmatic dependent launch (:mod:`.pdl`)."""
    check(x.shape[-1] % 2 == 0, f"silu_and_mul needs an even last dim, got {x.shape[-1]}")
    inter = x.shape[-1] // 2
    rows = rows_2d(x, "x")
    out = torch.empty(rows.shape[0], inter, dtype=x.dtype, device=x.device)
    if rows.shape[0] > 0 and inter > 0:
        block = min(next_pow2(inter), 1024)
        grid = (rows.shape[0], triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](
            rows, out, inter, rows.stride(0), BLOCK=block, PDL=pdl, **launch_options(pdl)
        )
    return out.view(*x.shape[:-1], inter)
