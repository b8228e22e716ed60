"""Triton draft-tree kernels: ``build_tree``, ``verify_tree_greedy``, ``verify_tree_sampling``.

Drop-ins for the functions of the same name in :mod:`polyspec.kernels.reference` (same
signatures, same outputs, every ``out`` entry written). One program per request. Portable
Triton only (plain ``tl.*`` ops, no inline assembly or CUDA intrinsics) so that triton-ascend
can compile the same source. Register vectors are never indexed by a runtime value: a "gather"
from a register vector is a one-hot reduction (``sum(where(node == i, vec, 0))``), and walks read
links with scalar loads from the (read-only) input tensors.

Notation: ``bs`` requests, ``K`` topk, ``S`` num_steps, ``N`` num_draft_tokens, ``V`` vocab.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from polyspec.backend import TreeMaskMode
from polyspec.kernels._tree import check_build_tree_args, check_sampling_probs, check_verify_args
from polyspec.kernels.triton._util import check, next_pow2, writable
from polyspec.kernels.triton.pdl import launch_options, wait_for_previous

# ------------------------------------------------------------------------------ build_tree


@triton.jit
def _build_tree_kernel(
    parent_list_ptr,  # [bs, P]
    selected_ptr,  # [bs, N-1] candidate ids of nodes 1..N-1
    seq_lens_ptr,  # [bs]
    mask_ptr,  # [bs, N, N] (TREE_ONLY)
    positions_ptr,  # [bs*N]
    retrive_index_ptr,  # [bs, N]
    next_token_ptr,  # [bs, N]
    next_sibling_ptr,  # [bs, N]
    topk,
    num_steps,
    n,
    num_parents,  # P
    stride_parent,
    stride_selected,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    b = tl.program_id(0)
    node = tl.arange(0, BLOCK_N)  # [BLOCK_N] int32
    valid = node < n
    is_draft = (node >= 1) & valid  # nodes 1..N-1 carry a candidate

    # Candidate id of every node, and the candidate id of its parent.
    sel = tl.load(selected_ptr + b * stride_selected + node - 1, mask=is_draft, other=-1)
    sel = sel.to(tl.int64)
    # Floor division for c >= 0 only: a negative id is garbage and has no parent at all.
    pc = tl.where(sel >= 0, sel // topk, -1)
    in_range = is_draft & (pc >= 1) & (pc < num_parents)
    parent_cand = tl.load(parent_list_ptr + b * stride_parent + pc, mask=in_range, other=-1).to(
        tl.int64
    )
    # First node (1..N-1) whose candidate id equals the parent candidate: bounded by N-1.
    match = (sel[None, :] == parent_cand[:, None]) & is_draft[None, :] & in_range[:, None]
    first = tl.min(tl.where(match, node[None, :], BLOCK_N), axis=1)  # [BLOCK_N]
    parent = tl.where(first < n, first, -1)
    parent = tl.where(is_draft & (pc == 0), 0, parent)  # a root child
    parent = tl.where(is_draft, parent, -1)  # the root and padding rows have no parent

    # First child = smallest child index; next sibling = next larger index with the same parent.
    child_of = parent[None, :] == node[:, None]  # [parent u, child i]
    first_child = tl.min(tl.where(child_of, node[None, :], BLOCK_N), axis=1)
    same_parent = (parent[:, None] == parent[None, :]) & (parent[:, None] >= 0)
    later = node[None, :] > node[:, None]
    next_sib = tl.min(tl.where(same_parent & later, node[None, :], BLOCK_N), axis=1)

    # Bounded ancestor walk of every row at once: at most S nodes per row.
    tree = node[None, :] + node[:, None] * 0 == 0  # [BLOCK_N, BLOCK_N]: column 0 (the root)
    cur = node
    active = is_draft
    depth = node * 0
    for _ in range(num_steps):
        tree = tree | ((cur[:, None] == node[None, :]) & active[:, None])
        depth += active.to(tl.int32)
        up = tl.sum(tl.where(cur[:, None] == node[None, :], parent[None, :], 0), axis=1)
        active = active & (up > 0)
        cur = tl.where(active, up, cur)

    seq = tl.load(seq_lens_ptr + b).to(tl.int64)
    row = b * n + node
    tl.store(positions_ptr + row, seq + depth, mask=valid)
    tl.store(retrive_index_ptr + row, row, mask=valid)
    tl.store(next_token_ptr + row, tl.where(first_child < n, first_child, -1), mask=valid)
    tl.store(next_sibling_ptr + row, tl.where(next_sib < n, next_sib, -1), mask=valid)

    cell = valid[:, None] & valid[None, :]
    offs = (b * n + node[:, None]) * n + node[None, :]
    tl.store(mask_ptr + offs, tree, mask=cell)


def build_tree(
    parent_list: torch.Tensor,  # [bs, K*(S-1)+1] ([bs, 0] allowed when S == 1)
    top_scores_index: torch.Tensor,  # [bs, N-1]
    seq_lens: torch.Tensor,  # [bs]
    topk: int,
    num_steps: int,
    num_draft_tokens: int,
    tree_mask_mode: TreeMaskMode,
    tree_mask: torch.Tensor,  # out: [bs, N, N] bool
    positions: torch.Tensor,  # out: [bs*N]
    retrive_index: torch.Tensor,  # out: [bs, N]
    retrive_next_token: torch.Tensor,  # out: [bs, N]
    retrive_next_sibling: torch.Tensor,  # out: [bs, N]
    pdl: bool = False,
) -> None:
    """Triton ``build_tree``; see :func:`polyspec.kernels.reference.build_tree`. ``pdl``: launch
    with programmatic dependent launch (:mod:`.pdl`)."""
    check_build_tree_args(
        parent_list, top_scores_index, seq_lens, topk, num_steps, num_draft_tokens,
        tree_mask_mode, tree_mask, positions, retrive_index, retrive_next_token,
        retrive_next_sibling,
    )  # fmt: skip
    bs, n = seq_lens.shape[0], num_draft_tokens
    if bs == 0:
        return
    parent = parent_list if parent_list.shape[1] > 0 else seq_lens.reshape(bs, 1)  # never read
    selected = top_scores_index if n > 1 else seq_lens.reshape(bs, 1)  # never read when N == 1
    outs = [writable(t) for t in (tree_mask, positions, retrive_index)]
    outs += [writable(t) for t in (retrive_next_token, retrive_next_sibling)]
    _build_tree_kernel[(bs,)](
        parent,
        selected,
        seq_lens,
        outs[0][0],
        outs[1][0],
        outs[2][0],
        outs[3][0],
        outs[4][0],
        topk,
        num_steps,
        n,
        parent_list.shape[1],
        parent.stride(0),
        selected.stride(0),
        BLOCK_N=next_pow2(n),
        num_warps=1 if n <= 32 else 4,
        PDL=pdl,
        **launch_options(pdl),
    )
    for _, finish in outs:
        finish()


# ------------------------------------------------------------------------------ verification


@triton.jit
def _link(links_ptr, at, n):
    """``links[at]`` as an int32 node index, -1 when outside [0, n) (end of list)."""
    val = tl.load(links_ptr + at)
    return tl.where((val >= 0) & (val < n), val, -1).to(tl.int32)


@triton.jit
def _verify_greedy_kernel(
    cand_ptr,  # [bs, N]
    ridx_ptr,  # [bs, N]
    next_token_ptr,  # [bs, N]
    next_sibling_ptr,  # [bs, N]
    target_ptr,  # [bs, N]
    predicts_ptr,  # [bs*N]
    accept_index_ptr,  # [bs, S+1]
    accept_length_ptr,  # [bs]
    n,
    steps,
    stride_cand,
    stride_ridx,
    stride_nt,
    stride_ns,
    stride_target,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    b = tl.program_id(0)
    cand_row = cand_ptr + b * stride_cand
    ridx_row = ridx_ptr + b * stride_ridx
    nt_row = next_token_ptr + b * stride_nt
    ns_row = next_sibling_ptr + b * stride_ns
    target_row = target_ptr + b * stride_target
    node = tl.arange(0, BLOCK_N)
    depth_ids = tl.arange(0, BLOCK_S)

    accept = tl.where(depth_ids == 0, tl.load(ridx_row), -1)  # [BLOCK_S]
    on_path = node == 0
    cur = b * 0
    depth = b * 0
    hops = b * 0  # children rejected at the current depth
    want = tl.load(target_row)
    child = _link(nt_row, 0, n)
    go = (child >= 0) & (steps > 0) & (n > 1)
    while go:
        hit = tl.load(cand_row + child) == want
        depth = tl.where(hit, depth + 1, depth)
        cur = tl.where(hit, child, cur)
        accept = tl.where(hit & (depth_ids == depth), tl.load(ridx_row + child), accept)
        on_path = on_path | (hit & (node == child))
        want = tl.where(hit, tl.load(target_row + child), want)
        child = tl.where(hit, _link(nt_row, child, n), _link(ns_row, child, n))
        hops = tl.where(hit, 0, hops + 1)
        go = (child >= 0) & (depth < steps) & (hops < n - 1)

    valid = node < n
    target = tl.load(target_row + node, mask=valid, other=0)
    gidx = tl.load(ridx_row + node, mask=valid, other=0)
    tl.store(predicts_ptr + gidx, tl.where(on_path, target, 0), mask=valid)
    tl.store(accept_index_ptr + b * (steps + 1) + depth_ids, accept, mask=depth_ids <= steps)
    tl.store(accept_length_ptr + b, depth)


def _check_verify(
    candidates: torch.Tensor,
    others: dict[str, torch.Tensor],
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_length: torch.Tensor,
) -> tuple[int, int, int]:
    """The reference's checks plus the kernels' own need: rows contiguous in their last dim."""
    for name, x in {"candidates": candidates, **others}.items():
        check(x.dim() < 1 or x.stride(-1) == 1, f"{name} must be contiguous in its last dimension")
    return check_verify_args(candidates, others, predicts, accept_index, accept_length)


def verify_tree_greedy(
    candidates: torch.Tensor,  # [bs, N]
    retrive_index: torch.Tensor,  # [bs, N]
    retrive_next_token: torch.Tensor,  # [bs, N]
    retrive_next_sibling: torch.Tensor,  # [bs, N]
    target_predict: torch.Tensor,  # [bs, N]
    predicts: torch.Tensor,  # out: [bs*N]
    accept_index: torch.Tensor,  # out: [bs, S+1]
    accept_length: torch.Tensor,  # out: [bs]
    pdl: bool = False,
) -> None:
    """Triton ``verify_tree_greedy``; see :func:`polyspec.kernels.reference.verify_tree_greedy`.
    ``pdl``: launch with programmatic dependent launch (:mod:`.pdl`)."""
    bs, n, steps = _check_verify(
        candidates,
        {
            "retrive_index": retrive_index,
            "retrive_next_token": retrive_next_token,
            "retrive_next_sibling": retrive_next_sibling,
            "target_predict": target_predict,
        },
        predicts,
        accept_index,
        accept_length,
    )
    if bs == 0:
        return
    outs = [writable(t) for t in (predicts, accept_index, accept_length)]
    _verify_greedy_kernel[(bs,)](
        candidates,
        retrive_index,
        retrive_next_token,
        retrive_next_sibling,
        target_predict,
        outs[0][0],
        outs[1][0],
        outs[2][0],
        n,
        steps,
        candidates.stride(0),
        retrive_index.stride(0),
        retrive_next_token.stride(0),
        retrive_next_sibling.stride(0),
        target_predict.stride(0),
        BLOCK_N=next_pow2(n),
        BLOCK_S=next_pow2(steps + 1),
        num_warps=1,
        PDL=pdl,
        **launch_options(pdl),
    )
    for _, finish in outs:
        finish()


@triton.jit
def _and_flag(mask, flag):
    """``mask & flag`` for a vector ``mask`` and a scalar ``flag``, broadcast explicitly (the
    interpreter mis-types the implicit scalar broadcast of a boolean)."""
    return mask & ((mask.to(tl.int32) * 0 + flag.to(tl.int32)) != 0)


@triton.jit
def _inverse_cdf(base_row, scratch_row, use_scratch, vocab, coin, BLOCK_V: tl.constexpr):
    """Inverse-CDF draw from the row at ``scratch_row`` (``use_scratch``) or ``base_row``: the
    count of cumulative sums <= ``coin * total``, clamped to the last positive entry."""
    lanes = tl.arange(0, BLOCK_V)
    total = 0.0
    for v0 in range(0, vocab, BLOCK_V):
        offs = v0 + lanes
        m = offs < vocab
        p = tl.load(base_row + offs, mask=_and_flag(m, use_scratch == 0), other=0.0).to(tl.float32)
        p += tl.load(scratch_row + offs, mask=_and_flag(m, use_scratch != 0), other=0.0)
        total += tl.sum(p, axis=0)
    threshold = coin * total
    carry = 0.0
    count = use_scratch * 0
    last_positive = use_scratch * 0
    for v0 in range(0, vocab, BLOCK_V):
        offs = v0 + lanes
        m = offs < vocab
        p = tl.load(base_row + offs, mask=_and_flag(m, use_scratch == 0), other=0.0).to(tl.float32)
        p += tl.load(scratch_row + offs, mask=_and_flag(m, use_scratch != 0), other=0.0)
        cdf = tl.cumsum(p, axis=0) + carry
        count += tl.sum(((cdf <= threshold) & m).to(tl.int32), axis=0)
        last_positive = tl.maximum(last_positive, tl.max(tl.where((p > 0) & m, offs, 0), axis=0))
        carry += tl.sum(p, axis=0)
    return tl.minimum(count, last_positive)


@triton.jit
def _verify_sampling_kernel(
    cand_ptr,  # [bs, N]
    ridx_ptr,  # [bs, N]
    next_token_ptr,  # [bs, N]
    next_sibling_ptr,  # [bs, N]
    target_probs_ptr,  # [bs, N, V]
    draft_probs_ptr,  # [bs, N, V] (target_probs when HAS_DRAFT is False: never read)
    coins_ptr,  # [bs, N]
    final_coins_ptr,  # [bs]
    scratch_ptr,  # [bs, V] fp32 residual
    predicts_ptr,  # [bs*N]
    accept_index_ptr,  # [bs, S+1]
    accept_length_ptr,  # [bs]
    n,
    vocab,
    steps,
    stride_cand,
    stride_ridx,
    stride_nt,
    stride_ns,
    stride_tp_b,
    stride_tp_n,
    stride_dp_b,
    stride_dp_n,
    stride_coins,
    HAS_DRAFT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    b = tl.program_id(0)
    cand_row = cand_ptr + b * stride_cand
    ridx_row = ridx_ptr + b * stride_ridx
    nt_row = next_token_ptr + b * stride_nt
    ns_row = next_sibling_ptr + b * stride_ns
    coin_row = coins_ptr + b * stride_coins
    scratch_row = scratch_ptr + b.to(tl.int64) * vocab
    node = tl.arange(0, BLOCK_N)
    depth_ids = tl.arange(0, BLOCK_S)
    lanes = tl.arange(0, BLOCK_V)
    final_coin = tl.load(final_coins_ptr + b).to(tl.float32)

    accept = tl.where(depth_ids == 0, tl.load(ridx_row), -1)  # [BLOCK_S]
    emitted = (node * 0).to(tl.int64)  # predicts by local node
    cur = b * 0
    depth = b * 0
    alive = b >= 0
    while alive & (depth < steps):
        base_row = target_probs_ptr + b.to(tl.int64) * stride_tp_b + cur * stride_tp_n
        draft_row = draft_probs_ptr + b.to(tl.int64) * stride_dp_b + cur * stride_dp_n
        child = _link(nt_row, cur, n)
        accepted = b * 0 - 1
        hops = b * 0
        fresh = b >= 0  # the residual is still target_probs[b, cur] (scratch not written yet)
        looking = (child >= 0) & (n > 1)
        while looking:
            x = tl.load(cand_row + child).to(tl.int64)
            x = tl.minimum(tl.maximum(x, 0), vocab - 1)
            r_x = 0.0
            q_x = 0.0
            total = 0.0
            for v0 in range(0, vocab, BLOCK_V):
                offs = v0 + lanes
                m = offs < vocab
                r = tl.load(base_row + offs, mask=_and_flag(m, fresh), other=0.0).to(tl.float32)
                r += tl.load(scratch_row + offs, mask=_and_flag(m, fresh == 0), other=0.0)
                if HAS_DRAFT:
                    q = tl.load(draft_row + offs, mask=m, other=0.0).to(tl.float32)
                else:
                    q = tl.where(offs == x, 1.0, 0.0)
                r_x += tl.sum(tl.where(offs == x, r, 0.0), axis=0)
                q_x += tl.sum(tl.where(offs == x, q, 0.0), axis=0)
                total += tl.sum(tl.maximum(r - q, 0.0), axis=0)
            ratio = tl.where(q_x > 0, r_x / tl.where(q_x > 0, q_x, 1.0), 1.0)
            accept_p = tl.where(r_x > 0, tl.minimum(ratio, 1.0), 0.0)
            hit = tl.load(coin_row + child).to(tl.float32) < accept_p
            if hit:
                accepted = child
            else:
                # Residual update: max(r - q, 0) renormalised (target_probs[b, cur] if empty).
                for v0 in range(0, vocab, BLOCK_V):
                    offs = v0 + lanes
                    m = offs < vocab
                    base = tl.load(base_row + offs, mask=m, other=0.0).to(tl.float32)
                    r = tl.where(fresh, base, tl.load(scratch_row + offs, mask=m, other=0.0))
                    if HAS_DRAFT:
                        q = tl.load(draft_row + offs, mask=m, other=0.0).to(tl.float32)
                    else:
                        q = tl.where(offs == x, 1.0, 0.0)
                    safe_total = tl.where(total > 0, total, 1.0)
                    new = tl.where(total > 0, tl.maximum(r - q, 0.0) / safe_total, base)
                    tl.store(scratch_row + offs, new, mask=m)
                fresh = b < 0
                child = _link(ns_row, child, n)
                hops += 1
            looking = (accepted < 0) & (child >= 0) & (hops < n - 1)
        took = accepted >= 0
        if took:
            token = tl.load(cand_row + accepted).to(tl.int64)
        else:
            use_scratch = (fresh == 0).to(tl.int32)
            token = _inverse_cdf(base_row, scratch_row, use_scratch, vocab, final_coin, BLOCK_V).to(
                tl.int64
            )
        emitted = tl.where(node == cur, token, emitted)
        if took:
            cur = accepted
            depth += 1
            accept = tl.where(depth_ids == depth, tl.load(ridx_row + accepted), accept)
        alive = took
    if alive:
        # Reached depth S: the bonus token comes from the target after the last node.
        base_row = target_probs_ptr + b.to(tl.int64) * stride_tp_b + cur * stride_tp_n
        bonus = _inverse_cdf(base_row, scratch_row, b * 0, vocab, final_coin, BLOCK_V)
        emitted = tl.where(node == cur, bonus.to(tl.int64), emitted)

    valid = node < n
    gidx = tl.load(ridx_row + node, mask=valid, other=0)
    tl.store(predicts_ptr + gidx, emitted, mask=valid)
    tl.store(accept_index_ptr + b * (steps + 1) + depth_ids, accept, mask=depth_ids <= steps)
    tl.store(accept_length_ptr + b, depth)


def verify_tree_sampling(
    candidates: torch.Tensor,  # [bs, N]
    retrive_index: torch.Tensor,  # [bs, N]
    retrive_next_token: torch.Tensor,  # [bs, N]
    retrive_next_sibling: torch.Tensor,  # [bs, N]
    target_probs: torch.Tensor,  # [bs, N, V] fp32
    draft_probs: torch.Tensor | None,  # [bs, N, V] or None
    coins: torch.Tensor,  # [bs, N] uniform [0, 1)
    final_coins: torch.Tensor,  # [bs] uniform [0, 1)
    predicts: torch.Tensor,  # out: [bs*N]
    accept_index: torch.Tensor,  # out: [bs, S+1]
    accept_length: torch.Tensor,  # out: [bs]
    pdl: bool = False,
) -> None:
    """Triton ``verify_tree_sampling``; see
    :func:`polyspec.kernels.reference.verify_tree_sampling`. The running residual of each request
    lives in a ``[bs, V]`` fp32 scratch tensor, so any vocabulary size works. ``pdl``: launch with
    programmatic dependent launch (:mod:`.pdl`)."""
    bs, n, steps = _check_verify(
        candidates,
        {
            "retrive_index": retrive_index,
            "retrive_next_token": retrive_next_token,
            "retrive_next_sibling": retrive_next_sibling,
            "target_probs": target_probs,
            "coins": coins,
        },
        predicts,
        accept_index,
        accept_length,
    )
    check_sampling_probs(target_probs, draft_probs)
    check(
        draft_probs is None or draft_probs.stride(-1) == 1,
        "draft_probs must be contiguous in its last dimension",
    )
    check(final_coins.numel() == bs, f"final_coins must be [bs={bs}]")
    if bs == 0:
        return
    vocab = target_probs.shape[2]
    scratch = torch.empty(bs, vocab, dtype=torch.float32, device=target_probs.device)
    draft = draft_probs if draft_probs is not None else target_probs
    outs = [writable(t) for t in (predicts, accept_index, accept_length)]
    _verify_sampling_kernel[(bs,)](
        candidates,
        retrive_index,
        retrive_next_token,
        retrive_next_sibling,
        target_probs,
        draft,
        coins,
        final_coins.reshape(bs),
        scratch,
        outs[0][0],
        outs[1][0],
        outs[2][0],
        n,
        vocab,
        steps,
        candidates.stride(0),
        retrive_index.stride(0),
        retrive_next_token.stride(0),
        retrive_next_sibling.stride(0),
        target_probs.stride(0),
        target_probs.stride(1),
        draft.stride(0),
        draft.stride(1),
        coins.stride(0),
        HAS_DRAFT=draft_probs is not None,
        BLOCK_N=next_pow2(n),
        BLOCK_S=next_pow2(steps + 1),
        BLOCK_V=min(next_pow2(vocab), 1024),
        num_warps=4,
        PDL=pdl,
        **launch_options(pdl),
    )
    for _, finish in outs:
        finish()
