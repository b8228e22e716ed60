"""Slow, obviously-correct versions of the draft-tree and sampling algorithms, for tests.

Each function follows the documented contract of its kernel (:mod:`polyspec.kernels._tree`,
:func:`polyspec.kernels.reference.top_k_top_p_renorm`) with plain Python lists and loops, one
request at a time, in float64 where probabilities are involved. The vectorised kernels (the
reference included) are compared with these, so a bug the reference shares with a backend
cannot hide behind "backend == reference".

The sampling oracle also gives the exact law of its outcomes (:func:`sampling_outcome_law`)
and the law lossless verification must produce (:func:`target_sequence_law`), so the documented
algorithm itself is checked, not only its implementations.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import torch

# ------------------------------------------------------------------------ draft-tree selection


@dataclasses.dataclass(frozen=True)
class DraftTree:
    """What select_top_k (every step) and organize_draft_results produce, per request."""

    input_ids: list[list[list[int]]]  # [step][b] the K lane tokens select_top_k returns
    lane_rows: list[list[list[int]]]  # [step][b] the row of that step's hidden each lane takes
    scores: list[list[list[float]]]  # [step][b] the K lane scores
    parent_list: list[list[int]]  # [b] K*(S-1)+1 candidate ids ([] when S == 1)
    selected: list[list[int]]  # [b] the N-1 best candidate ids, ascending
    draft_tokens: list[list[int]]  # [b] their tokens


def draft_tree(
    steps: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],  # (topk_p, topk_index, _)
    topk: int,
    num_draft_tokens: int,
) -> DraftTree:
    """EAGLE top-K expansion and selection by loops. Step 0's K candidates (ids 0..K-1) are the
    root's children; at step i >= 1 lane l's child c is candidate ``K + K*K*(i-1) + l*K + c``
    with score ``score(lane l) * topk_p[b*K + l, c]`` (float32 product, as the kernels
    compute it); the K best become the next lanes (best first). The kept candidates are the
    N-1 best of all, in ascending id order. Scores must be distinct (no tie rule)."""
    k = topk
    p0, i0 = steps[0][0], steps[0][1]
    bs = p0.shape[0]
    out_ids, out_rows, out_scores = [], [], []
    parent_list, selected, draft_tokens = [], [], []
    per_step: list[tuple[list, list, list]] = [([], [], []) for _ in steps]
    for b in range(bs):
        score = {c: np.float32(p0[b, c].item()) for c in range(k)}
        token = {c: int(i0[b, c]) for c in range(k)}
        lanes = list(range(k))
        parents = [-1] + lanes if len(steps) > 1 else []
        per_step[0][0].append([token[c] for c in lanes])
        per_step[0][1].append([b] * k)
        per_step[0][2].append([float(score[c]) for c in lanes])
        for step in range(1, len(steps)):
            p, ids = steps[step][0], steps[step][1]
            base = k + k * k * (step - 1)
            lane_of = {}
            for lane, parent in enumerate(lanes):
                for c in range(k):
                    cid = base + lane * k + c
                    score[cid] = score[parent] * np.float32(p[b * k + lane, c].item())
                    token[cid] = int(ids[b * k + lane, c])
                    lane_of[cid] = lane
            children = [base + j for j in range(k * k)]
            best = sorted(children, key=lambda cid: -score[cid])[:k]
            per_step[step][0].append([token[c] for c in best])
            per_step[step][1].append([b * k + lane_of[c] for c in best])
            per_step[step][2].append([float(score[c]) for c in best])
            lanes = best
            if step < len(steps) - 1:
                parents += lanes
        kept = sorted(sorted(score, key=lambda c: -score[c])[: num_draft_tokens - 1])
        parent_list.append(parents)
        selected.append(kept)
        draft_tokens.append([token[c] for c in kept])
    for ids, rows, scores in per_step:
        out_ids.append(ids)
        out_rows.append(rows)
        out_scores.append(scores)
    return DraftTree(out_ids, out_rows, out_scores, parent_list, selected, draft_tokens)


# ----------------------------------------------------------------------------------- build_tree


@dataclasses.dataclass(frozen=True)
class Tree:
    """build_tree's outputs for one request, as lists (node 0 is the root)."""

    parent: list[int]  # parent node of each node; -1 for the root and for a missing parent
    next_token: list[int]  # first child or -1
    next_sibling: list[int]  # next sibling or -1
    depth: list[int]
    rows: list[set[int]]  # mask row j: the nodes node j attends to (itself, ancestors, root)


