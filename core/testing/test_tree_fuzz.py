"""Property-based fuzzing of the draft-tree kernels (hypothesis; small, derandomized budgets).

Trees come from the draft pipeline (select_top_k / organize_draft_results on random draft
probabilities), optionally corrupted: random parent ids, random / out-of-range selected ids,
duplicate ids, NaN draft scores. For every tree the backend must agree with the reference, stay
bounded, and satisfy the structural invariants of build_tree and verify_tree_greedy.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polyspec.backend import KernelSet, TreeMaskMode
from polyspec.kernels.reference import reference_kernels

FUZZ = settings(
    max_examples=50,
    deadline=None,
    derandomize=True,  # a shipped conformance suite must not be flaky
    database=None,  # leave no .hypothesis directory behind
    suppress_health_check=[HealthCheck.too_slow],
)


def _ref() -> KernelSet:
    return reference_kernels()


def _dev(backend, t: torch.Tensor) -> torch.Tensor:
    return t.to(backend.device(), copy=True)


def _idx(backend, t: torch.Tensor) -> torch.Tensor:
    return t.to(device=backend.device(), dtype=backend.index_dtype, copy=True)


def _num_candidates(topk: int, num_steps: int) -> int:
    return topk + (num_steps - 1) * topk * topk


@st.composite
def _shapes(draw, max_n: int = 16):
    """(bs, topk, num_steps, num_draft_tokens, seed) of a tree with at least one draft node."""
    topk = draw(st.integers(1, 4))
    num_steps = draw(st.integers(1, 4))
    n = draw(st.integers(2, min(max_n, _num_candidates(topk, num_steps) + 1)))
    return draw(st.integers(1, 3)), topk, num_steps, n, draw(st.integers(0, 2**31 - 1))


def _draft_steps(g: torch.Generator, bs: int, topk: int, num_steps: int, vocab: int, nan: bool):
    """Per-step (topk_p, topk_index, hidden) from random draft logits; ``nan`` poisons a few
    probabilities with NaN (a broken draft model)."""
    steps = []
    for step in range(num_steps):
        rows = bs if step == 0 else bs * topk
        p, i = torch.randn(rows, vocab, generator=g).softmax(-1).topk(topk, dim=-1)
        if nan:
            p = torch.where(torch.rand(rows, topk, generator=g) < 0.3, float("nan"), p)
        steps.append((p, i, torch.randn(rows, 3, generator=g)))
    return steps


def _drive(kernels, steps, topk: int, n: int, to_dev, to_idx):
    """select_top_k over every step, then organize_draft_results; returns (per-step select
    outputs, organize outputs)."""
    scores = None
    selects = []
    for step, (p, i, h) in enumerate(steps):
        ids, hidden, scores, level = kernels.select_top_k(
            step, to_dev(p), to_idx(i), to_dev(h), scores, topk
        )
        selects.append((ids, hidden, scores, level))
    levels = [s[3] for s in selects]
    organized = kernels.organize_draft_results(
        [lv[0] for lv in levels], [lv[1] for lv in levels], [lv[2] for lv in levels], n
    )
    return selects, organized


def _corrupt(g: torch.Generator, kind: str, parent_list, selected, num_candidates: int):
    """Malformed variants of a tree (CPU tensors)."""
    parent_list, selected = parent_list.clone(), selected.clone()
    bs, m = selected.shape
    if kind == "random_parents" and parent_list.shape[1] > 1:
        parent_list[:, 1:] = torch.randint(
            -2, num_candidates + 2, parent_list[:, 1:].shape, generator=g
        )
    elif kind == "random_ids":
        selected = torch.randint(-3, num_candidates + 4, (bs, m), generator=g)
    elif kind == "duplicates" and m > 1:
        at = torch.randint(0, m, (bs,), generator=g)
        selected[torch.arange(bs), at] = selected[:, 0].clone()
    return parent_list, selected


def _tree_outs(backend, mode: TreeMaskMode, bs: int, n: int, seq_lens: torch.Tensor) -> dict:
    dev, idt = backend.device(), backend.index_dtype
    mask = torch.full((bs, n, n), True, device=dev)  # the one layout, TREE_ONLY
    return {
        "tree_mask": mask,
        "positions": torch.full((bs * n,), -7, dtype=idt, device=dev),
        "retrive_index": torch.full((bs, n), -7, dtype=idt, device=dev),
        "retrive_next_token": torch.full((bs, n), -7, dtype=idt, device=dev),
        "retrive_next_sibling": torch.full((bs, n), -7, dtype=idt, device=dev),
    }


def _decode_mask(mask: torch.Tensor, mode: TreeMaskMode, seq_lens: torch.Tensor, n: int):
    """The mask as bool [bs, N, N] (``mode`` is TREE_ONLY, the one layout)."""
    assert mode is TreeMaskMode.TREE_ONLY
    return mask.bool()


def _build_both(backend, parent_list, selected, seq_lens, topk, num_steps, n, mode):
    """Run build_tree on the backend and the reference; assert agreement; return CPU outputs."""
    bs = seq_lens.shape[0]
    got = _tree_outs(backend, mode, bs, n, seq_lens)
    backend.kernels.build_tree(
        _idx(backend, parent_list),
        _idx(backend, selected),
        _idx(backend, seq_lens),
        topk,
        num_steps,
        n,
        mode,
        **got,
    )
    got = {k: v.to("cpu") for k, v in got.items()}
    ref = {k: torch.zeros_like(v) for k, v in got.items()}
    _ref().build_tree(parent_list, selected, seq_lens, topk, num_steps, n, mode, **ref)
    for name in ref:
        assert torch.equal(got[name].long(), ref[name].long()), f"build_tree.{name} != reference"
    return got


def _children(next_token: list[int], next_sibling: list[int], u: int, n: int) -> list[int]:
    """u's child list as the verify kernels walk it (bounded; links outside [0, N) end it)."""
    out = []
    c = next_token[u]
    while 0 <= c < n and len(out) < n - 1:
        out.append(c)
        c = next_sibling[c]
    return out


