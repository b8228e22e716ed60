"""Row-invariant paged attention: each query token attends to its own ordered list of keys.

Why: a draft token verified at tree depth d must get bitwise the attention output a plain
decode step at the same position would get, or bf16 greedy speculative output parts from
plain greedy output after a near-tie. SDPA (and :mod:`.attention`) split the keys into the
cached prefix and the mode's block, so the same keys are summed in a different grouping in a
verify forward than in a decode step. Here the SDPA layout of
``polyspec.backends.common.attention`` (any mode, eager or captured) is turned into one list per
token: its visible key columns in column
order, which is the prefix in position order and then, for a verify row, its ancestors root
first (a tree node's parent always precedes it). That is exactly the list a plain decode step
at that position has. The kernel walks every list in ``BLOCK_N`` chunks of the list index
with an fp32 online softmax, so two equal lists give equal results, whatever else is in the
batch. One program serves the query heads of one kv head (GQA): their scores and weighted
values are two small matrix products per key block, so each key block is read once for the
group; the probabilities enter the second product in the value dtype, as in flash attention.

The lists are ``key_lists [T, L]`` (slot of the i-th visible key; the tail past ``key_lens`` is
never read) and ``key_lens [T]``. An eager forward derives them from SDPA's layout with device
ops (a cumsum and a scatter, no ``nonzero``: ``key_lists_from`` of the cuda backend's
attention); a captured forward writes them with one kernel,
:func:`static_key_lists`, straight from the batch's index tensors: the layout and its mask took
about 35 small launches per forward, four forwards a speculative round, and inside a CUDA graph
each launch costs its latency whatever its size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from polyspec.backend import ForwardBatch, ForwardMode
from polyspec.kernels.triton._util import check, interpreted, next_pow2
from polyspec.kernels.triton.pdl import launch_options, wait_for_previous

BLOCK_N = 128
"""Keys per online-softmax step. Chosen on the H200 for this kernel's first, one-program-per-
query-head form (benchmarks/bench_rowinv_cuda.py, SmolLM2's 9/3 heads, in graphs): a 400-key list
took 18.5 / 14.5 / 11.6 us with 32 / 64 / 128, the loop being latency-bound. The grouped form
that replaced it was measured end to end only (at ba249ec); the block sizes were compared again
for it on an H100 (docs/benchmarks.md, "List attention block size")."""


@triton.jit
def _list_attention_kernel(
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [slots, Hkv, D]
    v_ptr,  # [slots, Hkv, D]
    out_ptr,  # [T, Hq, D] contiguous
    lists_ptr,  # [T, *] slots, row stride list_stride
    lens_ptr,  # [T]
    list_stride,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    scale,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    # One program per (token, kv head): the GROUP query heads that share a kv head read each key
    # block once, as the rows of one matrix product (padded to GROUP_PAD >= 16 rows for the MMA;
    # the padding rows are zeros and never mix into the real ones).
    t = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    g = tl.arange(0, GROUP_PAD)
    g_ok = g < GROUP
    h = kvh * GROUP + g
    d = tl.arange(0, HEAD_DIM)
    q_off = t * stride_qt + h[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=g_ok[:, None], other=0.0)  # [GROUP_PAD, D]
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full((GROUP_PAD,), -1.0e30, tl.float32)
    l_i = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, HEAD_DIM), tl.float32)
    n_keys = tl.load(lens_ptr + t).to(tl.int64)
    for start in range(0, n_keys, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        valid = n < n_keys
        slots = tl.load(lists_ptr + t * list_stride + n, mask=valid, other=0).to(tl.int64)
        kv_off = slots[:, None] * stride_kt + kvh * stride_kh + d[None, :]
        k = tl.load(k_ptr + kv_off, mask=valid[:, None], other=0.0)  # [BLOCK_N, D]
        v = tl.load(v_ptr + kv_off, mask=valid[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(valid[None, :], s * scale, -1.0e30)  # [GROUP_PAD, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.where(valid[None, :], tl.exp(s - m_new[:, None]), 0.0)
        alpha = tl.exp(m_i - m_new)
        pv = p.to(v.dtype)  # the probabilities in the value dtype, as flash attention does
        if UPCAST:
            pv = pv.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(pv, v)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_off = t * HEAD_DIM * GROUP * tl.num_programs(1) + h[:, None] * HEAD_DIM + d[None, :]
    tl.store(out_ptr + o_off, out, mask=g_ok[:, None])


def list_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,  # [slots, Hkv, D]
    key_lists: torch.Tensor,  # [T, L] slots in attention order (last dim contiguous)
    key_lens: torch.Tensor,  # [T] keys of each list (>= 1)
    scale: float,
    block_n: int = BLOCK_N,
    num_warps: int = 4,
    pdl: bool = False,
) -> torch.Tensor:  # [T, Hq, D] in q's dtype
    """Attention of each query token over ``key_lists[t, :key_lens[t]]`` (module doc); query
    head ``h`` reads kv head ``h // (Hq // Hkv)``. ``block_n`` and ``num_warps`` are for
    benchmarks: one process must keep one ``block_n``, or equal lists stop giving equal
    results. ``pdl``: launch with programmatic dependent launch (:mod:`.pdl`)."""
    t, hq, d = q.shape
    hkv = k_cache.shape[1]
    if hq % hkv or d & (d - 1) or d < 16 or k_cache.shape[2] != d:
        raise ValueError(
            f"list attention: needs Hq % Hkv == 0 and a power-of-two head dim >= 16 (the matrix "
            f"units' smallest K) shared by q and the cache; got q {list(q.shape)}, k_cache "
            f"{list(k_cache.shape)}; POLYSPEC_CUDA_KERNELS=torch runs other head dims on SDPA"
        )
    if key_lists.stride(-1) != 1:
        key_lists = key_lists.contiguous()
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    upcast = interpreted()  # numpy has no bf16 (see interpreted())
    group = hq // hkv
    _list_attention_kernel[(t, hkv)](
        q, k_cache, v_cache, out, key_lists, key_lens, key_lists.stride(0),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), float(scale),
        GROUP=group, GROUP_PAD=max(16, next_pow2(group)), HEAD_DIM=d, BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32 or upcast, UPCAST=upcast, num_warps=num_warps, PDL=pdl,
        **launch_options(pdl),
    )  # fmt: skip
    return out


@triton.jit
def _static_key_lists_kernel(
    table_ptr,  # [R, C] req_to_token
    rows_ptr,  # [bs] table row of each request
    prefix_ptr,  # [bs]
    extend_ptr,  # [bs]
    tree_ptr,  # [bs, Q, Q] uint8 (TREE mode)
    lanes_ptr,  # [bs, Q, W] (LANES mode: Q = K lanes)
    lane_lens_ptr,  # [bs] (LANES mode)
    lists_ptr,  # [T, list_stride] out
    lens_ptr,  # [T] int32 out
    rows_stride,  # the per-request inputs may be strided views (a transposed [bs, 4] upload)
    prefix_stride,
    extend_stride,
    lane_lens_stride,
    table_stride,
    table_cols,
    width,
    list_stride,
    lane_stride_b,
    lane_stride_k,
    Q: tl.constexpr,
    Q_PAD: tl.constexpr,
    W_PAD: tl.constexpr,
    MODE: tl.constexpr,  # 0 causal, 1 tree mask, 2 lanes
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    # One program per token t = b * Q + j: its visible prefix columns, then its visible block.
    t = tl.program_id(0).to(tl.int64)
    b = t // Q
    j = t % Q
    row = tl.load(rows_ptr + b * rows_stride).to(tl.int64)
    prefix = tl.load(prefix_ptr + b * prefix_stride).to(tl.int64)
    p = tl.minimum(prefix, width)
    out = lists_ptr + t * list_stride
    for start in range(0, p, BLOCK):
        c = start + tl.arange(0, BLOCK)
        keep = c < p
        slots = tl.load(table_ptr + row * table_stride + c, mask=keep, other=0)
        tl.store(out + c, slots.to(tl.int64), mask=keep)
    if MODE == 2:
        w = tl.arange(0, W_PAD)
        n_lane = tl.load(lane_lens_ptr + b * lane_lens_stride).to(tl.int64)
        keep = w < n_lane
        slots = tl.load(lanes_ptr + b * lane_stride_b + j * lane_stride_k + w, mask=keep, other=0)
        tl.store(out + p + w, slots.to(tl.int64), mask=keep)
        n = p + tl.maximum(n_lane, 0)
    else:
        jj = tl.arange(0, Q_PAD)
        extend = tl.load(extend_ptr + b * extend_stride).to(tl.int64)
        seen = (jj < Q) & (jj < extend)
        if MODE == 1:
            tree = tl.load(tree_ptr + t * Q + jj, mask=jj < Q, other=0)
            seen = seen & (tree != 0)
        else:
            seen = seen & (jj <= j)
        rank = tl.cumsum(seen.to(tl.int32), 0) - 1
        col = tl.minimum(prefix + jj, table_cols - 1)
        slots = tl.load(table_ptr + row * table_stride + col, mask=seen, other=0)
        tl.store(out + p + rank, slots.to(tl.int64), mask=seen)
        n = p + tl.sum(seen.to(tl.int64), 0)
    # A padding token sees nothing; give it slot 0 so that its (dropped) row stays finite.
    tl.store(out, tl.zeros((), tl.int64), mask=n == 0)
    tl.store(lens_ptr + t, tl.maximum(n, 1).to(tl.int32))


def static_key_lists(
    batch: ForwardBatch, max_prefix_len: int, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, L] int64, [T] int32)
    """The key lists of a captured forward (``T = bs * Q`` tokens, ``Q`` per request) in one
    launch, equal token by token to ``key_lists_from`` over SDPA's static layout: prefix
    columns below ``min(prefix_lens[b], max_prefix_len)``, then the block (EXTEND, DECODE,
    DRAFT_EXTEND: causal among the first ``extend_lens[b]``; TARGET_VERIFY: the tree mask;
    DRAFT_DECODE: lane ``j``'s first ``lane_lens[b]`` slots). A token that sees nothing (a
    graph's padding request) gets slot 0 alone. Device tensors only: no host sync. ``pdl``:
    launch with programmatic dependent launch (:mod:`.pdl`)."""
    bs, num_tokens = batch.batch_size, batch.num_tokens
    check(
        bs >= 1 and num_tokens % bs == 0,
        f"attention: a captured forward needs T = bs * Q tokens, got T = {num_tokens} for "
        f"bs = {bs}",
    )
    q = num_tokens // bs
    table = batch.req_to_token
    width = min(int(max_prefix_len), table.shape[1])
    dev = table.device
    tree = lanes = lane_lens = batch.prefix_lens  # placeholders the mode never reads
    lane_strides = (0, 0)
    block, w_pad = q, 1
    if batch.mode is ForwardMode.DRAFT_DECODE:
        check(
            batch.lane_locs is not None and batch.lane_lens is not None,
            "attention: DRAFT_DECODE needs lane_locs and lane_lens",
        )
        lanes, lane_lens = batch.lane_locs, batch.lane_lens
        check(
            lanes.dim() == 3 and tuple(lanes.shape[:2]) == (bs, q),
            f"attention: DRAFT_DECODE needs lane_locs [bs, K, W] = [{bs}, {q}, W], got "
            f"{list(lanes.shape)}",
        )
        if lanes.stride(-1) != 1:
            lanes = lanes.contiguous()
        lane_strides = (lanes.stride(0), lanes.stride(1))
        block, w_pad, mode = lanes.shape[2], next_pow2(lanes.shape[2]), 2
    elif batch.mode is ForwardMode.TARGET_VERIFY:
        check(
            batch.tree_mask is not None and tuple(batch.tree_mask.shape) == (bs, q, q),
            f"attention: TARGET_VERIFY needs tree_mask bool [bs, N, N] = [{bs}, {q}, {q}]",
        )
        tree, mode = batch.tree_mask.to(torch.bool).contiguous().view(torch.uint8), 1
    else:
        mode = 0
    if table.stride(-1) != 1:
        table = table.contiguous()
    per_request = (batch.req_pool_indices, batch.prefix_lens, batch.extend_lens)
    lists = torch.empty((num_tokens, width + block), dtype=torch.int64, device=dev)
    lens = torch.empty(num_tokens, dtype=torch.int32, device=dev)
    _static_key_lists_kernel[(num_tokens,)](
        table, *per_request, tree, lanes,
        lane_lens, lists, lens, *(x.stride(0) for x in per_request), lane_lens.stride(0),
        table.stride(0), table.shape[1], width, lists.stride(0),
        *lane_strides, Q=q, Q_PAD=next_pow2(q), W_PAD=w_pad, MODE=mode, BLOCK=256,
        PDL=pdl, **launch_options(pdl),
    )  # fmt: skip
    return lists, lens