def build_tree(
    parent_list: Sequence[int],  # K*(S-1)+1 candidate ids, or empty when S == 1
    selected: Sequence[int],  # N-1 candidate ids of nodes 1..N-1
    topk: int,
    num_steps: int,
) -> Tree:
    """One request's tree, as build_tree documents it: node j's parent is found from
    ``pc = selected[j-1] // K`` (0: the root; in range: the first node holding candidate
    ``parent_list[pc]``; else missing); children in increasing node order; the mask row and the
    depth come from a walk up from j that visits at most S nodes and stops after a root child
    or at a missing parent."""
    n = len(selected) + 1
    parent = [-1] * n
    for j in range(1, n):
        pc = selected[j - 1] // topk  # floor division, as the kernel's
        if pc == 0:
            parent[j] = 0
        elif 1 <= pc < len(parent_list):
            want = parent_list[pc]
            hits = [i for i in range(1, n) if selected[i - 1] == want]
            parent[j] = hits[0] if hits else -1
    next_token = [-1] * n
    next_sibling = [-1] * n
    for j in range(n):
        kids = [c for c in range(n) if parent[c] == j]
        if kids:
            next_token[j] = kids[0]
    for j in range(n):
        if parent[j] >= 0:
            later = [c for c in range(j + 1, n) if parent[c] == parent[j]]
            if later:
                next_sibling[j] = later[0]
    depth = [0] * n
    rows = [{0} for _ in range(n)]
    for j in range(1, n):
        cur = j
        for _ in range(num_steps):
            rows[j].add(cur)
            depth[j] += 1
            up = parent[cur]
            if up <= 0:
                break
            cur = up
    return Tree(parent, next_token, next_sibling, depth, rows)


def tree_mask_layout(rows: list[list[set[int]]], seq_lens: Sequence[int], mode) -> torch.Tensor:
    """Per-request mask rows in the TREE_ONLY layout (the one ``TreeMaskMode``):
    ``[bs, N, N]``, True where node j is node i or its ancestor. ``seq_lens`` and ``mode`` are
    taken so that a later layout needs no change at the call sites."""
    n = len(rows[0])
    return torch.tensor([[[j in r for j in range(n)] for r in req] for req in rows])


# --------------------------------------------------------------------------------- verification


def children(next_token: Sequence[int], next_sibling: Sequence[int], u: int) -> list[int]:
    """u's child list as verification walks it: first child, then siblings; a link outside
    ``[0, N)`` ends the list; at most N-1 children."""
    n = len(next_token)
    out = []
    c = next_token[u]
    while 0 <= c < n and len(out) < n - 1:
        out.append(c)
        c = next_sibling[c]
    return out


@dataclasses.dataclass(frozen=True)
class Verified:
    """One request's verification result (global ids as in ``retrive_index``)."""

    accept_index: list[int]  # S+1 entries, -1 after the path
    accept_length: int
    predicts: dict[int, int]  # global node id -> emitted token, for the path's nodes


def verify_greedy(
    candidates: Sequence[int],  # [N] node tokens
    retrive_index: Sequence[int],  # [N] global ids
    next_token: Sequence[int],
    next_sibling: Sequence[int],
    target_predict: Sequence[int],  # [N] target argmax after each node
    num_steps: int,
) -> Verified:
    """Greedy verification: from the root, at most S times, accept the first child (in list
    order) whose token is the target's prediction at the current node."""
    path = [0]
    for _ in range(num_steps):
        u = path[-1]
        hit = [
            c for c in children(next_token, next_sibling, u) if candidates[c] == target_predict[u]
        ]
        if not hit:
            break
        path.append(hit[0])
    length = len(path) - 1
    accept = [retrive_index[j] for j in path] + [-1] * (num_steps - length)
    return Verified(accept, length, {retrive_index[j]: int(target_predict[j]) for j in path})


