"""Triton RMSNorm kernels: ``rms_norm``, ``fused_add_rms_norm`` and an EAGLE-3 head's
``draft_layer_input`` (one program per row).

Drop-ins for the reference functions (Hugging Face LlamaRMSNorm order: normalise in fp32, cast
to the input dtype, then multiply by the weight, the product rounded once to the promoted dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from polyspec.kernels.reference import check_draft_layer_input_args
from polyspec.kernels.triton._util import check, next_pow2, rows_2d
from polyspec.kernels.triton.pdl import launch_options, wait_for_previous


@triton.jit
def _normed(x, w_ptr, offs, m, hidden, eps):
    """A row's RMSNorm: normalised in fp32, cast to ``x``'s dtype, times the weight (fp32)."""
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=0) / hidden
    normed = (xf / tl.sqrt(mean_sq + eps)).to(x.dtype)
    w = tl.load(w_ptr + offs, mask=m, other=0.0)
    return normed.to(tl.float32) * w.to(tl.float32)


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
    out = _normed(x, weight_ptr, offs, m, hidden, eps)
    tl.store(out_ptr + row * hidden + offs, out.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _draft_layer_input_kernel(
    ids_ptr,  # [rows] int
    embed_ptr,  # [V, H]
    feat_ptr,  # [rows, H]
    embed_norm_ptr,  # [H]
    feat_norm_ptr,  # [H]
    out_ptr,  # [rows, 2H] contiguous
    hidden,
    eps,
    stride_embed,
    stride_feat,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < hidden
    token = tl.load(ids_ptr + row).to(tl.int64)
    e = tl.load(embed_ptr + token * stride_embed + offs, mask=m, other=0.0)
    out = _normed(e, embed_norm_ptr, offs, m, hidden, eps)
    tl.store(out_ptr + row * 2 * hidden + offs, out.to(out_ptr.dtype.element_ty), mask=m)
    f = tl.load(feat_ptr + row * stride_feat + offs, mask=m, other=0.0)
    out = _normed(f, feat_norm_ptr, offs, m, hidden, eps)
    tl.store(out_ptr + row * 2 * hidden + hidden + offs, out.to(out_ptr.dtype.element_ty), mask=m)


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


def draft_layer_input(
    input_ids: torch.Tensor,  # [T] int
    embed_weight: torch.Tensor,  # [V, H]
    features: torch.Tensor,  # [T, H]
    embed_norm: torch.Tensor,  # [H]
    feature_norm: torch.Tensor,  # [H]
    eps: float,
    pdl: bool = False,
) -> torch.Tensor:  # [T, 2H]
    """Triton ``draft_layer_input``: the embedding lookup, both RMSNorms and their
    concatenation in one launch (four in torch, two of them Triton norms: a draft step's
    launches are most of its cost at small batches). See
    :func:`polyspec.kernels.reference.draft_layer_input`; ``pdl`` as :func:`rms_norm`'s."""
    check_draft_layer_input_args(input_ids, embed_weight, features, embed_norm, feature_norm)
    hidden = features.shape[1]
    check(hidden <= 65536, f"draft_layer_input supports hidden sizes up to 65536, got {hidden}")
    out_dtype = torch.promote_types(
        torch.promote_types(embed_norm.dtype, feature_norm.dtype), features.dtype
    )
    rows = input_ids.shape[0]
    out = torch.empty((rows, 2 * hidden), dtype=out_dtype, device=features.device)
    if rows == 0:
        return out
    if features.stride(-1) != 1:
        features = features.contiguous()
    if embed_weight.stride(-1) != 1:
        embed_weight = embed_weight.contiguous()
    block = next_pow2(hidden)
    _draft_layer_input_kernel[(rows,)](
        input_ids.contiguous(), embed_weight, features, embed_norm.contiguous(),
        feature_norm.contiguous(), out, hidden, float(eps), embed_weight.stride(0),
        features.stride(0), BLOCK=block, PDL=pdl, num_warps=min(max(block // 256, 1), 16),
        **launch_options(pdl),
    )  # fmt: skip
    return out