def _check_tree_invariants(out, seq_lens, n: int, num_steps: int, mode, well_formed: bool):
    bs = seq_lens.shape[0]
    tree = _decode_mask(out["tree_mask"], mode, seq_lens, n)
    depth = out["positions"].long().view(bs, n) - seq_lens.long().unsqueeze(1)
    for b in range(bs):
        nt = out["retrive_next_token"][b].long().tolist()
        ns = out["retrive_next_sibling"][b].long().tolist()
        assert out["retrive_index"][b].long().tolist() == list(range(b * n, (b + 1) * n))
        assert depth[b, 0] == 0 and tree[b, 0].tolist() == [True] + [False] * (n - 1)
        linked = [c for c in nt + ns if c != -1]
        assert all(1 <= c < n for c in linked), "links must be -1 or a non-root node"
        assert len(linked) == len(set(linked)), "a node is linked twice"
        for j in range(n):
            assert ns[j] == -1 or ns[j] > j, "siblings must be in increasing node order"
        for j in range(1, n):
            assert 1 <= depth[b, j] <= num_steps
            assert tree[b, j, 0] and tree[b, j, j]
            assert int(tree[b, j].sum()) <= int(depth[b, j]) + 1
        if not well_formed:
            continue
        # Every node reachable; a child's row is its parent's row plus itself.
        seen = {0}
        frontier = [0]
        while frontier:
            u = frontier.pop()
            for c in _children(nt, ns, u, n):
                assert c not in seen
                seen.add(c)
                frontier.append(c)
                expected = tree[b, u].clone()
                expected[c] = True
                assert torch.equal(tree[b, c], expected), f"row {c} is not row {u} plus {c}"
                assert depth[b, c] == depth[b, u] + 1
        assert seen == set(range(n)), f"unreachable nodes in a well-formed tree: {seen}"


@FUZZ
@given(
    shape=_shapes(),
    kind=st.sampled_from(["none", "random_parents", "random_ids", "duplicates"]),
    mode=st.sampled_from(list(TreeMaskMode)),
)
def test_build_tree_fuzz(backend, shape, kind, mode):
    bs, topk, num_steps, n, seed = shape
    g = torch.Generator().manual_seed(seed)
    steps = _draft_steps(g, bs, topk, num_steps, vocab=20, nan=False)
    _, (parent_list, selected, _) = _drive(_ref(), steps, topk, n, lambda t: t, lambda t: t)
    parent_list, selected = _corrupt(
        g, kind, parent_list, selected, _num_candidates(topk, num_steps)
    )
    seq_lens = torch.randint(0, 12, (bs,), generator=g)
    out = _build_both(backend, parent_list, selected, seq_lens, topk, num_steps, n, mode)
    _check_tree_invariants(out, seq_lens, n, num_steps, mode, well_formed=kind == "none")


