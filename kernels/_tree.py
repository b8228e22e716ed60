"""Reference draft-tree kernels: top-K expansion, tree construction and tree verification.

Re-exported by :mod:`polyspec.kernels.reference`, which is the documented entry point. The tree
kernels are written batch-parallel: the Python loops run over depths (at most ``S``) and sibling
hops (at most ``N - 1``), never over requests, and never read a tensor value on the host. So the
oracle is also usable on an accelerator and on large fuzzed batches.

Notation: ``bs`` requests, ``K`` topk, ``S`` num_steps, ``N`` num_draft_tokens (root included),
``F`` hidden size, ``V`` vocabulary size.
"""

from __future__ import annotations

import torch

from polyspec.backend import TreeMaskMode

TreeLevel = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""One level of the draft tree: (tree_scores, tree_tokens, tree_parents)."""


def _check(condition: bool, message: str) -> None:
    """Raise ValueError with ``message`` unless ``condition`` (shape checks only: no host sync)."""
    if not condition:
        raise ValueError(message)


def check_select_inputs(
    step: int,
    topk_p: torch.Tensor,
    topk_index: torch.Tensor,
    hidden: torch.Tensor,
    scores: torch.Tensor | None,
    topk: int,
) -> int:
    """``select_top_k``'s argument checks (shared with the Triton version); returns ``bs``."""
    _check(topk >= 1, f"topk must be >= 1, got {topk}")
    _check(step >= 0, f"step must be >= 0, got {step}")
    if step == 0:
        _check(
            topk_p.dim() == 2 and topk_p.shape[1] == topk and topk_index.shape == topk_p.shape,
            f"step 0 needs topk_p and topk_index of shape [bs, topk={topk}], got "
            f"{tuple(topk_p.shape)} and {tuple(topk_index.shape)}",
        )
        bs = topk_p.shape[0]
        _check(
            hidden.shape[0] == bs,
            f"step 0 needs hidden [bs={bs}, F], got {tuple(hidden.shape)}",
        )
        return bs
    _check(scores is not None, "select_top_k needs the lanes' scores [bs, K] at step >= 1")
    assert scores is not None
    bs = scores.shape[0]
    _check(
        scores.shape == (bs, topk)
        and topk_p.shape == (bs * topk, topk)
        and topk_index.shape == (bs * topk, topk)
        and hidden.shape[0] == bs * topk,
        f"step {step} needs scores [bs, K], topk_p / topk_index [bs*K, K], hidden [bs*K, F] "
        f"with K={topk}; got {tuple(scores.shape)}, {tuple(topk_p.shape)}, "
        f"{tuple(topk_index.shape)}, {tuple(hidden.shape)}",
    )
    return bs


