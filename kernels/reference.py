"""The PyTorch reference of every kernel in :class:`polyspec.backend.KernelSet` (the oracle).

Plain PyTorch, device-agnostic: every function works on whatever device its inputs are on and
avoids host synchronisation (the tree kernels loop in Python over depths and sibling hops, never
over requests, and never read tensor values on the host). Index tensors may be int64 or int32;
results are written in the dtype of the ``out`` tensors given. Kernels with ``out`` arguments
write every entry of them.

Notation: ``bs`` requests, ``K`` topk, ``S`` num_steps, ``N`` num_draft_tokens (root included),
``T`` tokens, ``H`` hidden size, ``Hq`` / ``Hkv`` heads, ``D`` head dim, ``V`` vocabulary,
``R`` / ``C`` rows / columns of ``req_to_token``.

The draft-tree kernels live in :mod:`polyspec.kernels._tree` and are re-exported here.
:func:`reference_kernels` is the complete :class:`~polyspec.backend.KernelSet` of these
functions, the set every backend starts from.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from polyspec.backend import KernelSet, TreeMaskMode, draft_lane_width
from polyspec.kernels._tree import (
    build_tree,
    inverse_cdf,
    organize_draft_results,
    select_top_k,
    verify_tree_greedy,
    verify_tree_sampling,
)

__all__ = [
    "reference_kernels",
    "TreeMaskMode",
    "select_top_k",
    "organize_draft_results",
    "build_tree",
    "verify_tree_greedy",
    "verify_tree_sampling",
    "inverse_cdf",
    "assign_draft_cache_locs",
    "assign_req_to_token",
    "assign_extend_cache_locs",
    "assign_block_cache_locs",
    "assign_accept_locs",
    "rms_norm",
    "fused_add_rms_norm",
    "draft_layer_input",
    "rotary_embedding",
    "silu_and_mul",
    "softmax_topk",
    "top_k_top_p_renorm",
    "sample",
    "argmax",
    "apply_token_bitmask",
]


def reference_kernels() -> KernelSet:
    """Every :class:`~polyspec.backend.KernelSet` entry from this module."""
    module = globals()
    return KernelSet(**{name: module[name] for name in KernelSet.names()})


def _check(condition: bool, message: str) -> None:
    """Raise ValueError with ``message`` unless ``condition`` (shape checks only)."""
    if not condition:
        raise ValueError(message)


# --------------------------------------------------------------------------- slot bookkeeping


def check_draft_cache_locs_args(
    seq_lens: torch.Tensor,  # [bs]
    alloc_slots: torch.Tensor,  # [bs*K*W]
    topk: int,
    num_steps: int,
    page_size: int,
    lane_locs: torch.Tensor,  # [bs, K, W]
    copy_src: torch.Tensor,  # [bs*K*(page_size-1)]
    copy_dst: torch.Tensor,  # [bs*K*(page_size-1)]
) -> tuple[int, int]:
    """The argument checks of ``assign_draft_cache_locs`` shared by every implementation
    (shapes only, no host sync); returns (bs, W)."""
    bs = seq_lens.shape[0]
    _check(page_size >= 1 and topk >= 1 and num_steps >= 1, "page_size, topk, num_steps >= 1")
    width = draft_lane_width(num_steps, page_size)
    _check(
        alloc_slots.numel() == bs * topk * width,
        f"alloc_slots must hold bs*K*W = {bs}*{topk}*{width} slots (W for num_steps={num_steps}, "
        f"page_size={page_size}), got {alloc_slots.numel()}",
    )
    _check(
        tuple(lane_locs.shape) == (bs, topk, width), f"lane_locs must be [{bs}, {topk}, {width}]"
    )
    copies = bs * topk * (page_size - 1)
    _check(
        copy_src.numel() == copies and copy_dst.numel() == copies,
        f"copy_src / copy_dst must have bs*K*(page_size-1) = {copies} entries",
    )
    return bs, width


def assign_draft_cache_locs(
    req_pool_indices: torch.Tensor,  # [bs] rows of req_to_token
    req_to_token: torch.Tensor,  # [R, C]
    seq_lens: torch.Tensor,  # [bs] committed prefix lengths
    alloc_slots: torch.Tensor,  # [bs*K*W] freshly allocated slots, request- then lane-major
    topk: int,
    num_steps: int,
    page_size: int,
    lane_locs: torch.Tensor,  # out: [bs, K, W]
    tail_lens: torch.Tensor,  # out: [bs]
    copy_src: torch.Tensor,  # out: [bs*K*(page_size-1)]
    copy_dst: torch.Tensor,  # out: [bs*K*(page_size-1)]
) -> None:
    """Lay out the draft KV slots of each lane and the prefix-tail copies paging needs.

    ``W = S`` when ``page_size == 1``, else ``page_size * ceil((page_size - 1 + S) / page_size)``.
    ``lane_locs = alloc_slots.view(bs, K, W)`` (with pages, W/page_size whole pages per lane).
    ``page_size == 1``: ``tail_lens = 0``, the copy arrays are empty. ``page_size > 1``:
    ``tail = seq_lens[b] % page_size`` (the prefix's last partial page); every lane l starts with
    a private copy of it: for ``j < tail``, ``copy_src[(b*K + l)*(page_size-1) + j] =
    req_to_token[req_pool_indices[b], seq_lens[b] - tail + j]`` and ``copy_dst[...] =
    lane_locs[b, l, j]``; entries ``j >= tail`` are 0 in both (slot 0 -> slot 0, a no-op on the
    reserved padding slot). ``tail_lens[b] = tail``. Draft step i of lane l writes
    ``lane_locs[b, l, tail + i]``.
    """
    bs, width = check_draft_cache_locs_args(
        seq_lens, alloc_slots, topk, num_steps, page_size, lane_locs, copy_src, copy_dst
    )
    lanes = alloc_slots.view(bs, topk, width)
    lane_locs.copy_(lanes)
    if page_size == 1:
        tail_lens.zero_()
        return
    seq = seq_lens.long()
    tail = seq % page_size  # [bs]
    tail_lens.copy_(tail.view(tail_lens.shape))
    j = torch.arange(page_size - 1, device=seq.device)  # [page_size-1]
    real = j.unsqueeze(0) < tail.unsqueeze(1)  # [bs, page_size-1]
    cols = (seq - tail).unsqueeze(1) + j  # [bs, page_size-1]
    cols = torch.where(real, cols, 0).clamp(0, req_to_token.shape[1] - 1)
    rows = req_pool_indices.long().unsqueeze(1).expand_as(cols)
    src = torch.where(real, req_to_token[rows, cols].long(), 0)  # [bs, page_size-1]
    dst = torch.where(real.unsqueeze(1), lanes[:, :, : page_size - 1].long(), 0)
    copy_src.copy_(src.unsqueeze(1).expand(bs, topk, page_size - 1).flatten())
    copy_dst.copy_(dst.flatten())


def _segments(
    start: torch.Tensor,  # [bs]
    end: torch.Tensor,  # [bs]
    total: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # owner [total], column [total]
    """For the concatenation of ranges ``start[b]:end[b]``: each element's request and column."""
    lens = (end.long() - start.long()).clamp(min=0)
    owner = torch.repeat_interleave(
        torch.arange(lens.shape[0], device=lens.device), lens, output_size=total
    )
    offsets = torch.cumsum(lens, 0) - lens
    col = start.long()[owner] + torch.arange(total, device=lens.device) - offsets[owner]
    return owner, col


def assign_req_to_token(
    req_pool_indices: torch.Tensor,  # [bs]
    req_to_token: torch.Tensor,  # [R, C] in/out
    start: torch.Tensor,  # [bs]
    end: torch.Tensor,  # [bs]
    slots: torch.Tensor,  # [sum(end - start)]
) -> None:
    """``req_to_token[req_pool_indices[b], start[b]:end[b]]`` = the b-th segment of ``slots``
    (segments concatenated in request order; ``slots`` must hold exactly sum(end - start))."""
    owner, col = _segments(start, end, slots.numel())
    rows = req_pool_indices.long()[owner]
    req_to_token[rows, col] = slots.to(req_to_token.dtype)


def assign_extend_cache_locs(
    req_pool_indices: torch.Tensor,  # [bs]
    req_to_token: torch.Tensor,  # [R, C]
    start: torch.Tensor,  # [bs]
    end: torch.Tensor,  # [bs]
    out: torch.Tensor,  # out: [sum(end - start)]
) -> None:
    """``out`` segment b = ``req_to_token[req_pool_indices[b], start[b]:end[b]]`` (segments
    concatenated in request order)."""
    owner, col = _segments(start, end, out.numel())
    rows = req_pool_indices.long()[owner]
    out.copy_(req_to_token[rows, col])


def check_block_cache_locs_args(
    req_pool_indices: torch.Tensor,  # [bs]
    start: torch.Tensor,  # [bs]
    lens: torch.Tensor,  # [bs]
    width: int,
    out_loc: torch.Tensor,  # [bs * width]
    positions: torch.Tensor,  # [bs * width]
) -> None:
    """The argument checks of ``assign_block_cache_locs`` shared by every implementation
    (shapes only, no host sync)."""
    bs = req_pool_indices.shape[0]
    _check(
        start.shape[0] == bs and lens.shape[0] == bs,
        f"start / lens must be [bs={bs}], got {tuple(start.shape)} and {tuple(lens.shape)}",
    )
    for name, out in (("out_loc", out_loc), ("positions", positions)):
        _check(
            out.numel() == bs * width,
            f"{name} must have bs * width = {bs * width} entries, got {out.numel()}",
        )


def assign_block_cache_locs(
    req_pool_indices: torch.Tensor,  # [bs]
    req_to_token: torch.Tensor,  # [R, C]
    start: torch.Tensor,  # [bs]
    lens: torch.Tensor,  # [bs]
    width: int,
    out_loc: torch.Tensor,  # out: [bs * width], req_to_token's dtype
    positions: torch.Tensor,  # out: [bs * width] int64
) -> None:
    """A fixed-width block of ``width`` tokens per request from ``start`` (a captured forward's
    layout): ``positions[b * width + j] = min(start[b] + j, C - 1)`` and ``out_loc[b * width +
    j] = req_to_token[req_pool_indices[b], positions[b * width + j]]`` for ``j < lens[b]``, the
    padding slot 0 past it."""
    check_block_cache_locs_args(req_pool_indices, start, lens, width, out_loc, positions)
    j = torch.arange(width, device=start.device)
    pos = (start.long()[:, None] + j).clamp_(max=req_to_token.shape[1] - 1)  # [bs, width]
    slots = req_to_token[req_pool_indices.long()[:, None], pos]
    slots.masked_fill_(j >= lens.long()[:, None], 0)
    out_loc.copy_(slots.view(out_loc.shape))
    positions.copy_(pos.view(positions.shape))


def check_accept_locs_args(
    req_pool_indices: torch.Tensor,  # [bs]
    accept_index: torch.Tensor,  # [bs, S+1]
    outs: tuple[torch.Tensor, ...],  # src_loc, dst_loc, positions, path_node [bs*(S+1)];
    # extend_lens, last_index [bs]
) -> tuple[int, int]:
    """The argument checks of ``assign_accept_locs`` shared by every implementation (shapes
    only, no host sync); returns (bs, S + 1)."""
    _check(accept_index.dim() == 2, "accept_index must be [bs, S+1]")
    bs, depth = accept_index.shape
    _check(req_pool_indices.shape[0] == bs, "req_pool_indices and accept_index disagree on bs")
    names = ("src_loc", "dst_loc", "positions", "path_node", "extend_lens", "last_index")
    sizes = (bs * depth,) * 4 + (bs,) * 2
    for name, out, size in zip(names, outs, sizes):
        _check(out.numel() == size, f"{name} must have {size} entries, got {out.numel()}")
    return bs, depth


def assign_accept_locs(
    req_pool_indices: torch.Tensor,  # [bs] rows of req_to_token
    req_to_token: torch.Tensor,  # [R, C]
    seq_lens: torch.Tensor,  # [bs] committed lengths before the round
    widths: torch.Tensor,  # [bs] verify width N; 0 marks a padding request of a graph
    accept_index: torch.Tensor,  # [bs, S+1] global node ids b*N + j, -1 past the path
    accept_length: torch.Tensor,  # [bs] accepted draft tokens (the path has 1 + that nodes)
    num_draft_tokens: int,
    src_loc: torch.Tensor,  # out: [bs*(S+1)]
    dst_loc: torch.Tensor,  # out: [bs*(S+1)]
    positions: torch.Tensor,  # out: [bs*(S+1)]
    path_node: torch.Tensor,  # out: [bs*(S+1)]
    extend_lens: torch.Tensor,  # out: [bs]
    last_index: torch.Tensor,  # out: [bs]
) -> None:
    """The slot and index arithmetic between greedy or sampled acceptance and the draft extend:
    where the accepted path's target KV moves, and the draft extend's fixed-width batch.

    Verify wrote tree node j of request b at position ``seq_lens[b] + j``; the accepted node at
    depth d must end up at ``seq_lens[b] + d``. With ``row = req_pool_indices[b]``, ``s =
    seq_lens[b]``, ``a = accept_length[b]``, ``C`` the table's columns, for each depth
    ``d`` in ``0..S`` (entry ``e = b*(S+1) + d``), ``live = widths[b] > 0 and d <= a``:

    - ``src_loc[e] = req_to_token[row, clamp(s + accept_index[b, d] - b*N, 0, C-1)]`` and
      ``dst_loc[e] = req_to_token[row, min(s + d, C-1)]`` where live, else both 0 (slot 0 onto
      itself: the padding slot). Nodes already in place move onto themselves. ``dst_loc`` is
      also the draft extend's ``out_cache_loc``.
    - ``positions[e] = min(s + d, C-1)``: the draft extend's positions.
    - ``path_node[e] = accept_index[b, min(d, a)]``: the verify output row whose (feature,
      predicted token) pair the draft extend reads; past the path, the last node again.
    - ``extend_lens[b] = a + 1`` where ``widths[b] > 0``, else 0; ``last_index[b] = b*(S+1) +
      max(extend_lens[b] - 1, 0)``: the draft extend's row of each request's newest token.
    """
    bs, depth = check_accept_locs_args(
        req_pool_indices,
        accept_index,
        (src_loc, dst_loc, positions, path_node, extend_lens, last_index),
    )
    dev, last_col = accept_index.device, req_to_token.shape[1] - 1
    d = torch.arange(depth, device=dev)  # [S+1]
    b = torch.arange(bs, device=dev)  # [bs]
    length = accept_length.long()[:, None]  # [bs, 1]
    path = accept_index.long()  # [bs, S+1]
    active = widths.long()[:, None] > 0  # [bs, 1]
    live = (d[None, :] <= length) & active
    start = seq_lens.long()[:, None]
    rows = req_pool_indices.long()[:, None]
    node = path - (b * num_draft_tokens)[:, None]  # local node ids
    src = req_to_token[rows, (start + node).clamp(0, last_col)].long()
    pos = (start + d[None, :]).clamp(max=last_col)
    dst = req_to_token[rows, pos].long()
    src_loc.copy_(torch.where(live, src, 0).view(src_loc.shape))
    dst_loc.copy_(torch.where(live, dst, 0).view(dst_loc.shape))
    positions.copy_(pos.view(positions.shape))
    path_node.copy_(path.gather(1, torch.minimum(d[None, :], length)).view(path_node.shape))
    ext = torch.where(active[:, 0], accept_length.long() + 1, 0)
    extend_lens.copy_(ext.view(extend_lens.shape))
    last_index.copy_((b * depth + (ext - 1).clamp(min=0)).view(last_index.shape))


# ----------------------------------------------------------------------------- model kernels


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
) -> torch.Tensor:  # [T, H]
    """RMSNorm in the Hugging Face LlamaRMSNorm order: normalise in fp32, cast back to
    ``x.dtype``, then multiply by ``weight``."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, H], [T, H])
    """``(rms_norm(x + residual, weight, eps), x + residual)``; the sum is in ``x.dtype``.
    Inputs are left untouched."""
    total = x + residual
    return rms_norm(total, weight, eps), total


def check_draft_layer_input_args(
    input_ids: torch.Tensor,  # [T]
    embed_weight: torch.Tensor,  # [V, H]
    features: torch.Tensor,  # [T, H]
    embed_norm: torch.Tensor,  # [H]
    feature_norm: torch.Tensor,  # [H]
) -> None:
    """The argument checks of ``draft_layer_input`` shared by every implementation."""
    _check(
        input_ids.dim() == 1 and features.dim() == 2 and features.shape[0] == input_ids.shape[0],
        f"draft_layer_input needs input_ids [T] and features [T, H], got "
        f"{tuple(input_ids.shape)} and {tuple(features.shape)}",
    )
    hidden = features.shape[1]
    _check(
        embed_weight.dim() == 2 and embed_weight.shape[1] == hidden,
        f"draft_layer_input needs embed_weight [V, H={hidden}], got {tuple(embed_weight.shape)}",
    )
    _check(
        embed_weight.dtype == features.dtype,
        f"draft_layer_input needs embed_weight and features of one dtype, got "
        f"{embed_weight.dtype} and {features.dtype}",
    )
    for name, w in (("embed_norm", embed_norm), ("feature_norm", feature_norm)):
        _check(
            w.dim() == 1 and w.shape[0] == hidden,
            f"draft_layer_input needs {name} [H={hidden}], got {tuple(w.shape)}",
        )


def draft_layer_input(
    input_ids: torch.Tensor,  # [T] int
    embed_weight: torch.Tensor,  # [V, H]
    features: torch.Tensor,  # [T, H]
    embed_norm: torch.Tensor,  # [H]
    feature_norm: torch.Tensor,  # [H]
    eps: float,
) -> torch.Tensor:  # [T, 2H]
    """An EAGLE-3 head's decoder-layer input: ``rms_norm(embed_weight[input_ids],
    embed_norm)`` and ``rms_norm(features, feature_norm)`` side by side (each as
    :func:`rms_norm`; the embedding rows and the features share a dtype)."""
    check_draft_layer_input_args(input_ids, embed_weight, features, embed_norm, feature_norm)
    embeds = F.embedding(input_ids, embed_weight)
    return torch.cat(
        [rms_norm(embeds, embed_norm, eps), rms_norm(features, feature_norm, eps)], dim=-1
    )


def rotary_embedding(
    positions: torch.Tensor,  # [T]
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, D] fp32: D/2 cos columns then D/2 sin columns
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, Hq, D], [T, Hkv, D])
    """Rotary position embedding, computed in fp32 and cast back to q / k's dtypes.

    ``is_neox``: rotate halves (pair i with i + D/2; the Hugging Face Llama layout); otherwise
    rotate interleaved pairs (2i, 2i+1; GPT-J). New tensors are returned; inputs are untouched.
    """
    head_dim = q.shape[-1]
    _check(
        cos_sin_cache.shape[-1] == head_dim and k.shape[-1] == head_dim and head_dim % 2 == 0,
        f"cos_sin_cache must be [max_pos, D={head_dim}] (D even) and match q / k's head dim; "
        f"got cache {tuple(cos_sin_cache.shape)}, k {tuple(k.shape)}",
    )
    half = head_dim // 2
    cache = cos_sin_cache[positions.long()].float()  # [T, D]
    cos = cache[:, :half].unsqueeze(1)  # [T, 1, D/2]
    sin = cache[:, half:].unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if is_neox:
            x1, x2 = xf[..., :half], xf[..., half:]
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return out.flatten(-2).to(x.dtype)

    return rotate(q), rotate(k)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # x [T, 2I] -> [T, I]
    """``silu(x[:, :I]) * x[:, I:]`` computed in fp32, returned in ``x.dtype``."""
    _check(x.shape[-1] % 2 == 0, f"silu_and_mul needs an even last dim, got {x.shape[-1]}")
    inter = x.shape[-1] // 2
    xf = x.float()
    return (F.silu(xf[..., :inter]) * xf[..., inter:]).to(x.dtype)


def softmax_topk(
    logits: torch.Tensor,  # [n, V] any float dtype
    k: int,
    index_map: torch.Tensor | None = None,  # [V] int64
) -> tuple[torch.Tensor, torch.Tensor]:  # (topk_p [n, k] fp32, topk_index [n, k] int64)
    """The draft's top-k at each draft step: the ``k`` largest entries of
    ``softmax(logits.float())`` per row, in descending order, with their ids. Equal
    probabilities may come in either order. ``index_map``: the ids returned are
    ``index_map[id]`` (an EAGLE head's draft-vocabulary -> target-vocabulary map)."""
    _check(logits.dim() == 2, f"softmax_topk needs logits [n, V], got {tuple(logits.shape)}")
    _check(1 <= k <= logits.shape[1], f"softmax_topk needs 1 <= k <= V, got k={k}")
    check_index_map(index_map, logits.shape[1])
    p, idx = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return p, (idx if index_map is None else index_map[idx])


def check_index_map(index_map: torch.Tensor | None, vocab: int) -> None:
    """``softmax_topk``'s check of its ``index_map`` (every implementation's)."""
    _check(
        index_map is None or (index_map.dim() == 1 and index_map.shape[0] == vocab),
        f"softmax_topk needs index_map [V={vocab}], got "
        f"{None if index_map is None else tuple(index_map.shape)}",
    )


# -------------------------------------------------------------------------- sampling helpers


def top_k_top_p_renorm(
    probs: torch.Tensor,  # [bs, V] fp32
    top_k: torch.Tensor,  # [bs] int; <= 0 or >= V: off
    top_p: torch.Tensor,  # [bs] fp32; >= 1: off
) -> torch.Tensor:  # [bs, V] fp32
    """Top-k then top-p filtering, renormalised, without host syncs.

    Tokens are ranked by probability (ties: lower token id first). Keep the ``top_k[b]`` best;
    then, measured against the mass kept by top-k, keep the smallest prefix of the ranking whose
    mass reaches ``top_p[b]``: rank i stays when the kept mass before it is ``< top_p * kept``
    (so the token crossing the threshold stays, and rank 0 always stays). Everything else is 0;
    the result is divided by its sum (rows whose kept mass is 0 stay 0).
    """
    bs, vocab = probs.shape
    sorted_p, order = probs.float().sort(dim=1, descending=True, stable=True)  # [bs, V]
    rank = torch.arange(vocab, device=probs.device).unsqueeze(0)
    k = top_k.long().unsqueeze(1)
    k = torch.where((k <= 0) | (k >= vocab), vocab, k)
    kept = torch.where(rank < k, sorted_p, 0.0)
    kept_mass = kept.sum(dim=1, keepdim=True)
    before = kept.cumsum(dim=1) - kept
    p = top_p.float().unsqueeze(1)
    in_p = (p >= 1.0) | (before < p * kept_mass) | (rank == 0)
    kept = torch.where(in_p, kept, 0.0)
    total = kept.sum(dim=1, keepdim=True)
    kept = torch.where(total > 0, kept / torch.where(total > 0, total, 1.0), 0.0)
    return torch.zeros_like(kept).scatter_(1, order, kept)


def sample(
    probs: torch.Tensor,  # [bs, V] fp32
    exp_noise: torch.Tensor,  # [bs, V] Exp(1) draws, > 0
) -> torch.Tensor:  # [bs] int64
    """``argmax(probs / exp_noise)`` (first index on ties): an exact draw from ``probs`` when
    ``exp_noise`` holds independent Exp(1) variables, with no host sync."""
    return (probs.float() / exp_noise.float()).argmax(dim=1)


def argmax(logits: torch.Tensor) -> torch.Tensor:  # [n, V] float -> [n] int64
    """Greedy tokens: the first index of each row's maximum (``torch.max`` over a dim returns
    the first maximal index, as ``argmax`` does; ``max(...).indices`` because its CPU kernel is
    about 3x faster over a 49k vocabulary on 2 threads: one row 25 against 70 us, a verify's 8
    rows 90 against 280-350 us)."""
    _check(logits.dim() == 2, f"argmax needs logits [n, V], got {tuple(logits.shape)}")
    return logits.max(dim=-1).indices


def apply_token_bitmask(
    logits: torch.Tensor,  # [n, V] any float dtype, written in place
    bitmask: torch.Tensor,  # [n, W] int32: bit t % 32 of word t // 32 set = token t allowed
) -> None:
    """Structured output: set every logit whose token the row's bitmask does not allow to
    ``-inf``, in place (the tokens past ``32 * W`` are not allowed). A row of all ones (-1
    words) is left as it is, so unconstrained rows of a mixed batch pass through."""
    _check(
        logits.dim() == 2 and bitmask.dim() == 2 and bitmask.shape[0] == logits.shape[0],
        f"apply_token_bitmask needs logits [n, V] and bitmask [n, W], got "
        f"{tuple(logits.shape)} and {tuple(bitmask.shape)}",
    )
    _check(bitmask.dtype == torch.int32, f"the bitmask must be int32, got {bitmask.dtype}")
    n, vocab = logits.shape
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(2) >> shifts) & 1  # [n, W, 32]
    allowed = bits.view(n, -1)[:, :vocab].bool()
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    logits.masked_fill_(~allowed, float("-inf"))
