"""The draft loop's top-K expansion (``select_top_k``) and the choice of the tree's nodes
(``organize_draft_results``), one launch each per call.

Why: in torch each is a handful of small launches (products, a top-k with its sort, gathers,
index arithmetic), run S + 1 times inside every captured speculative round, and a launch in a
CUDA graph costs its latency whatever its size. Semantics are the reference's
(:mod:`polyspec.kernels._tree`); the K best come in descending order, ties (and NaN, which
ranks above every number, as in ``torch.topk``) to the lower index.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from polyspec.kernels._tree import check_select_inputs, draft_levels
from polyspec.kernels.triton._util import next_pow2
from polyspec.kernels.triton.pdl import launch_options, wait_for_previous

F_BLOCK = 1024
"""Hidden-state elements copied per step of a lane's row."""


@triton.jit
def _copy_row(src_ptr, dst_ptr, F, F_BLOCK: tl.constexpr):
    for start in range(0, F, F_BLOCK):
        c = start + tl.arange(0, F_BLOCK)
        tl.store(dst_ptr + c, tl.load(src_ptr + c, mask=c < F), mask=c < F)


@triton.jit
def _root_level_kernel(
    hidden_ptr,  # [bs, F] (row stride hidden_stride)
    out_hidden_ptr,  # [bs * K, F] contiguous
    parents_ptr,  # [bs, K + 1]
    F,
    hidden_stride,
    K: tl.constexpr,
    K1_PAD: tl.constexpr,
    F_BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, K1_PAD)
    tl.store(parents_ptr + b * (K + 1) + j, j - 1, mask=j < K + 1)
    for a in tl.static_range(K):
        _copy_row(hidden_ptr + b * hidden_stride, out_hidden_ptr + (b * K + a) * F, F, F_BLOCK)


