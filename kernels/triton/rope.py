"""Triton ``rotary_embedding`` (neox rotate-halves and GPT-J interleaved layouts), one program
per token rotating every query and key head; computed in fp32, returned in q / k's dtypes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from polyspec.kernels.triton._util import check, next_pow2
from polyspec.kernels.triton.cache import check_kv_store
from polyspec.kernels.triton.pdl import launch_options, wait_for_previous


@triton.jit
def _rotate_heads(
    x_ptr,  # [T, H, D] any strides
    out_ptr,  # [H, D] rows contiguous: the rotated heads of token t
    t,
    cos,  # [BLOCK_HALF] fp32
    sin,  # [BLOCK_HALF] fp32
    num_heads,
    half,
    stride_t,
    stride_h,
    stride_d,
    IS_NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Rotate the heads of token ``t`` of ``x`` into ``out_ptr`` (in ``x``'s dtype, then
    the output's: a cache of another dtype gets what ``store_kv`` of the rotated ``x``
    writes)."""
    h = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    m = (h[:, None] < num_heads) & (i[None, :] < half)
    if IS_NEOX:
        first = i
        second = i + half
    else:
        first = 2 * i
        second = 2 * i + 1
    row = x_ptr + t.to(tl.int64) * stride_t + h[:, None] * stride_h
    x1 = tl.load(row + first[None, :] * stride_d, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(row + second[None, :] * stride_d, mask=m, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    out_row = out_ptr + h[:, None] * (2 * half)
    x_dtype = x_ptr.dtype.element_ty
    dtype = out_ptr.dtype.element_ty
    tl.store(out_row + first[None, :], o1.to(x_dtype).to(dtype), mask=m)
    tl.store(out_row + second[None, :], o2.to(x_dtype).to(dtype), mask=m)


@triton.jit
def _cos_sin(positions_ptr, t, cache_ptr, stride_cache, half, BLOCK_HALF: tl.constexpr):
    """Token ``t``'s cos and sin rows ([BLOCK_HALF] fp32) from the cos/sin table."""
    pos = tl.load(positions_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    cache_row = cache_ptr + pos * stride_cache
    cos = tl.load(cache_row + i, mask=i < half, other=0.0).to(tl.float32)
    sin = tl.load(cache_row + half + i, mask=i < half, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def _rotary_kernel(
    positions_ptr,  # [T]
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [T, Hkv, D]
    cache_ptr,  # [max_pos, D] fp32: D/2 cos then D/2 sin
    q_out_ptr,  # [T, Hq, D]
    k_out_ptr,  # [T, Hkv, D]
    num_q_heads,
    num_kv_heads,
    half,
    stride_cache,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    IS_NEOX: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    t = tl.program_id(0)
    cos, sin = _cos_sin(positions_ptr, t, cache_ptr, stride_cache, half, BLOCK_HALF)
    t64 = t.to(tl.int64)
    _rotate_heads(
        q_ptr, q_out_ptr + t64 * num_q_heads * 2 * half, t, cos, sin, num_q_heads, half,
        stride_qt, stride_qh, stride_qd, IS_NEOX, BLOCK_HQ, BLOCK_HALF,
    )  # fmt: skip
    _rotate_heads(
        k_ptr, k_out_ptr + t64 * num_kv_heads * 2 * half, t, cos, sin, num_kv_heads, half,
        stride_kt, stride_kh, stride_kd, IS_NEOX, BLOCK_HKV, BLOCK_HALF,
    )  # fmt: skip


@triton.jit
def _rotary_store_kv_kernel(
    positions_ptr,  # [T]
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    cache_ptr,  # [max_pos, D] fp32: D/2 cos then D/2 sin
    q_out_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [slots, Hkv, D] each slot's rows contiguous
    v_cache_ptr,  # [slots, Hkv, D] each slot's rows contiguous
    loc_ptr,  # [T] slots
    num_q_heads,
    num_kv_heads,
    half,
    stride_cache,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_k_cache,
    stride_v_cache,
    IS_NEOX: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    # _rotary_kernel with k's rotation written straight to its cache slot, and v stored as
    # store_kv stores it: one launch a layer instead of two, the same values.
    wait_for_previous(PDL)
    t = tl.program_id(0)
    t64 = t.to(tl.int64)
    cos, sin = _cos_sin(positions_ptr, t, cache_ptr, stride_cache, half, BLOCK_HALF)
    _rotate_heads(
        q_ptr, q_out_ptr + t64 * num_q_heads * 2 * half, t, cos, sin, num_q_heads, half,
        stride_qt, stride_qh, stride_qd, IS_NEOX, BLOCK_HQ, BLOCK_HALF,
    )  # fmt: skip
    slot = tl.load(loc_ptr + t).to(tl.int64)
    _rotate_heads(
        k_ptr, k_cache_ptr + slot * stride_k_cache, t, cos, sin, num_kv_heads, half,
        stride_kt, stride_kh, stride_kd, IS_NEOX, BLOCK_HKV, BLOCK_HALF,
    )  # fmt: skip
    h = tl.arange(0, BLOCK_HKV)
    d = tl.arange(0, BLOCK_D)
    m = (h[:, None] < num_kv_heads) & (d[None, :] < 2 * half)
    v = tl.load(v_ptr + t64 * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd, mask=m)
    v_row = v_cache_ptr + slot * stride_v_cache + h[:, None] * (2 * half) + d[None, :]
    tl.store(v_row, v.to(v_cache_ptr.dtype.element_ty), mask=m)


def _check_head_dim(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, D]
) -> int:
    """q's head dim D, checked even and shared by k and the cos/sin table."""
    head_dim = q.shape[-1]
    check(
        cos_sin_cache.shape[-1] == head_dim and k.shape[-1] == head_dim and head_dim % 2 == 0,
        f"cos_sin_cache must be [max_pos, D={head_dim}] (D even) and match q / k's head dim; "
        f"got cache {tuple(cos_sin_cache.shape)}, k {tuple(k.shape)}",
    )
    return head_dim


def rotary_embedding(
    positions: torch.Tensor,  # [T]
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, D] fp32: D/2 cos columns then D/2 sin columns
    is_neox: bool = True,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, Hq, D], [T, Hkv, D])
    """Triton ``rotary_embedding``; see :func:`polyspec.kernels.reference.rotary_embedding`.
    ``q`` / ``k`` may be strided views; new contiguous tensors are returned. ``pdl``: launch
    with programmatic dependent launch (:mod:`.pdl`)."""
    head_dim = _check_head_dim(q, k, cos_sin_cache)
    check(
        q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] == positions.numel(),
        f"q [T, Hq, D], k [T, Hkv, D] and positions [T] must agree on T; got "
        f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(positions.shape)}",
    )
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    tokens = q.shape[0]
    if tokens > 0:
        half = head_dim // 2
        _rotary_kernel[(tokens,)](
            positions.reshape(-1).contiguous(),  # the kernel reads it densely
            q,
            k,
            cache,
            q_out,
            k_out,
            q.shape[1],
            k.shape[1],
            half,
            cache.stride(0),
            q.stride(0),
            q.stride(1),
            q.stride(2),
            k.stride(0),
            k.stride(1),
            k.stride(2),
            IS_NEOX=bool(is_neox),
            BLOCK_HQ=next_pow2(q.shape[1]),
            BLOCK_HKV=next_pow2(k.shape[1]),
            BLOCK_HALF=next_pow2(half),
            PDL=pdl,
            **launch_options(pdl),
        )
    return q_out, k_out


def rotary_store_kv(
    positions: torch.Tensor,  # [T]
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, D] fp32: D/2 cos columns then D/2 sin columns
    is_neox: bool,
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,  # [slots, Hkv, D]
    loc: torch.Tensor,  # [T]
    pdl: bool = False,
) -> torch.Tensor:  # [T, Hq, D] q rotated
    """:func:`rotary_embedding` of ``q`` and ``k``, then ``store_kv`` of the rotated ``k`` and
    of ``v`` at ``loc``, in one launch: returns the rotated ``q``; the cache gets bitwise what
    the two kernels write. ``pdl`` as :func:`rotary_embedding`'s."""
    head_dim = _check_head_dim(q, k, cos_sin_cache)
    check(
        q.dim() == 3 and q.shape[0] == positions.numel(),
        f"q [T, Hq, D] and positions [T] must agree on T; got {tuple(q.shape)}, "
        f"{tuple(positions.shape)}",
    )
    check_kv_store(k_cache, v_cache, loc, k, v)
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    tokens = q.shape[0]
    if tokens > 0:
        half = head_dim // 2
        _rotary_store_kv_kernel[(tokens,)](
            positions.reshape(-1).contiguous(), q, k, v, cache, q_out, k_cache, v_cache,
            loc.reshape(-1).contiguous(), q.shape[1], k.shape[1], half, cache.stride(0),
            *q.stride(), *k.stride(), *v.stride(), k_cache.stride(0), v_cache.stride(0),
            IS_NEOX=bool(is_neox), BLOCK_HQ=next_pow2(q.shape[1]), BLOCK_HKV=next_pow2(k.shape[1]),
            BLOCK_HALF=next_pow2(half), BLOCK_D=next_pow2(head_dim), PDL=pdl,
            **launch_options(pdl),
        )  # fmt: skip
    return q_out
