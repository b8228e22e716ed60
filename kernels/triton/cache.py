"""Triton slot-bookkeeping kernels, ``assign_draft_cache_locs``, ``assign_req_to_token``,
``assign_extend_cache_locs``, ``assign_accept_locs`` (drop-ins for the KernelSet entries of
the same name in :mod:`polyspec.kernels.reference`), and ``store_kv``, the K/V store of one
layer that the cuda backend's attentions run at the start of every forward. Portable
Triton only. Segment kernels run one program per request and find their offset in the
concatenated slot list by summing the earlier requests' lengths in-kernel (no host sync, no
extra launch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from polyspec.kernels.reference import (
    check_accept_locs_args,
    check_block_cache_locs_args,
    check_draft_cache_locs_args,
)
from polyspec.kernels.triton._util import check, next_pow2, writable
from polyspec.kernels.triton.pdl import launch_options, wait_for_previous


@triton.jit
def _assign_draft_cache_locs_kernel(
    req_pool_indices_ptr,  # [bs]
    req_to_token_ptr,  # [R, C]
    seq_lens_ptr,  # [bs]
    alloc_slots_ptr,  # [bs*K*W]
    lane_locs_ptr,  # out [bs, K, W]
    tail_lens_ptr,  # out [bs]
    copy_src_ptr,  # out [bs*K*(page_size-1)]
    copy_dst_ptr,  # out [bs*K*(page_size-1)]
    topk,
    width,  # W
    max_context,  # C
    stride_rt,
    PAGE_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    b = tl.program_id(0)
    lane_len = topk * width
    base = b.to(tl.int64) * lane_len
    offs = tl.arange(0, BLOCK)
    for c0 in range(0, lane_len, BLOCK):
        m = c0 + offs < lane_len
        slots = tl.load(alloc_slots_ptr + base + c0 + offs, mask=m)
        tl.store(lane_locs_ptr + base + c0 + offs, slots, mask=m)
    if PAGE_SIZE == 1:
        tl.store(tail_lens_ptr + b, 0)
    else:
        seq = tl.load(seq_lens_ptr + b).to(tl.int64)
        tail = seq % PAGE_SIZE
        tl.store(tail_lens_ptr + b, tail)
        row = tl.load(req_pool_indices_ptr + b).to(tl.int64)
        lane = tl.arange(0, BLOCK_K)
        j = tl.arange(0, BLOCK_P)
        real = j < tail  # [BLOCK_P]
        cols = tl.where(real, seq - tail + j, 0)
        cols = tl.minimum(tl.maximum(cols, 0), max_context - 1)
        src = tl.load(req_to_token_ptr + row * stride_rt + cols, mask=real, other=0)
        cell = (lane[:, None] < topk) & (j[None, :] < PAGE_SIZE - 1)  # [BLOCK_K, BLOCK_P]
        lane_start = base + lane[:, None].to(tl.int64) * width  # first slot of each lane
        dst = tl.load(alloc_slots_ptr + lane_start + j[None, :], mask=cell & real[None, :], other=0)
        out = (b.to(tl.int64) * topk + lane[:, None]) * (PAGE_SIZE - 1) + j[None, :]
        src_2d = tl.where(real[None, :], src[None, :], 0) + dst * 0
        tl.store(copy_src_ptr + out, src_2d, mask=cell)
        tl.store(copy_dst_ptr + out, dst, mask=cell)


def assign_draft_cache_locs(
    req_pool_indices: torch.Tensor,  # [bs]
    req_to_token: torch.Tensor,  # [R, C]
    seq_lens: torch.Tensor,  # [bs]
    alloc_slots: torch.Tensor,  # [bs*K*W]
    topk: int,
    num_steps: int,
    page_size: int,
    lane_locs: torch.Tensor,  # out: [bs, K, W]
    tail_lens: torch.Tensor,  # out: [bs]
    copy_src: torch.Tensor,  # out: [bs*K*(page_size-1)]
    copy_dst: torch.Tensor,  # out: [bs*K*(page_size-1)]
    pdl: bool = False,
) -> None:
    """Triton ``assign_draft_cache_locs``; see
    :func:`polyspec.kernels.reference.assign_draft_cache_locs`. ``pdl``: launch with programmatic
    dependent launch (:mod:`.pdl`)."""
    bs, width = check_draft_cache_locs_args(
        seq_lens, alloc_slots, topk, num_steps, page_size, lane_locs, copy_src, copy_dst
    )
    check(req_to_token.stride(-1) == 1, "req_to_token must be contiguous in its last dimension")
    if bs == 0:
        return
    slots = alloc_slots.reshape(-1)
    if not slots.is_contiguous():
        slots = slots.contiguous()
    outs = [writable(t) for t in (lane_locs, tail_lens, copy_src, copy_dst)]
    _assign_draft_cache_locs_kernel[(bs,)](
        req_pool_indices,
        req_to_token,
        seq_lens,
        slots,
        outs[0][0],
        outs[1][0],
        outs[2][0],
        outs[3][0],
        topk,
        width,
        req_to_token.shape[1],
        req_to_token.stride(0),
        PAGE_SIZE=page_size,
        BLOCK=min(next_pow2(topk * width), 1024),
        BLOCK_K=next_pow2(topk),
        BLOCK_P=next_pow2(page_size - 1),
        num_warps=1,
        PDL=pdl,
        **launch_options(pdl),
    )
    for _, finish in outs:
        finish()


@triton.jit
def _segment_kernel(
    req_pool_indices_ptr,  # [bs]
    req_to_token_ptr,  # [R, C]
    start_ptr,  # [bs]
    end_ptr,  # [bs]
    flat_ptr,  # [sum(end - start)]
    num_requests,
    stride_rt,
    TO_TABLE: tl.constexpr,  # True: table <- flat (assign_req_to_token); False: flat <- table
    BLOCK_BS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    b = tl.program_id(0)
    reqs = tl.arange(0, BLOCK_BS)
    in_batch = reqs < num_requests
    starts = tl.load(start_ptr + reqs, mask=in_batch, other=0).to(tl.int64)
    ends = tl.load(end_ptr + reqs, mask=in_batch, other=0).to(tl.int64)
    lens = tl.maximum(ends - starts, 0)
    offset = tl.sum(tl.where(reqs < b, lens, 0), axis=0)  # segments before request b
    length = tl.sum(tl.where(reqs == b, lens, 0), axis=0)
    start = tl.load(start_ptr + b).to(tl.int64)
    row = tl.load(req_pool_indices_ptr + b).to(tl.int64)
    table = req_to_token_ptr + row * stride_rt + start
    offs = tl.arange(0, BLOCK)
    for c0 in range(0, length, BLOCK):
        m = c0 + offs < length
        if TO_TABLE:
            vals = tl.load(flat_ptr + offset + c0 + offs, mask=m)
            tl.store(table + c0 + offs, vals, mask=m)
        else:
            vals = tl.load(table + c0 + offs, mask=m)
            tl.store(flat_ptr + offset + c0 + offs, vals, mask=m)


def _launch_segments(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start: torch.Tensor,
    end: torch.Tensor,
    flat: torch.Tensor,
    to_table: bool,
    pdl: bool = False,
) -> None:
    bs = req_pool_indices.shape[0]
    check(
        start.shape[0] == bs and end.shape[0] == bs,
        f"start / end must be [bs={bs}], got {tuple(start.shape)} and {tuple(end.shape)}",
    )
    check(req_to_token.stride(-1) == 1, "req_to_token must be contiguous in its last dimension")
    if bs == 0:
        return
    _segment_kernel[(bs,)](
        req_pool_indices,
        req_to_token,
        start.contiguous(),
        end.contiguous(),
        flat,
        bs,
        req_to_token.stride(0),
        TO_TABLE=to_table,
        BLOCK_BS=next_pow2(bs),
        BLOCK=128,
        num_warps=1,
        PDL=pdl,
        **launch_options(pdl),
    )


def assign_req_to_token(
    req_pool_indices: torch.Tensor,  # [bs]
    req_to_token: torch.Tensor,  # [R, C] in/out
    start: torch.Tensor,  # [bs]
    end: torch.Tensor,  # [bs]
    slots: torch.Tensor,  # [sum(end - start)]
    pdl: bool = False,
) -> None:
    """Triton ``assign_req_to_token``; see :func:`polyspec.kernels.reference.assign_req_to_token`.
    ``slots`` must hold exactly sum(end - start) entries (not checked: that would need a host
    sync). ``pdl``: launch with programmatic dependent launch (:mod:`.pdl`)."""
    flat = slots.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    _launch_segments(req_pool_indices, req_to_token, start, end, flat, True, pdl)


def assign_extend_cache_locs(
    req_pool_indices: torch.Tensor,  # [bs]
    req_to_token: torch.Tensor,  # [R, C]
    start: torch.Tensor,  # [bs]
    end: torch.Tensor,  # [bs]
    out: torch.Tensor,  # out: [sum(end - start)]
    pdl: bool = False,
) -> None:
    """Triton ``assign_extend_cache_locs``; see
    :func:`polyspec.kernels.reference.assign_extend_cache_locs`. ``pdl``: launch with programmatic
    dependent launch (:mod:`.pdl`)."""
    buf, finish = writable(out)
    _launch_segments(req_pool_indices, req_to_token, start, end, buf, False, pdl)
    finish()


@triton.jit
def _block_cache_locs_kernel(
    req_pool_indices_ptr,  # [bs] (stride stride_rows)
    req_to_token_ptr,  # [R, C]
    start_ptr,  # [bs] (stride stride_start)
    lens_ptr,  # [bs] (stride stride_lens)
    out_loc_ptr,  # out [bs * width]
    positions_ptr,  # out [bs * width] int64
    width,
    max_context,  # C
    stride_rt,
    stride_rows,  # the per-request inputs may be strided columns of one upload
    stride_start,
    stride_lens,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    b = tl.program_id(0).to(tl.int64)
    row = tl.load(req_pool_indices_ptr + b * stride_rows).to(tl.int64)
    start = tl.load(start_ptr + b * stride_start).to(tl.int64)
    n = tl.load(lens_ptr + b * stride_lens).to(tl.int64)
    for j0 in range(0, width, BLOCK):
        j = j0 + tl.arange(0, BLOCK).to(tl.int64)
        m = j < width
        pos = tl.minimum(start + j, max_context - 1)
        slot = tl.load(req_to_token_ptr + row * stride_rt + pos, mask=m & (j < n), other=0)
        tl.store(out_loc_ptr + b * width + j, slot, mask=m)
        tl.store(positions_ptr + b * width + j, pos, mask=m)


def assign_block_cache_locs(
    req_pool_indices: torch.Tensor,  # [bs]
    req_to_token: torch.Tensor,  # [R, C]
    start: torch.Tensor,  # [bs]
    lens: torch.Tensor,  # [bs]
    width: int,
    out_loc: torch.Tensor,  # out: [bs * width]
    positions: torch.Tensor,  # out: [bs * width] int64
    pdl: bool = False,
) -> None:
    """Triton ``assign_block_cache_locs`` (one program per request; five torch launches in
    the reference); see :func:`polyspec.kernels.reference.assign_block_cache_locs`. ``pdl``:
    launch with programmatic dependent launch (:mod:`.pdl`)."""
    check_block_cache_locs_args(req_pool_indices, start, lens, width, out_loc, positions)
    bs = req_pool_indices.shape[0]
    check(positions.dtype == torch.int64, f"positions must be int64, got {positions.dtype}")
    check(req_to_token.stride(-1) == 1, "req_to_token must be contiguous in its last dimension")
    if bs == 0 or width == 0:
        return
    loc, finish_loc = writable(out_loc)
    pos, finish_pos = writable(positions)
    _block_cache_locs_kernel[(bs,)](
        req_pool_indices, req_to_token, start, lens, loc, pos, width, req_to_token.shape[1],
        req_to_token.stride(0), req_pool_indices.stride(0), start.stride(0), lens.stride(0),
        BLOCK=min(next_pow2(width), 128), num_warps=1, PDL=pdl, **launch_options(pdl),
    )  # fmt: skip
    finish_loc()
    finish_pos()


@triton.jit
def _assign_accept_locs_kernel(
    req_pool_indices_ptr,  # [bs]
    req_to_token_ptr,  # [R, C]
    seq_lens_ptr,  # [bs]
    widths_ptr,  # [bs]
    accept_index_ptr,  # [bs, S+1]
    accept_length_ptr,  # [bs]
    src_loc_ptr,  # out [bs*(S+1)]
    dst_loc_ptr,  # out [bs*(S+1)]
    positions_ptr,  # out [bs*(S+1)]
    path_node_ptr,  # out [bs*(S+1)]
    extend_lens_ptr,  # out [bs]
    last_index_ptr,  # out [bs]
    depth,  # S + 1
    num_draft_tokens,
    max_context,  # C
    stride_rt,
    stride_ai,
    stride_rows,  # the per-request inputs may be strided columns of one upload
    stride_seq,
    stride_w,
    stride_len,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    b = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    in_path = d < depth
    row = tl.load(req_pool_indices_ptr + b * stride_rows).to(tl.int64)
    start = tl.load(seq_lens_ptr + b * stride_seq).to(tl.int64)
    length = tl.load(accept_length_ptr + b * stride_len).to(tl.int64)
    active = tl.load(widths_ptr + b * stride_w) > 0
    live = (d <= tl.where(active, length, -1)) & in_path  # padding requests move nothing
    path = tl.load(accept_index_ptr + b * stride_ai + d, mask=in_path, other=0).to(tl.int64)
    node = path - b.to(tl.int64) * num_draft_tokens
    src_col = tl.minimum(tl.maximum(start + node, 0), max_context - 1)
    pos = tl.minimum(start + d, max_context - 1)
    table = req_to_token_ptr + row * stride_rt
    src = tl.load(table + src_col, mask=live, other=0)
    dst = tl.load(table + pos, mask=live, other=0)
    last_node = tl.load(accept_index_ptr + b * stride_ai + tl.minimum(length, depth - 1))
    out = b.to(tl.int64) * depth + d
    tl.store(src_loc_ptr + out, src, mask=in_path)
    tl.store(dst_loc_ptr + out, dst, mask=in_path)
    tl.store(positions_ptr + out, pos, mask=in_path)
    tl.store(path_node_ptr + out, tl.where(d <= length, path, last_node), mask=in_path)
    ext = tl.where(active, length + 1, 0)
    tl.store(extend_lens_ptr + b, ext)
    tl.store(last_index_ptr + b, b.to(tl.int64) * depth + tl.maximum(ext - 1, 0))


def assign_accept_locs(
    req_pool_indices: torch.Tensor,  # [bs]
    req_to_token: torch.Tensor,  # [R, C]
    seq_lens: torch.Tensor,  # [bs]
    widths: torch.Tensor,  # [bs]
    accept_index: torch.Tensor,  # [bs, S+1]
    accept_length: torch.Tensor,  # [bs]
    num_draft_tokens: int,
    src_loc: torch.Tensor,  # out: [bs*(S+1)]
    dst_loc: torch.Tensor,  # out: [bs*(S+1)]
    positions: torch.Tensor,  # out: [bs*(S+1)]
    path_node: torch.Tensor,  # out: [bs*(S+1)]
    extend_lens: torch.Tensor,  # out: [bs]
    last_index: torch.Tensor,  # out: [bs]
    pdl: bool = False,
) -> None:
    """Triton ``assign_accept_locs`` (one program per request); see
    :func:`polyspec.kernels.reference.assign_accept_locs`. ``pdl``: launch with programmatic
    dependent launch (:mod:`.pdl`)."""
    outs = (src_loc, dst_loc, positions, path_node, extend_lens, last_index)
    bs, depth = check_accept_locs_args(req_pool_indices, accept_index, outs)
    check(req_to_token.stride(-1) == 1, "req_to_token must be contiguous in its last dimension")
    check(accept_index.stride(-1) == 1, "accept_index must be contiguous in its last dimension")
    if bs == 0:
        return
    bufs = [writable(t) for t in outs]
    _assign_accept_locs_kernel[(bs,)](
        req_pool_indices,
        req_to_token,
        seq_lens,
        widths,
        accept_index,
        accept_length,
        *(buf for buf, _ in bufs),
        depth,
        num_draft_tokens,
        req_to_token.shape[1],
        req_to_token.stride(0),
        accept_index.stride(0),
        req_pool_indices.stride(0),
        seq_lens.stride(0),
        widths.stride(0),
        accept_length.stride(0),
        BLOCK_D=next_pow2(depth),
        num_warps=1,
        PDL=pdl,
        **launch_options(pdl),
    )
    for _, finish in bufs:
        finish()


def _cache_rows(cache: torch.Tensor, what: str) -> int:
    """Row length (Hkv * D) of a ``[slots, Hkv, D]`` cache whose rows are contiguous."""
    check(cache.dim() == 3, f"{what} must be [slots, Hkv, D], got {tuple(cache.shape)}")
    hkv, d = cache.shape[1], cache.shape[2]
    check(
        cache.stride(2) == 1 and (hkv == 1 or cache.stride(1) == d),
        f"{what}: each slot's [Hkv, D] block must be contiguous (as KV pools allocate them)",
    )
    return hkv * d


@triton.jit
def _store_kv_kernel(
    k_cache_ptr,  # [slots, Hkv, D] rows contiguous
    v_cache_ptr,  # [slots, Hkv, D] rows contiguous
    loc_ptr,  # [T]
    k_ptr,  # [T, Hkv, D] any strides
    v_ptr,  # [T, Hkv, D] any strides
    num_heads,
    head_dim,
    stride_k_cache,
    stride_v_cache,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    # K and V of one token per program: one launch per layer instead of two.
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    m = (h[:, None] < num_heads) & (d[None, :] < head_dim)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    row = h[:, None] * head_dim + d[None, :]
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :] * stride_kd, mask=m)
    tl.store(k_cache_ptr + slot * stride_k_cache + row, k.to(k_cache_ptr.dtype.element_ty), mask=m)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd, mask=m)
    tl.store(v_cache_ptr + slot * stride_v_cache + row, v.to(v_cache_ptr.dtype.element_ty), mask=m)


def store_kv(
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,  # [slots, Hkv, D]
    loc: torch.Tensor,  # [T]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    pdl: bool = False,
) -> None:
    """Triton ``store_kv``: ``k_cache[loc] = k``, ``v_cache[loc] = v`` (cast to the cache
    dtype); ``k`` / ``v`` may be strided views (e.g. slices of a fused QKV projection).
    ``pdl``: launch with programmatic dependent launch (:mod:`.pdl`)."""
    tokens = loc.numel()
    if tokens == 0:
        return
    check_kv_store(k_cache, v_cache, loc, k, v)
    _store_kv_kernel[(tokens,)](
        k_cache, v_cache, loc.reshape(-1).contiguous(), k, v, k_cache.shape[1], k_cache.shape[2],
        k_cache.stride(0), v_cache.stride(0), *k.stride(), *v.stride(),
        BLOCK_H=next_pow2(k_cache.shape[1]), BLOCK_D=next_pow2(k_cache.shape[2]), PDL=pdl,
        **launch_options(pdl),
    )  # fmt: skip


def check_kv_store(
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,  # [slots, Hkv, D]
    loc: torch.Tensor,  # [T]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
) -> None:
    """The shape checks of a K/V store (``store_kv``, ``rotary_store_kv``)."""
    tokens = loc.numel()
    for cache, x, what in ((k_cache, k, "k"), (v_cache, v, "v")):
        _cache_rows(cache, f"{what}_cache")
        check(
            x.dim() == 3 and x.shape[0] == tokens and x.shape[1:] == cache.shape[1:],
            f"{what} must be [T={tokens}, Hkv, D] = [{tokens}, {cache.shape[1]}, "
            f"{cache.shape[2]}], got {tuple(x.shape)}",
        )
    check(
        k_cache.shape[1:] == v_cache.shape[1:],
        f"k_cache and v_cache must share [Hkv, D], got {tuple(k_cache.shape)} and "
        f"{tuple(v_cache.shape)}",
    )