@triton.jit
def _select_kernel(
    scores_ptr,  # [bs, K] cumulative path probabilities of the lanes
    p_ptr,  # [bs * K, K] contiguous: each lane's children's draft probabilities
    tokens_ptr,  # [bs * K, K] contiguous: their tokens
    hidden_ptr,  # [bs * K, F] (row stride hidden_stride)
    flat_ptr,  # [bs, K * K] out: path probability of every child
    ids_ptr,  # [bs * K] out: tokens of the K kept children
    out_hidden_ptr,  # [bs * K, F] out, contiguous: hidden state of the lane each came from
    cs_ptr,  # [bs, K] out: their path probabilities
    parents_ptr,  # [bs, K] out: their candidate ids
    F,
    hidden_stride,
    parent_base,
    K: tl.constexpr,
    KK_PAD: tl.constexpr,
    F_BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    b = tl.program_id(0).to(tl.int64)
    f = tl.arange(0, KK_PAD)
    ok = f < K * K
    lane = f // K
    s = tl.load(scores_ptr + b * K + lane, mask=ok, other=0.0).to(tl.float32)
    p = tl.load(p_ptr + b * K * K + f, mask=ok, other=0.0).to(tl.float32)
    e = s * p
    tl.store(flat_ptr + b * K * K + f, e, mask=ok)
    key = tl.where(e != e, float("inf"), e)  # NaN ranks first, as in torch.topk
    key = tl.where(ok, key, float("-inf"))
    taken = f >= K * K
    for a in tl.static_range(K):
        best = tl.max(tl.where(taken, float("-inf"), key), 0)
        at = tl.min(tl.where(~taken & (key == best), f, KK_PAD), 0)
        taken = taken | (f == at)
        value = tl.sum(tl.where(f == at, e, 0.0), 0)
        tl.store(cs_ptr + b * K + a, value)
        tl.store(ids_ptr + b * K + a, tl.load(tokens_ptr + b * K * K + at))
        tl.store(parents_ptr + b * K + a, at + parent_base)
        src = hidden_ptr + (b * K + at // K) * hidden_stride
        _copy_row(src, out_hidden_ptr + (b * K + a) * F, F, F_BLOCK)


@triton.jit
def _organize_kernel(
    scores_ptr,  # [bs, C] contiguous: every candidate's path probability
    tokens_ptr,  # [bs, C] contiguous
    index_ptr,  # [bs, M] out int64: the M best candidate ids, ascending
    draft_ptr,  # [bs, M] out: their tokens
    C,
    M: tl.constexpr,
    C_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    b = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, C_PAD)
    ok = c < C
    v = tl.load(scores_ptr + b * C + c, mask=ok, other=0.0).to(tl.float32)
    key = tl.where(v != v, float("inf"), v)
    key = tl.where(ok, key, float("-inf"))
    taken = c < 0
    for _ in tl.static_range(M):
        best = tl.max(tl.where(taken | ~ok, float("-inf"), key), 0)
        at = tl.min(tl.where(~taken & ok & (key == best), c, C_PAD), 0)
        taken = taken | (c == at)
    rank = tl.cumsum(taken.to(tl.int32), 0) - 1  # ascending candidate id
    tl.store(index_ptr + b * M + rank, c.to(tl.int64), mask=taken)
    tokens = tl.load(tokens_ptr + b * C + c, mask=taken, other=0)
    tl.store(draft_ptr + b * M + rank, tokens, mask=taken)


def select_top_k(
    step: int,
    topk_p: torch.Tensor,  # [bs, K] at step 0, [bs*K, K] after
    topk_index: torch.Tensor,  # [bs, K] at step 0, [bs*K, K] after
    hidden: torch.Tensor,  # [bs, F] at step 0, [bs*K, F] after
    scores: torch.Tensor | None,  # [bs, K] after step 0; None at step 0
    topk: int,
    pdl: bool = False,
):
    """``polyspec.kernels.reference.select_top_k`` in one launch (module doc). ``pdl``: launch with
    programmatic dependent launch (:mod:`.pdl`)."""
    k = topk
    bs = check_select_inputs(step, topk_p, topk_index, hidden, scores, k)
    dev, idx = topk_index.device, topk_index.dtype
    feat = hidden.shape[-1]
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    if step == 0:
        out_hidden = torch.empty((bs * k, feat), dtype=hidden.dtype, device=hidden.device)
        parents = torch.empty((bs, k + 1), dtype=idx, device=dev)
        if bs:
            _root_level_kernel[(bs,)](
                hidden, out_hidden, parents, feat, hidden.stride(0),
                K=k, K1_PAD=next_pow2(k + 1), F_BLOCK=F_BLOCK, PDL=pdl, **launch_options(pdl),
            )  # fmt: skip
        return topk_index.flatten(), out_hidden, topk_p, (topk_p, topk_index, parents)
    assert scores is not None
    topk_p, topk_index, scores = topk_p.contiguous(), topk_index.contiguous(), scores.contiguous()
    flat_dtype = torch.promote_types(scores.dtype, topk_p.dtype)
    flat = torch.empty((bs, k * k), dtype=flat_dtype, device=dev)
    ids = torch.empty(bs * k, dtype=idx, device=dev)
    out_hidden = torch.empty((bs * k, feat), dtype=hidden.dtype, device=hidden.device)
    cs_p = torch.empty((bs, k), dtype=flat_dtype, device=dev)
    parents = torch.empty((bs, k), dtype=idx, device=dev)
    if bs:
        _select_kernel[(bs,)](
            scores, topk_p, topk_index, hidden, flat, ids, out_hidden, cs_p, parents,
            feat, hidden.stride(0), k * k * (step - 1) + k,
            K=k, KK_PAD=next_pow2(k * k), F_BLOCK=F_BLOCK, PDL=pdl, **launch_options(pdl),
        )  # fmt: skip
    return ids, out_hidden, cs_p, (flat, topk_index.view(bs, k * k), parents)


def organize_draft_results(
    tree_scores_list: list[torch.Tensor],  # S tensors: [bs, K] then [bs, K*K] ...
    tree_tokens_list: list[torch.Tensor],  # S tensors, same shapes as the scores
    tree_parents_list: list[torch.Tensor],  # S tensors: [bs, K+1] then [bs, K] ...
    num_draft_tokens: int,
    pdl: bool = False,
):
    """``polyspec.kernels.reference.organize_draft_results``: the concatenations in torch, the
    choice of the best ``N - 1`` (ascending ids) and their tokens in one launch. ``pdl``: launch
    with programmatic dependent launch (:mod:`.pdl`)."""
    scores, tokens, parent_list = draft_levels(
        tree_scores_list, tree_tokens_list, tree_parents_list, num_draft_tokens
    )
    bs, num_candidates = scores.shape
    m = num_draft_tokens - 1
    index = torch.empty((bs, m), dtype=torch.int64, device=scores.device)
    draft_tokens = torch.empty((bs, m), dtype=tokens.dtype, device=tokens.device)
    if bs:
        _organize_kernel[(bs,)](
            scores, tokens, index, draft_tokens, num_candidates, M=m,
            C_PAD=next_pow2(num_candidates), PDL=pdl, **launch_options(pdl),
        )  # fmt: skip
    return parent_list, index, draft_tokens