def _check_greedy(out, candidates, target, tree, num_steps: int) -> None:
    """Invariants of verify_tree_greedy's outputs (CPU tensors)."""
    bs, n = candidates.shape
    predicts = out["predicts"].long().view(bs, n)
    for b in range(bs):
        nt = tree["retrive_next_token"][b].long().tolist()
        ns = tree["retrive_next_sibling"][b].long().tolist()
        length = int(out["accept_length"][b])
        path = out["accept_index"][b].long().tolist()
        assert 0 <= length <= num_steps
        assert path[0] == b * n
        assert path[length + 1 :] == [-1] * (num_steps - length)
        nodes = [g - b * n for g in path[: length + 1]]
        assert all(0 <= j < n for j in nodes)
        for u, c in zip(nodes, nodes[1:]):
            kids = _children(nt, ns, u, n)
            match = [k for k in kids if candidates[b, k] == target[b, u]]
            assert match and match[0] == c, f"node {c} is not u={u}'s first matching child"
        if length < num_steps:
            last = nodes[-1]
            assert all(candidates[b, k] != target[b, last] for k in _children(nt, ns, last, n))
        expected = torch.zeros(n, dtype=torch.long)
        for j in nodes:
            expected[j] = target[b, j]
        assert torch.equal(predicts[b], expected)


@FUZZ
@given(
    shape=_shapes(),
    kind=st.sampled_from(["none", "none", "random_parents", "random_ids", "duplicates"]),
    vocab=st.integers(2, 6),
)
def test_verify_tree_greedy_fuzz(backend, shape, kind, vocab):
    bs, topk, num_steps, n, seed = shape
    g = torch.Generator().manual_seed(seed)
    steps = _draft_steps(g, bs, topk, num_steps, vocab=20, nan=False)
    _, (parent_list, selected, _) = _drive(_ref(), steps, topk, n, lambda t: t, lambda t: t)
    parent_list, selected = _corrupt(
        g, kind, parent_list, selected, _num_candidates(topk, num_steps)
    )
    seq_lens = torch.randint(0, 12, (bs,), generator=g)
    tree = _build_both(
        backend, parent_list, selected, seq_lens, topk, num_steps, n, TreeMaskMode.TREE_ONLY
    )
    # A tiny vocabulary makes matches (and duplicate sibling tokens) common.
    candidates = torch.randint(0, vocab, (bs, n), generator=g)
    target = torch.randint(0, vocab, (bs, n), generator=g)
    links = ("retrive_index", "retrive_next_token", "retrive_next_sibling")

    def outs(dev, idt):
        return {
            "predicts": torch.full((bs * n,), -7, dtype=torch.int64, device=dev),
            "accept_index": torch.full((bs, num_steps + 1), -7, dtype=idt, device=dev),
            "accept_length": torch.full((bs,), -7, dtype=idt, device=dev),
        }

    got = outs(backend.device(), backend.index_dtype)
    backend.kernels.verify_tree_greedy(
        _dev(backend, candidates),
        *[_idx(backend, tree[k]) for k in links],
        _dev(backend, target),
        **got,
    )
    got = {k: v.to("cpu") for k, v in got.items()}
    ref = outs(torch.device("cpu"), torch.int64)
    _ref().verify_tree_greedy(candidates, *[tree[k].long() for k in links], target, **ref)
    for name in ref:
        assert torch.equal(got[name].long(), ref[name]), f"verify_tree_greedy.{name} != reference"
    _check_greedy(got, candidates, target, tree, num_steps)


