"""Triton paged attention over the SDPA layout of ``polyspec.backends.common.attention``.

:func:`paged_attention` reads that layout's index tensors (eager and captured): for request
``b`` the key columns are ``kv_index[b, :L]``, the
first ``P = L - BW`` of them the cached prefix (visible where ``c < prefix_lens[b]``), the last
``BW`` the mode's block (new tokens or draft lanes) with the bool mask row of the query. The
kernel differs from SDPA in what it reads: the prefix loop stops at the request's own prefix
length (a captured forward's metadata is as wide as its prefix bucket, and SDPA reads every
column of it), keys and values come straight from the pool (no gathered copy), and GQA maps
query head ``h`` to KV head ``h // G``. One program per (query token, query head); online
softmax in fp32.

Status: checked against SDPA under ``TRITON_INTERPRET=1`` (tests/kernels); not measured on a
GPU yet, so the cuda backend's ``TritonAttention`` uses it only with
``POLYSPEC_CUDA_TRITON_ATTENTION=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from polyspec.kernels.triton._util import next_pow2


@triton.jit
def _attend(q, k_ptr, v_ptr, slots, visible, kvh, stride_kt, stride_kh, d, m_i, l_i, acc):
    """One online-softmax step over the keys at ``slots`` where ``visible``: returns the new
    (running max, running sum, weighted value accumulator)."""
    base = slots[:, None] * stride_kt + kvh * stride_kh + d[None, :]
    k = tl.load(k_ptr + base, mask=visible[:, None], other=0.0).to(tl.float32)
    s = tl.where(visible, tl.sum(k * q[None, :], axis=1), -1.0e30)
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    p = tl.where(visible, tl.exp(s - m_new), 0.0)
    alpha = tl.exp(m_i - m_new)
    v = tl.load(v_ptr + base, mask=visible[:, None], other=0.0).to(tl.float32)
    return m_new, l_i * alpha + tl.sum(p, axis=0), acc * alpha + tl.sum(p[:, None] * v, axis=0)


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [slots, Hkv, D]
    v_ptr,  # [slots, Hkv, D]
    out_ptr,  # [T, Hq, D] contiguous
    kv_index_ptr,  # [B, L] slots
    prefix_len_ptr,  # [B]
    token_row_ptr,  # [T] padded query row (b * Qmax + q) of each token
    mask_ptr,  # [B * Qmax, L] int8 (1 = visible); read for the block columns only
    q_max,
    kv_len,  # L
    prefix_width,  # P
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    kvh = h // GROUP
    row = tl.load(token_row_ptr + t).to(tl.int64)
    b = row // q_max
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + t * stride_qt + h * stride_qh + d).to(tl.float32) * scale
    m_i = tl.full((), -1.0e30, tl.float32)
    l_i = tl.full((), 0.0, tl.float32)
    acc = tl.zeros((HEAD_DIM,), tl.float32)

    plen = tl.load(prefix_len_ptr + b).to(tl.int64)
    for start in range(0, plen, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        valid = n < plen
        slots = tl.load(kv_index_ptr + b * kv_len + n, mask=valid, other=0).to(tl.int64)
        m_i, l_i, acc = _attend(q, k_ptr, v_ptr, slots, valid, kvh, stride_kt, stride_kh, d,
                                m_i, l_i, acc)  # fmt: skip

    block = kv_len - prefix_width
    j = tl.arange(0, BLOCK_W)
    in_block = j < block
    col = prefix_width + j
    vis = tl.load(mask_ptr + row * kv_len + col, mask=in_block, other=0) != 0
    slots = tl.load(kv_index_ptr + b * kv_len + col, mask=vis, other=0).to(tl.int64)
    m_i, l_i, acc = _attend(q, k_ptr, v_ptr, slots, vis, kvh, stride_kt, stride_kh, d,
                            m_i, l_i, acc)  # fmt: skip

    out = acc / tl.where(l_i > 0, l_i, 1.0)  # a query that sees nothing (padding) gets zeros
    tl.store(out_ptr + t * HEAD_DIM * tl.num_programs(1) + h * HEAD_DIM + d, out)


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,  # [slots, Hkv, D]
    kv_index: torch.Tensor,  # [B * L] slots of the key columns
    prefix_lens: torch.Tensor,  # [B] int64 prefix columns to read
    token_row: torch.Tensor,  # [T] int64 padded query row (b * Qmax + q) of each token
    mask: torch.Tensor,  # [B * Qmax, L] int8 (1 = visible); only the block columns are read
    max_queries: int,  # Qmax
    kv_len: int,  # L
    prefix_width: int,  # P: the first P columns are the prefix, the last L - P the block
    scale: float,
) -> torch.Tensor:  # [T, Hq, D] in q's dtype
    """Attention of each token over its request's visible columns (module doc); query head
    ``h`` reads kv head ``h // (Hq // Hkv)``."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    num_heads, head_dim = q.shape[1], q.shape[2]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    block = kv_len - prefix_width
    _paged_attention_kernel[(q.shape[0], num_heads)](
        q, k_cache, v_cache, out,
        kv_index, prefix_lens, token_row, mask,
        max_queries, kv_len, prefix_width,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), scale,
        GROUP=num_heads // k_cache.shape[1], HEAD_DIM=head_dim, BLOCK_N=64,
        BLOCK_W=max(16, next_pow2(max(block, 1))),
    )  # fmt: skip
    return out.to(q.dtype)