def inverse_cdf(probs: Sequence[float], coin: float) -> tuple[int, float]:
    """The first token whose cumulative mass exceeds ``coin * total``, clamped to the last token
    of positive mass (0 when all are 0); also the distance from ``coin * total`` to the nearest
    cumulative boundary (how close the draw was to picking a neighbour)."""
    total = math.fsum(probs)
    threshold = coin * total
    cum, token, margin = 0.0, len(probs) - 1, math.inf
    found = False
    for t, p in enumerate(probs):
        cum += p
        margin = min(margin, abs(cum - threshold))
        if not found and cum > threshold:
            token, found = t, True
    positive = [t for t, p in enumerate(probs) if p > 0]
    last = positive[-1] if positive else 0
    return min(token, last), margin


def accept_probability(resid: Sequence[float], q: Sequence[float] | None, x: int) -> float:
    """``a`` of verify_tree_sampling: 0 if r[x] <= 0, else 1 if q[x] <= 0, else
    min(1, r[x] / q[x]); q None is the one-hot of x."""
    q_x = 1.0 if q is None else q[x]
    if resid[x] <= 0:
        return 0.0
    if q_x <= 0:
        return 1.0
    return min(1.0, resid[x] / q_x)


def reject_update(
    resid: list[float], q: Sequence[float] | None, x: int, base: Sequence[float], renorm: bool
) -> list[float]:
    """The residual after rejecting token x: max(r - q, 0), normalised (``base`` when it sums
    to 0). ``renorm=False`` is the classic bug (kept to measure which draws tell them apart)."""
    q_row = [1.0 if t == x else 0.0 for t in range(len(resid))] if q is None else q
    reduced = [max(r - qq, 0.0) for r, qq in zip(resid, q_row)]
    total = math.fsum(reduced)
    if total <= 0:
        return list(base)
    return [r / total for r in reduced] if renorm else reduced


@dataclasses.dataclass(frozen=True)
class SampledVerified(Verified):
    margin: float  # smallest |coin - threshold| over the draws made (float32 vs float64 safety)
    deciding_renorm: int  # sibling decisions after a rejection that an un-normalised residual
    # would have decided the other way
    sibling_rejections: int  # rejections followed by a later sibling's decision
    later_acceptances: int  # siblings accepted after an earlier sibling was rejected


def verify_sampling(
    candidates: Sequence[int],
    retrive_index: Sequence[int],
    next_token: Sequence[int],
    next_sibling: Sequence[int],
    target_probs: Sequence[Sequence[float]],  # [N][V]
    draft_probs: Sequence[Sequence[float]] | None,  # [N][V] or None (one-hot drafts)
    coins: Sequence[float],  # [N]
    final_coin: float,
    num_steps: int,
) -> SampledVerified:
    """Tree speculative sampling by loops (recursive rejection over siblings, SpecInfer), as
    verify_tree_sampling documents it. Token ids are clamped to ``[0, V)``."""
    vocab = len(target_probs[0])
    u, path, emitted = 0, [0], {}
    margin, deciding, rejections, later = math.inf, 0, 0, 0
    for depth in range(num_steps + 1):
        base = list(target_probs[u])
        if depth == num_steps:  # reached depth S: the bonus comes from the target at u
            emitted[u], m = inverse_cdf(base, final_coin)
            margin = min(margin, m)
            break
        resid, plain = list(base), list(base)
        q = None if draft_probs is None else list(draft_probs[u])
        accepted, rejected_before = -1, False
        for c in children(next_token, next_sibling, u):
            x = min(max(int(candidates[c]), 0), vocab - 1)
            a = accept_probability(resid, q, x)
            if 0.0 < a < 1.0:
                margin = min(margin, abs(coins[c] - a))
            take = coins[c] < a
            if rejected_before and take != (coins[c] < accept_probability(plain, q, x)):
                deciding += 1
            if take:
                later += rejected_before
                accepted = c
                break
            resid = reject_update(resid, q, x, base, renorm=True)
            plain = reject_update(plain, q, x, base, renorm=False)
            rejected_before = True
            rejections += 1
        if accepted < 0:
            emitted[u], m = inverse_cdf(resid, final_coin)
            margin = min(margin, m)
            break
        emitted[u] = int(candidates[accepted])
        u = accepted
        path.append(u)
    length = len(path) - 1
    accept = [retrive_index[j] for j in path] + [-1] * (num_steps - length)
    predicts = {retrive_index[j]: emitted[j] for j in path}
    return SampledVerified(accept, length, predicts, margin, deciding, rejections, later)