def select_top_k(
    step: int,
    topk_p: torch.Tensor,  # [bs, K] at step 0, [bs*K, K] after
    topk_index: torch.Tensor,  # [bs, K] at step 0, [bs*K, K] after
    hidden: torch.Tensor,  # [bs, F] at step 0, [bs*K, F] after
    scores: torch.Tensor | None,  # [bs, K] cumulative path probability per lane; None at step 0
    topk: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, TreeLevel]:
    """One level of EAGLE top-K tree expansion (SGLang ``select_top_k_tokens`` semantics).

    Step 0 (the root's K children, from the last draft extend):
      ``input_ids = topk_index.flatten()`` [bs*K]; ``hidden = hidden.repeat_interleave(K, 0)``
      [bs*K, F]; ``scores = topk_p`` [bs, K]; level = (``topk_p`` [bs, K], ``topk_index``
      [bs, K], ``tree_parents = [-1, 0, 1, .., K-1]`` per request [bs, K+1]).

    Step i >= 1 (each of the K lanes proposes K children):
      ``expand = scores[:, :, None] * topk_p.view(bs, K, K)``; the K best of the K*K products
      (``torch.topk`` over ``expand.flatten(1)``: ``cs_p``, ``cs_idx`` [bs, K]) become the new
      lanes: ``scores = cs_p``; ``input_ids`` [bs*K] are their tokens; ``hidden`` [bs*K, F] is
      the hidden state of the lane each came from (``cs_idx // K``); level = (``expand.flatten(1)``
      [bs, K*K], ``topk_index.view(bs, K*K)``, ``tree_parents = cs_idx + K*K*(step-1) + K``
      [bs, K]).

    Candidate ids: step 0 candidates are ``0..K-1``; step i >= 1 candidates are
    ``K + K*K*(i-1) + (0..K*K-1)``. ``tree_parents`` of step i holds the candidate ids of the
    lanes kept at step i, which are the parents of step i+1's candidates.

    Returns ``(input_ids, hidden, scores, (tree_scores, tree_tokens, tree_parents))``; index
    outputs have the dtype of ``topk_index``.
    """
    bs = check_select_inputs(step, topk_p, topk_index, hidden, scores, topk)
    idx_dtype = topk_index.dtype
    if step == 0:
        parents = torch.arange(-1, topk, device=topk_index.device, dtype=idx_dtype)
        tree_parents = parents.unsqueeze(0).expand(bs, topk + 1).contiguous()  # [bs, K+1]
        level = (topk_p, topk_index, tree_parents)
        return topk_index.flatten(), hidden.repeat_interleave(topk, dim=0), topk_p, level

    assert scores is not None
    expand = scores.unsqueeze(2) * topk_p.view(bs, topk, topk)  # [bs, K, K]
    flat_scores = expand.flatten(1)  # [bs, K*K]
    cs_p, cs_idx = flat_scores.topk(topk, dim=1)  # [bs, K]
    lane = torch.div(cs_idx, topk, rounding_mode="floor")  # [bs, K] lane each winner came from
    flat_tokens = topk_index.view(bs, topk * topk)  # [bs, K*K]
    input_ids = flat_tokens.gather(1, cs_idx).flatten()  # [bs*K]
    feat = hidden.shape[-1]
    lane_hidden = hidden.view(bs, topk, feat)
    new_hidden = lane_hidden.gather(1, lane.unsqueeze(2).expand(bs, topk, feat))
    tree_parents = (cs_idx + (topk * topk * (step - 1) + topk)).to(idx_dtype)  # [bs, K]
    level = (flat_scores, flat_tokens, tree_parents)
    return input_ids, new_hidden.reshape(bs * topk, feat), cs_p, level