@FUZZ
@given(shape=_shapes(), mode=st.sampled_from(list(TreeMaskMode)))
def test_nan_draft_scores_stay_in_range(backend, shape, mode):
    """NaN draft probabilities: select/organize still return in-range, distinct, sorted ids,
    and build_tree on them is bounded and agrees with the reference."""
    bs, topk, num_steps, n, seed = shape
    g = torch.Generator().manual_seed(seed)
    steps = _draft_steps(g, bs, topk, num_steps, vocab=20, nan=True)
    selects, (parent_list, selected, tokens) = _drive(
        backend.kernels, steps, topk, n, lambda t: _dev(backend, t), lambda t: _idx(backend, t)
    )
    num_candidates = _num_candidates(topk, num_steps)
    parent_list, selected = parent_list.to("cpu").long(), selected.to("cpu").long()
    width = 0 if num_steps == 1 else topk * (num_steps - 1) + 1  # organize: [bs, 0] when S == 1
    assert selected.shape == (bs, n - 1) and parent_list.shape == (bs, width)
    assert bool(((selected >= 0) & (selected < num_candidates)).all())
    assert bool((selected[:, 1:] > selected[:, :-1]).all()), "ids must be distinct and ascending"
    assert bool(((parent_list >= -1) & (parent_list < num_candidates)).all())
    for ids, hidden, scores, _ in selects:
        assert ids.shape == (bs * topk,) and hidden.shape == (bs * topk, 3)
        assert scores.shape == (bs, topk)
    all_tokens = torch.cat([s[3][1].to("cpu").long() for s in selects], dim=1)
    assert torch.equal(tokens.to("cpu").long(), all_tokens.gather(1, selected))
    seq_lens = torch.randint(0, 12, (bs,), generator=g)
    out = _build_both(backend, parent_list, selected, seq_lens, topk, num_steps, n, mode)
    _check_tree_invariants(out, seq_lens, n, num_steps, mode, well_formed=False)


@FUZZ
@given(shape=_shapes(max_n=24))
def test_select_organize_keep_best_paths(backend, shape):
    """Drive S steps with random draft probabilities and recompute, independently, every
    candidate's cumulative path probability: each level's lanes are its K best candidates (in
    descending order), and the kept N-1 candidates are the N-1 best overall."""
    bs, topk, num_steps, n, seed = shape
    g = torch.Generator().manual_seed(seed)
    steps = _draft_steps(g, bs, topk, num_steps, vocab=30, nan=False)
    selects, (parent_list, selected, tokens) = _drive(
        backend.kernels, steps, topk, n, lambda t: _dev(backend, t), lambda t: _idx(backend, t)
    )
    k = topk
    for b in range(bs):
        p0, i0, h0 = steps[0]
        score = {c: float(p0[b, c]) for c in range(k)}
        token = {c: int(i0[b, c]) for c in range(k)}
        lanes = list(range(k))  # candidate ids of the current lanes, best first
        lane_hidden = [h0[b] for _ in range(k)]
        expected_parents = [-1] + lanes if num_steps > 1 else []  # [bs, 0] when S == 1
        for step in range(1, num_steps):
            ids, hidden, _, level = selects[step - 1]
            assert [int(x) for x in ids.to("cpu")[b * k : (b + 1) * k]] == [token[c] for c in lanes]
            torch.testing.assert_close(
                hidden.to("cpu")[b * k : (b + 1) * k], torch.stack(lane_hidden)
            )
            p, i, h = steps[step]
            base = k + k * k * (step - 1)
            children = {}
            for lane, parent in enumerate(lanes):
                for c in range(k):
                    cid = base + lane * k + c
                    children[cid] = (lane, float(torch.tensor(score[parent]) * p[b * k + lane, c]))
                    token[cid] = int(i[b * k + lane, c])
            best = sorted(children, key=lambda cid: -children[cid][1])[:k]
            lane_hidden = [h[b * k + children[cid][0]] for cid in best]
            score.update({cid: s for cid, (_, s) in children.items()})
            lanes = best
            if step < num_steps - 1:
                expected_parents += lanes
        top = sorted(sorted(score, key=lambda c: -score[c])[: n - 1])
        assert selected[b].to("cpu").long().tolist() == top, "kept ids are not the N-1 best paths"
        assert tokens[b].to("cpu").long().tolist() == [token[c] for c in top]
        assert parent_list[b].to("cpu").long().tolist() == expected_parents


@pytest.mark.parametrize("mode", list(TreeMaskMode))
def test_wide_tree(backend, mode):
    """N > 32: a wide tree (40 nodes, topk 8) agrees with the reference."""
    bs, topk, num_steps, n = 2, 8, 3, 40
    g = torch.Generator().manual_seed(99)
    steps = _draft_steps(g, bs, topk, num_steps, vocab=50, nan=False)
    _, (parent_list, selected, _) = _drive(_ref(), steps, topk, n, lambda t: t, lambda t: t)
    seq_lens = torch.tensor([5, 0])
    out = _build_both(backend, parent_list, selected, seq_lens, topk, num_steps, n, mode)
    _check_tree_invariants(out, seq_lens, n, num_steps, mode, well_formed=True)