def sampling_outcome_law(
    candidates: Sequence[int],
    next_token: Sequence[int],
    next_sibling: Sequence[int],
    target_probs: Sequence[Sequence[float]],
    draft_probs: Sequence[Sequence[float]] | None,
    num_steps: int,
) -> dict[tuple[int, ...], float]:
    """The exact law of the emitted tokens (accepted tokens, then the bonus) of
    :func:`verify_sampling` over uniform coins: each child is accepted with probability
    ``prod(1 - a_earlier) * a``, with the residuals the algorithm computes."""
    vocab = len(target_probs[0])
    law: dict[tuple[int, ...], float] = {}

    def bonus(prefix: tuple[int, ...], probs: Sequence[float], weight: float) -> None:
        total = math.fsum(probs)
        for t, p in enumerate(probs):
            if weight * p > 0:
                key = prefix + (t,)
                law[key] = law.get(key, 0.0) + weight * p / total

    def walk(u: int, depth: int, prefix: tuple[int, ...], weight: float) -> None:
        base = list(target_probs[u])
        if depth == num_steps:
            bonus(prefix, base, weight)
            return
        resid = list(base)
        q = None if draft_probs is None else list(draft_probs[u])
        survive = 1.0
        for c in children(next_token, next_sibling, u):
            x = min(max(int(candidates[c]), 0), vocab - 1)
            a = accept_probability(resid, q, x)
            if a > 0:
                walk(c, depth + 1, prefix + (int(candidates[c]),), weight * survive * a)
            survive *= 1.0 - a
            resid = reject_update(resid, q, x, base, renorm=True)
        if survive > 0:
            bonus(prefix, resid, weight * survive)

    walk(0, 0, (), 1.0)
    return law


def target_sequence_law(
    candidates: Sequence[int],
    next_token: Sequence[int],
    next_sibling: Sequence[int],
    target_probs: Sequence[Sequence[float]],
    num_steps: int,
) -> dict[tuple[int, ...], float]:
    """The law lossless verification with one-hot drafts must give: the target draws token t
    after node u with probability ``target_probs[u][t]``; the walk goes on into u's first child
    holding t (while fewer than S tokens were accepted), else t is the last emitted token."""
    law: dict[tuple[int, ...], float] = {}

    def walk(u: int, depth: int, prefix: tuple[int, ...], weight: float) -> None:
        kids = children(next_token, next_sibling, u) if depth < num_steps else []
        for t, p in enumerate(target_probs[u]):
            if p <= 0:
                continue
            follow = [c for c in kids if int(candidates[c]) == t]
            if follow:
                walk(follow[0], depth + 1, prefix + (t,), weight * p)
            else:
                law[prefix + (t,)] = law.get(prefix + (t,), 0.0) + weight * p

    walk(0, 0, (), 1.0)
    return law


# ------------------------------------------------------------------------ sampling transforms


def transformed_probs(
    logits: Sequence[float], temperature: float, top_k: int, top_p: float
) -> list[float]:
    """The documented sampling law of one row, in float64: ``softmax(logits / temperature)``,
    then top-k (the k most probable, ties to the lower id; k <= 0 or >= V is off), then top-p
    over what top-k kept (rank i stays while the kept mass before it is < top_p * kept mass;
    the first always stays), renormalised."""
    m = max(logits)
    e = [math.exp((x - m) / temperature) for x in logits]
    total = math.fsum(e)
    p = [v / total for v in e]
    order = sorted(range(len(p)), key=lambda t: (-p[t], t))
    k = len(p) if top_k <= 0 or top_k >= len(p) else top_k
    kept = order[:k]
    kept_mass = math.fsum(p[t] for t in kept)
    final, before = [], 0.0
    for rank, t in enumerate(kept):
        if top_p >= 1.0 or rank == 0 or before < top_p * kept_mass:
            final.append(t)
        before += p[t]
    mass = math.fsum(p[t] for t in final)
    out = [0.0] * len(p)
    for t in final:
        out[t] = p[t] / mass
    return out
