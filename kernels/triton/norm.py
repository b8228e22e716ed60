"""Triton RMSNorm kernels: ``rms_norm`` and ``fused_add_rms_norm`` (one program per row).

Drop-ins for the reference functions (Hugging Face LlamaRMSNorm order: normalise in fp32, cast
to the input dtype, then multiply by the weight, the product rounded once to the promoted dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from polyspec.kernels.triton._util import check, next_pow2, rows_2d
from polyspec.kernels.triton.pdl import launch_options, wait_for_previous


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [rows, H]
    residual_ptr,  # [rows, H] (unused unless HAS_RESIDUAL)
    weight_ptr,  # [H]
    out_ptr,  # [rows, H] contiguous
    sum_ptr,  # [rows, H] contiguous x + residual (unused unless HAS_RESIDUAL)
    hidden,
    eps,
    stride_x,
    stride_res,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(residual_ptr + row * stride_res + offs, mask=m, other=0.0)
        # The sum is rounded to its own dtype first, exactly as ``x + residual`` in torch.
        x = (x.to(tl.float32) + res.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * hidden + offs, x, mask=m)
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=0) / hidden
    normed = (xf / tl.sqrt(mean_sq + eps)).to(x.dtype)
    w = tl.load(weight_ptr + offs, mask=m, other=0.0)
    out = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * hidden + offs, out.to(out_ptr.dtype.element_ty), mask=m)


def _launch(
    x: torch.Tensor,  # [..., H]
    residual: torch.Tensor | None,  # [..., H]
    weight: torch.Tensor,  # [H]
    eps: float,
    pdl: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    check(
        weight.dim() == 1 and weight.shape[0] == hidden,
        f"weight must be [H={hidden}], got {tuple(weight.shape)}",
    )
    check(hidden <= 65536, f"rms_norm supports hidden sizes up to 65536, got {hidden}")
    rows = rows_2d(x, "x")
    weight = weight.contiguous()
    sum_dtype = x.dtype
    res_rows = rows
    if residual is not None:
        check(
            residual.shape == x.shape,
            f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}",
        )
        res_rows = rows_2d(residual, "residual")
        sum_dtype = torch.promote_types(x.dtype, residual.dtype)
    out_dtype = torch.promote_types(weight.dtype, sum_dtype)
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    total = (
        torch.empty(rows.shape, dtype=sum_dtype, device=x.device) if residual is not None else out
    )
    if rows.shape[0] > 0:
        block = next_pow2(hidden)
        _rms_norm_kernel[(rows.shape[0],)](
            rows,
            res_rows,
            weight,
            out,
            total,
            hidden,
            float(eps),
            rows.stride(0),
            res_rows.stride(0),
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            PDL=pdl,
            num_warps=min(max(block // 256, 1), 16),
            **launch_options(pdl),
        )
    out = out.view(x.shape)
    return out, (total.view(x.shape) if residual is not None else None)


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    pdl: bool = False,
) -> torch.Tensor:  # [T, H]
    """Triton ``rms_norm``; see :func:`polyspec.kernels.reference.rms_norm`. ``pdl``:
    launch with programmatic dependent launch (:mod:`.pdl`)."""
    return _launch(x, None, weight, eps, pdl)[0]


def fused_add_rms_norm(
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, H], [T, H])
    """Triton ``fused_add_rms_norm``: ``(rms_norm(x + residual), x + residual)`` in one pass;
    inputs untouched. See :func:`polyspec.kernels.reference.fused_add_rms_norm`; ``pdl`` as
    :func:`rms_norm`'s."""
    normed, total = _launch(x, residual, weight, eps, pdl)
    assert total is not None
    return normed, total