def organize_draft_results(
    tree_scores_list: list[torch.Tensor],  # S tensors: [bs, K] then [bs, K*K] ...
    tree_tokens_list: list[torch.Tensor],  # S tensors, same shapes as the scores
    tree_parents_list: list[torch.Tensor],  # S tensors: [bs, K+1] then [bs, K] ...
    num_draft_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keep the best ``N - 1`` of all ``K + (S-1)*K*K`` candidates (SGLang
    ``organize_draft_results``).

    ``top_scores_index = sort(topk(cat(scores), N-1).indices)`` [bs, N-1] (ascending candidate
    id, so a parent always precedes its children), ``draft_tokens`` [bs, N-1] their tokens, and
    ``parent_list = cat(tree_parents_list[:-1], 1)`` [bs, K*(S-1)+1] (``[bs, 0]`` when S == 1):
    ``parent_list[b, c // K]`` is the candidate id of candidate c's parent (c // K == 0: root).

    Returns ``(parent_list, top_scores_index, draft_tokens)``; ``top_scores_index`` is int64.
    """
    scores, tokens, parent_list = draft_levels(
        tree_scores_list, tree_tokens_list, tree_parents_list, num_draft_tokens
    )
    top_scores_index = scores.topk(num_draft_tokens - 1, dim=1).indices.sort(dim=1).values
    draft_tokens = tokens.gather(1, top_scores_index)
    return parent_list, top_scores_index, draft_tokens


def draft_levels(
    tree_scores_list: list[torch.Tensor],
    tree_tokens_list: list[torch.Tensor],
    tree_parents_list: list[torch.Tensor],
    num_draft_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``organize_draft_results``' checks and concatenations (shared with the Triton version)
    -> (scores [bs, C], tokens [bs, C], parent_list [bs, K*(S-1)+1] or [bs, 0])."""
    _check(
        len(tree_scores_list) >= 1
        and len(tree_scores_list) == len(tree_tokens_list) == len(tree_parents_list),
        "organize_draft_results needs one (scores, tokens, parents) triple per draft step, got "
        f"{len(tree_scores_list)}, {len(tree_tokens_list)}, {len(tree_parents_list)}",
    )
    scores = torch.cat(tree_scores_list, dim=1)  # [bs, num_candidates]
    tokens = torch.cat(tree_tokens_list, dim=1)  # [bs, num_candidates]
    _check(
        1 <= num_draft_tokens - 1 <= scores.shape[1],
        f"num_draft_tokens={num_draft_tokens} needs 1 <= N-1 <= the {scores.shape[1]} candidates "
        "of this tree; lower num_draft_tokens or raise topk / num_steps",
    )
    parents = tree_parents_list[:-1]
    if parents:
        parent_list = torch.cat(parents, dim=1)
    else:
        parent_list = tree_parents_list[0].new_empty((scores.shape[0], 0))
    return scores, tokens, parent_list


def _parent_nodes(
    parent_list: torch.Tensor,  # [bs, P]
    selected: torch.Tensor,  # [bs, N-1] int64 candidate ids of nodes 1..N-1
    topk: int,
) -> torch.Tensor:  # [bs, N] int64: parent node of each node; 0 root, -1 none / missing
    """Parent node index of every node (build_tree's bounded parent search)."""
    bs, m = selected.shape
    p = parent_list.shape[1]
    pc = torch.div(selected, topk, rounding_mode="floor")  # [bs, N-1]
    is_root_child = pc == 0
    in_range = (pc >= 1) & (pc < p)  # anything else is garbage: no parent
    if p > 0:
        parent_cand = parent_list.long().gather(1, pc.clamp(0, p - 1))  # [bs, N-1]
    else:
        parent_cand = torch.full_like(selected, -1)
    # First selected position holding the parent candidate id (the search is bounded by N-1).
    match = selected.unsqueeze(1) == parent_cand.unsqueeze(2)  # [bs, N-1 (child), N-1 (pos)]
    pos = torch.arange(m, device=selected.device).expand(bs, m, m)
    first = torch.where(match, pos, m).min(dim=2).values  # [bs, N-1]; m = not found
    found = in_range & (first < m)
    parent = torch.where(found, first + 1, -1)
    parent = torch.where(is_root_child, 0, parent)
    root = torch.full((bs, 1), -1, dtype=torch.long, device=selected.device)
    return torch.cat([root, parent], dim=1)


def check_build_tree_args(
    parent_list: torch.Tensor,  # [bs, K*(S-1)+1] ([bs, 0] allowed when S == 1)
    top_scores_index: torch.Tensor,  # [bs, N-1]
    seq_lens: torch.Tensor,  # [bs]
    topk: int,
    num_steps: int,
    num_draft_tokens: int,
    tree_mask_mode: TreeMaskMode,
    tree_mask: torch.Tensor,
    positions: torch.Tensor,  # [bs*N]
    retrive_index: torch.Tensor,  # [bs, N]
    retrive_next_token: torch.Tensor,  # [bs, N]
    retrive_next_sibling: torch.Tensor,  # [bs, N]
) -> None:
    """The argument checks of ``build_tree`` (shapes only, no host sync), shared by every
    implementation so that all of them refuse the same inputs with the same message."""
    bs = seq_lens.shape[0]
    n = num_draft_tokens
    _check(topk >= 1 and num_steps >= 1 and n >= 1, "topk, num_steps, num_draft_tokens >= 1")
    width = topk * (num_steps - 1) + 1
    _check(
        parent_list.dim() == 2
        and parent_list.shape[0] == bs
        and (parent_list.shape[1] == width or (num_steps == 1 and parent_list.shape[1] == 0)),
        f"parent_list must be [bs={bs}, topk*(num_steps-1)+1={width}] (or [bs, 0] when "
        f"num_steps == 1, as organize_draft_results returns it), got {tuple(parent_list.shape)}",
    )
    _check(
        tuple(top_scores_index.shape) == (bs, n - 1),
        f"top_scores_index must be [bs={bs}, N-1={n - 1}], got {tuple(top_scores_index.shape)}",
    )
    for name, t in (
        ("retrive_index", retrive_index),
        ("retrive_next_token", retrive_next_token),
        ("retrive_next_sibling", retrive_next_sibling),
    ):
        _check(tuple(t.shape) == (bs, n), f"{name} must be [bs={bs}, N={n}], got {tuple(t.shape)}")
    _check(positions.numel() == bs * n, f"positions must have bs*N={bs * n} entries")
    _check(
        tree_mask_mode is TreeMaskMode.TREE_ONLY,
        f"tree_mask_mode must be TreeMaskMode.TREE_ONLY, got {tree_mask_mode!r}",
    )
    _check(tuple(tree_mask.shape) == (bs, n, n), f"TREE_ONLY tree_mask must be [{bs}, {n}, {n}]")


def build_tree(
    parent_list: torch.Tensor,  # [bs, K*(S-1)+1] ([bs, 0] allowed when S == 1)
    top_scores_index: torch.Tensor,  # [bs, N-1] selected candidate ids, ascending
    seq_lens: torch.Tensor,  # [bs] verified prefix lengths (the root's position)
    topk: int,
    num_steps: int,
    num_draft_tokens: int,
    tree_mask_mode: TreeMaskMode,
    tree_mask: torch.Tensor,  # out: [bs, N, N] bool (TREE_ONLY, see below)
    positions: torch.Tensor,  # out: [bs*N]
    retrive_index: torch.Tensor,  # out: [bs, N]
    retrive_next_token: torch.Tensor,  # out: [bs, N]
    retrive_next_sibling: torch.Tensor,  # out: [bs, N]
) -> None:
    """Turn the selected candidates into a verification tree (sgl-kernel
    ``build_tree_kernel_efficient`` semantics, with bounded searches).

    Node 0 is the root (the bonus / last verified token); node j >= 1 is candidate
    ``c = top_scores_index[b, j-1]``. Its parent: ``pc = c // K`` (floor division); ``pc == 0``
    -> the root; ``1 <= pc < K*(S-1)+1`` -> the node whose candidate id equals
    ``parent_list[b, pc]`` (first match among nodes 1..N-1: the search is bounded by N-1);
    anything else (no match, ``pc`` out of range, negative ``c``) -> the parent is *missing*.
    With S == 1 every parent is the root, and ``parent_list`` may be ``[bs, 0]`` (what
    organize_draft_results returns then) as well as ``[bs, 1]``.

    Outputs (every entry written):
      ``retrive_index[b, j] = b*N + j``;
      ``retrive_next_token[b, j]`` = first child (smallest node index) of j, else -1;
      ``retrive_next_sibling[b, j]`` = next node with the same parent and a larger index, else -1
      (a node with a missing parent is linked nowhere, so it is never accepted);
      ``positions[b*N + j] = seq_lens[b] + depth(j)``;
      tree mask: row j marks j itself, the root and the ancestors found by walking up from j.
    The walk visits at most S nodes (j included) and stops after a root child or at a missing
    parent; depth(j) is the number of nodes it visited (root depth 0). On a well-formed tree that
    is the true depth and the mask row is the full ancestor set; on garbage (missing parents,
    duplicate ids, cycles) it stays bounded.

    Mask layout (``tree_mask_mode``, always ``TreeMaskMode.TREE_ONLY``): bool [bs, N, N],
    ``tree_mask[b, i, j]`` True when node j is node i or one of its ancestors.
    """
    check_build_tree_args(
        parent_list, top_scores_index, seq_lens, topk, num_steps, num_draft_tokens,
        tree_mask_mode, tree_mask, positions, retrive_index, retrive_next_token,
        retrive_next_sibling,
    )  # fmt: skip
    bs, n = seq_lens.shape[0], num_draft_tokens

    device = seq_lens.device
    selected = top_scores_index.long().to(device)  # [bs, N-1]
    parent = _parent_nodes(parent_list.to(device), selected, topk)  # [bs, N]
    node = torch.arange(n, device=device)

    # Child lists: first child = smallest child index, siblings in increasing index order.
    child_of = parent.unsqueeze(1) == node.view(1, n, 1)  # [bs, N (parent), N (child)]
    first_child = torch.where(child_of, node.view(1, 1, n), n).min(dim=2).values
    same_parent = (parent.unsqueeze(2) == parent.unsqueeze(1)) & (parent >= 0).unsqueeze(2)
    later = node.view(1, 1, n) > node.view(1, n, 1)
    next_sib = torch.where(same_parent & later, node.view(1, 1, n), n).min(dim=2).values

    # Bounded ancestor walk, all rows at once: at most S nodes per row.
    tree = torch.zeros(bs, n, n, dtype=torch.bool, device=device)
    tree[:, :, 0] = True
    rows = node[1:].expand(bs, n - 1)
    cur = rows.clone()  # [bs, N-1] node being visited for each row j >= 1
    active = torch.ones(bs, n - 1, dtype=torch.bool, device=device)
    depth = torch.zeros(bs, n, dtype=torch.long, device=device)
    batch = torch.arange(bs, device=device).unsqueeze(1).expand(bs, n - 1)
    for _ in range(num_steps):
        tree[batch, rows, cur] |= active
        depth[:, 1:] += active.long()
        up = parent.gather(1, cur)
        active = active & (up > 0)
        cur = torch.where(active, up, cur)

    write_tree_outputs(
        tree, depth, torch.where(first_child < n, first_child, -1),
        torch.where(next_sib < n, next_sib, -1), seq_lens, tree_mask, positions,
        retrive_index, retrive_next_token, retrive_next_sibling,
    )  # fmt: skip


def write_tree_outputs(
    tree: torch.Tensor,  # [bs, N, N] bool: each row's ancestors, itself and the root
    depth: torch.Tensor,  # [bs, N]
    next_token: torch.Tensor,  # [bs, N] first child, -1 for none
    next_sibling: torch.Tensor,  # [bs, N] next sibling, -1 for none
    seq_lens: torch.Tensor,  # [bs]
    tree_mask: torch.Tensor,  # out: [bs, N, N] bool
    positions: torch.Tensor,  # out: [bs*N]
    retrive_index: torch.Tensor,  # out: [bs, N]
    retrive_next_token: torch.Tensor,  # out: [bs, N]
    retrive_next_sibling: torch.Tensor,  # out: [bs, N]
) -> None:
    """build_tree's outputs from its tree: the mask, positions (prefix length + depth),
    retrive_index (``b*N + j``) and the links."""
    bs, n = depth.shape
    tree_mask.copy_(tree)
    positions.copy_((seq_lens.long().unsqueeze(1) + depth).flatten())
    retrive_index.copy_(torch.arange(bs * n, device=depth.device).view(bs, n))
    retrive_next_token.copy_(next_token)
    retrive_next_sibling.copy_(next_sibling)


def _link(links: torch.Tensor, at: torch.Tensor, n: int) -> torch.Tensor:
    """``links[b, at[b]]`` [bs], with anything outside ``[0, N)`` read as -1 (end of list)."""
    safe = at.clamp(0, n - 1).unsqueeze(1)
    val = links.long().gather(1, safe).squeeze(1)
    ok = (at >= 0) & (at < n) & (val >= 0) & (val < n)
    return torch.where(ok, val, -1)


def check_verify_args(
    candidates: torch.Tensor,
    others: dict[str, torch.Tensor],
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_length: torch.Tensor,
) -> tuple[int, int, int]:
    """The argument checks shared by the verify kernels (shapes only, no host sync);
    returns (bs, N, S)."""
    _check(candidates.dim() == 2, f"candidates must be [bs, N], got {tuple(candidates.shape)}")
    bs, n = candidates.shape
    for name, t in others.items():
        _check(t.shape[:2] == (bs, n), f"{name} must start with [bs={bs}, N={n}]")
    _check(predicts.numel() == bs * n, f"predicts must have bs*N={bs * n} entries")
    _check(
        accept_index.dim() == 2 and accept_index.shape[0] == bs and accept_index.shape[1] >= 1,
        f"accept_index must be [bs={bs}, S+1], got {tuple(accept_index.shape)}",
    )
    _check(accept_length.numel() == bs, f"accept_length must be [bs={bs}]")
    return bs, n, accept_index.shape[1] - 1


def check_sampling_probs(
    target_probs: torch.Tensor,  # [bs, N, V]
    draft_probs: torch.Tensor | None,  # [bs, N, V] or None
) -> None:
    """The probability-argument checks of ``verify_tree_sampling`` shared by every
    implementation."""
    _check(target_probs.dim() == 3, "target_probs must be [bs, N, V]")
    _check(
        draft_probs is None or draft_probs.shape == target_probs.shape,
        "draft_probs must be None or shaped like target_probs [bs, N, V]",
    )


def verify_tree_greedy(
    candidates: torch.Tensor,  # [bs, N] node tokens; column 0 is the root token
    retrive_index: torch.Tensor,  # [bs, N] global node index b*N + j (from build_tree)
    retrive_next_token: torch.Tensor,  # [bs, N] first child, -1
    retrive_next_sibling: torch.Tensor,  # [bs, N] next sibling, -1
    target_predict: torch.Tensor,  # [bs, N] target argmax after each node
    predicts: torch.Tensor,  # out: [bs*N]
    accept_index: torch.Tensor,  # out: [bs, S+1]
    accept_length: torch.Tensor,  # out: [bs]
) -> None:
    """Greedy tree verification (sgl-kernel ``verify_tree_greedy`` semantics).

    S is ``accept_index.shape[1] - 1``. From the root, for at most S depths: walk the children of
    the current node u (``retrive_next_token[b, u]``, then ``retrive_next_sibling``; at most N-1
    children examined; a link outside ``[0, N)`` ends the list) and accept the first child whose
    token ``candidates[b, c]`` equals ``target_predict[b, u]``; stop when none matches.

    Outputs (every entry written): ``accept_index[b, 0] = retrive_index[b, 0]``,
    ``accept_index[b, d]`` = ``retrive_index`` of the node accepted at depth d, -1 after the
    last; ``accept_length[b]`` = accepted draft nodes (root excluded); ``predicts[g]`` for every
    node g on the accepted path (root included) = ``target_predict`` at g (at the last accepted
    node that is the bonus token), 0 elsewhere. ``retrive_index`` must hold in-range global
    indices (as build_tree writes them): they address ``predicts``.
    """
    bs, n, steps = check_verify_args(
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
    device = candidates.device
    cand = candidates.long()
    target = target_predict.long()
    gidx = retrive_index.long()
    cur = torch.zeros(bs, dtype=torch.long, device=device)
    alive = torch.ones(bs, dtype=torch.bool, device=device)
    length = torch.zeros(bs, dtype=torch.long, device=device)
    path = torch.full((bs, steps + 1), -1, dtype=torch.long, device=device)
    path[:, 0] = gidx[:, 0]
    on_path = torch.zeros(bs, n, dtype=torch.bool, device=device)
    on_path[:, 0] = True
    rows = torch.arange(bs, device=device)
    for depth in range(1, steps + 1):
        want = target.gather(1, cur.unsqueeze(1)).squeeze(1)  # [bs]
        child = _link(retrive_next_token, cur, n)
        accepted = torch.full_like(cur, -1)
        for _ in range(n - 1):
            looking = alive & (accepted < 0) & (child >= 0)
            tok = cand.gather(1, child.clamp(min=0).unsqueeze(1)).squeeze(1)
            hit = looking & (tok == want)
            accepted = torch.where(hit, child, accepted)
            child = torch.where(looking & ~hit, _link(retrive_next_sibling, child, n), child)
        alive = alive & (accepted >= 0)
        cur = torch.where(alive, accepted, cur)
        length += alive.long()
        path[:, depth] = torch.where(alive, gidx[rows, cur], -1)
        on_path[rows, cur] |= alive
    values = torch.where(on_path, target, 0)  # [bs, N]
    out = torch.zeros(bs * n, dtype=torch.long, device=device)
    # A full scatter (no boolean indexing): no host sync, every entry written.
    out.scatter_(0, gidx.flatten(), values.flatten())
    predicts.copy_(out.view(predicts.shape))
    accept_index.copy_(path)
    accept_length.copy_(length.view(accept_length.shape))


def inverse_cdf(
    probs: torch.Tensor,  # [bs, V] non-negative, not necessarily normalised
    coins: torch.Tensor,  # [bs] uniform in [0, 1)
) -> torch.Tensor:  # [bs] int64
    """The first token whose cumulative mass exceeds ``coin * total``, clamped to the last token
    with positive mass (0 when every entry is 0), so rounding never picks a zero-mass token."""
    cdf = probs.cumsum(dim=1)  # [bs, V]
    threshold = coins.to(cdf.dtype).unsqueeze(1) * cdf[:, -1:]
    token = torch.searchsorted(cdf, threshold.contiguous(), right=True).squeeze(1)
    vocab = torch.arange(probs.shape[1], device=probs.device)
    last_positive = torch.where(probs > 0, vocab, 0).max(dim=1).values
    return torch.minimum(token, last_positive)


def verify_tree_sampling(
    candidates: torch.Tensor,  # [bs, N] node tokens; column 0 is the root token
    retrive_index: torch.Tensor,  # [bs, N] global node index b*N + j (from build_tree)
    retrive_next_token: torch.Tensor,  # [bs, N] first child, -1
    retrive_next_sibling: torch.Tensor,  # [bs, N] next sibling, -1
    target_probs: torch.Tensor,  # [bs, N, V] fp32 target distribution after each node
    draft_probs: torch.Tensor | None,  # [bs, N, V] draft distribution after each node, or None
    coins: torch.Tensor,  # [bs, N] uniform [0, 1): coins[b, c] decides child c
    final_coins: torch.Tensor,  # [bs] uniform [0, 1): the final (bonus) draw
    predicts: torch.Tensor,  # out: [bs*N]
    accept_index: torch.Tensor,  # out: [bs, S+1]
    accept_length: torch.Tensor,  # out: [bs]
) -> None:
    """Tree speculative sampling, lossless w.r.t. ``target_probs`` (recursive rejection
    sampling over siblings, as in SpecInfer; target-only when ``draft_probs`` is None).

    S is ``accept_index.shape[1] - 1``. At the current node u (start: root) the residual is
    ``r = target_probs[b, u]``. Children c of u are tried in list order (as in
    :func:`verify_tree_greedy`, at most N-1, links outside ``[0, N)`` end the list); with
    ``x = candidates[b, c]`` and ``q = onehot(x)`` (draft_probs None) or ``draft_probs[b, u]``:
    accept iff ``coins[b, c] < a`` where ``a = 0`` if ``r[x] <= 0``, else ``1`` if ``q[x] <= 0``,
    else ``min(1, r[x] / q[x])``. Accept: ``predicts[global u] = x``, move to c (at most S
    depths). Reject: ``r = max(r - q, 0)`` normalised (``target_probs[b, u]`` when it sums to 0)
    and try the next child. When no child is accepted, or the walk reached depth S, the bonus
    token ``predicts[global u]`` is drawn from r (``target_probs[b, u]`` after depth S) by
    :func:`inverse_cdf` with ``final_coins[b]``.

    Lossless when each node's children are distinct deterministic drafts (draft_probs None) or
    i.i.d. draws from ``draft_probs[b, u]``. Outputs are written as in verify_tree_greedy
    (``predicts`` 0 off the path, ``accept_index`` -1 padded).
    """
    bs, n, steps = check_verify_args(
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
    device = candidates.device
    cand = candidates.long()
    gidx = retrive_index.long()
    probs = target_probs.float()
    rows = torch.arange(bs, device=device)
    cur = torch.zeros(bs, dtype=torch.long, device=device)
    alive = torch.ones(bs, dtype=torch.bool, device=device)
    length = torch.zeros(bs, dtype=torch.long, device=device)
    path = torch.full((bs, steps + 1), -1, dtype=torch.long, device=device)
    path[:, 0] = gidx[:, 0]
    emitted = torch.zeros(bs, n, dtype=torch.long, device=device)  # predicts by local node
    for depth in range(1, steps + 1):
        base = probs[rows, cur]  # [bs, V] target after the current node
        resid = base.clone()
        q_row = draft_probs[rows, cur].float() if draft_probs is not None else None
        child = _link(retrive_next_token, cur, n)
        accepted = torch.full_like(cur, -1)
        for _ in range(n - 1):
            looking = alive & (accepted < 0) & (child >= 0)
            safe = child.clamp(min=0)
            x = cand[rows, safe].clamp(0, probs.shape[2] - 1)
            r_x = resid[rows, x]
            if q_row is None:
                q_x = torch.ones_like(r_x)
                reduced = resid.clone()
                reduced[rows, x] = (r_x - 1.0).clamp(min=0.0)
            else:
                q_x = q_row[rows, x]
                reduced = (resid - q_row).clamp(min=0.0)
            ratio = torch.where(q_x > 0, r_x / torch.where(q_x > 0, q_x, 1.0), 1.0)
            accept_p = torch.where(r_x > 0, ratio.clamp(max=1.0), 0.0)
            hit = looking & (coins[rows, safe].float() < accept_p)
            accepted = torch.where(hit, child, accepted)
            total = reduced.sum(dim=1, keepdim=True)
            renorm = torch.where(total > 0, reduced / torch.where(total > 0, total, 1.0), base)
            rejected = looking & ~hit
            resid = torch.where(rejected.unsqueeze(1), renorm, resid)
            child = torch.where(rejected, _link(retrive_next_sibling, child, n), child)
        took = alive & (accepted >= 0)
        token = torch.where(
            took, cand[rows, accepted.clamp(min=0)], inverse_cdf(resid, final_coins)
        )
        emitted[rows, cur] = torch.where(alive, token, emitted[rows, cur])
        cur = torch.where(took, accepted, cur)
        length += took.long()
        path[:, depth] = torch.where(took, gidx[rows, cur], -1)
        alive = took
    # Requests still alive reached depth S: their bonus comes from the target at the last node.
    bonus = inverse_cdf(probs[rows, cur], final_coins)
    emitted[rows, cur] = torch.where(alive, bonus, emitted[rows, cur])
    out = torch.zeros(bs * n, dtype=torch.long, device=device)
    out.scatter_(0, gidx.flatten(), emitted.flatten())
    predicts.copy_(out.view(predicts.shape))
    accept_index.copy_(path)
    accept_length.copy_(length.view(accept_length.shape))
