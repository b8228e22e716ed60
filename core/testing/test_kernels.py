"""Conformance: every kernel of ``backend.kernels`` against the reference on seeded random inputs.

Output tensors are poisoned twice (two different sentinels) before the call, so a kernel that
forgets to write an entry fails whatever that entry's correct value is. A few checks also hold
the reference itself to an independent formula (RMSNorm, rotary, sampling laws); KV moves are
the KV pool's (test_kv_pool.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from polyspec.backend import TreeMaskMode

SEED = 20240611


def _gen(seed: int = SEED) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _dev(backend, t: torch.Tensor) -> torch.Tensor:
    """A copy on the backend's device (a copy even there: kernels may write in place)."""
    return t.to(backend.device(), copy=True)


def _idx(backend, t: torch.Tensor) -> torch.Tensor:
    """A copy on the backend's device in its index dtype."""
    return t.to(device=backend.device(), dtype=backend.index_dtype, copy=True)


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu")


def _poisons(dtype: torch.dtype) -> tuple[object, object]:
    """Two sentinels of ``dtype`` that differ in every bit pattern that matters."""
    if dtype == torch.bool:
        return True, False
    if dtype.is_floating_point:
        return float("nan"), -7.0
    return -7, 1234567


def _call_poisoned(fn, args: dict, outs: dict) -> list[dict[str, torch.Tensor]]:
    """Call ``fn(**args, **outs)`` once per sentinel with every out tensor filled with it;
    returns the out tensors (on the CPU) of each call."""
    results = []
    for which in range(2):
        filled = {}
        for name, t in outs.items():
            t = t.clone()
            t.fill_(_poisons(t.dtype)[which])
            filled[name] = t
        fn(**args, **filled)
        results.append({k: _cpu(v) for k, v in filled.items()})
    return results


def _assert_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    actual, expected = _cpu(actual), _cpu(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    if actual.dtype == torch.bool or expected.dtype == torch.bool:
        ok = torch.equal(actual.bool(), expected.bool())
    elif actual.dtype.is_floating_point or expected.dtype.is_floating_point:
        ok = torch.equal(actual.double(), expected.double())
    else:
        ok = torch.equal(actual.long(), expected.long())
    if not ok:
        bad = (actual.double() != expected.double()).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: differs at {bad}\nactual={actual}\nexpected={expected}")


def _check_outs(backend_runs: list[dict], ref_runs: list[dict], kernel: str) -> None:
    for run in backend_runs:
        for name, expected in ref_runs[0].items():
            _assert_equal(run[name], expected, f"{kernel}.{name}")


# ------------------------------------------------------------------------- draft tree kernels


def _draft_inputs(g: torch.Generator, bs: int, topk: int, num_steps: int, vocab: int, feat: int):
    """Random per-step draft outputs: (topk_p, topk_index, hidden) for each step."""
    steps = []
    for step in range(num_steps):
        rows = bs if step == 0 else bs * topk
        logits = torch.randn(rows, vocab, generator=g)
        p, i = logits.softmax(-1).topk(topk, dim=-1)
        steps.append((p, i, torch.randn(rows, feat, generator=g)))
    return steps


def _run_draft(kernels, steps, topk: int, num_draft_tokens: int, to_dev, to_idx):
    """Drive select_top_k over every step (each step's draft hidden states are fresh, so the
    lane routing of hidden states is visible), then organize_draft_results."""
    scores = None
    levels, inputs = [], []
    for step, (p, i, h) in enumerate(steps):
        ids, hidden, scores, level = kernels.select_top_k(
            step, to_dev(p), to_idx(i), to_dev(h), scores, topk
        )
        levels.append(level)
        inputs.append((ids, hidden, scores))
    out = kernels.organize_draft_results(
        [lv[0] for lv in levels],
        [lv[1] for lv in levels],
        [lv[2] for lv in levels],
        num_draft_tokens,
    )
    return inputs, levels, out


@pytest.mark.parametrize("topk,num_steps,num_draft_tokens", [(1, 3, 4), (4, 4, 12), (2, 1, 3)])
def test_select_top_k_and_organize_match_reference(
    backend, reference_backend, topk, num_steps, num_draft_tokens
):
    g = _gen(SEED + topk)
    steps = _draft_inputs(g, bs=3, topk=topk, num_steps=num_steps, vocab=50, feat=8)
    got = _run_draft(
        backend.kernels,
        steps,
        topk,
        num_draft_tokens,
        lambda t: _dev(backend, t),
        lambda t: _idx(backend, t),
    )
    ref = _run_draft(reference_backend.kernels, steps, topk, num_draft_tokens, _cpu, _cpu)
    for step, (a, b) in enumerate(zip(got[0], ref[0])):
        _assert_equal(a[0], b[0], f"select_top_k step {step} input_ids")
        torch.testing.assert_close(_cpu(a[1]), b[1], msg=f"step {step} hidden")
        torch.testing.assert_close(_cpu(a[2]), b[2], msg=f"step {step} scores")
    for step, (a, b) in enumerate(zip(got[1], ref[1])):
        torch.testing.assert_close(_cpu(a[0]), b[0], msg=f"step {step} tree_scores")
        _assert_equal(a[1], b[1], f"step {step} tree_tokens")
        _assert_equal(a[2], b[2], f"step {step} tree_parents")
    for name, a, b in zip(("parent_list", "top_scores_index", "draft_tokens"), got[2], ref[2]):
        _assert_equal(a, b, f"organize_draft_results {name}")


def _tree_outs(backend, bs: int, n: int) -> dict:
    dev, idt = backend.device(), backend.index_dtype
    return {
        "tree_mask": torch.empty(bs, n, n, dtype=torch.bool, device=dev),
        "positions": torch.empty(bs * n, dtype=idt, device=dev),
        "retrive_index": torch.empty(bs, n, dtype=idt, device=dev),
        "retrive_next_token": torch.empty(bs, n, dtype=idt, device=dev),
        "retrive_next_sibling": torch.empty(bs, n, dtype=idt, device=dev),
    }


def _random_tree(seed: int, bs: int, topk: int, num_steps: int, n: int):
    """A well-formed tree from the reference draft pipeline: (parent_list, top_scores_index,
    draft_tokens, seq_lens), all on the CPU."""
    g = _gen(seed)
    steps = _draft_inputs(g, bs, topk, num_steps, vocab=40, feat=4)
    ref = _run_draft(_reference_kernels(), steps, topk, n, _cpu, _cpu)
    parent_list, top_scores_index, draft_tokens = ref[2]
    seq_lens = torch.randint(1, 40, (bs,), generator=g)
    return parent_list, top_scores_index, draft_tokens, seq_lens


def _reference_kernels():
    from polyspec.kernels.reference import reference_kernels

    return reference_kernels()


@pytest.mark.parametrize("topk,num_steps,n", [(1, 4, 5), (4, 3, 10), (3, 5, 40)])
def test_build_tree_matches_reference(backend, reference_backend, topk, num_steps, n):
    bs = 3
    parent_list, tsi, _, seq_lens = _random_tree(SEED + n, bs, topk, num_steps, n)
    mode = TreeMaskMode.TREE_ONLY
    common = {"topk": topk, "num_steps": num_steps, "num_draft_tokens": n, "tree_mask_mode": mode}
    args = {
        "parent_list": _idx(backend, parent_list),
        "top_scores_index": _idx(backend, tsi),
        "seq_lens": _idx(backend, seq_lens),
        **common,
    }
    ref_args = {"parent_list": parent_list, "top_scores_index": tsi, "seq_lens": seq_lens, **common}
    ref_outs = {k: _cpu(v) for k, v in _tree_outs(backend, bs, n).items()}
    got = _call_poisoned(backend.kernels.build_tree, args, _tree_outs(backend, bs, n))
    ref = _call_poisoned(reference_backend.kernels.build_tree, ref_args, ref_outs)
    _check_outs(got, ref, "build_tree")


def _verify_case(seed: int, bs: int, topk: int, num_steps: int, n: int, vocab: int):
    """A random tree with target predictions that often follow a child (long accept paths)."""
    parent_list, tsi, draft_tokens, seq_lens = _random_tree(seed, bs, topk, num_steps, n)
    ref = _reference_kernels()
    outs = _tree_outs(_CPU_INT64, bs, n)
    ref.build_tree(parent_list, tsi, seq_lens, topk, num_steps, n, TreeMaskMode.TREE_ONLY, **outs)
    g = _gen(seed + 1)
    root = torch.randint(0, vocab, (bs, 1), generator=g)
    candidates = torch.cat([root, draft_tokens % vocab], dim=1)  # [bs, N]
    # target after node j: the token of its first child (70%) or a random token.
    first_child = outs["retrive_next_token"]
    follow = candidates.gather(1, first_child.clamp(min=0))
    rand = torch.randint(0, vocab, (bs, n), generator=g)
    use = (torch.rand(bs, n, generator=g) < 0.7) & (first_child >= 0)
    target_predict = torch.where(use, follow, rand)
    return candidates, outs, target_predict


class _CpuInt64:
    """Stand-in for a backend when only device / index dtype are needed (CPU, int64)."""

    index_dtype = torch.int64

    @staticmethod
    def device() -> torch.device:
        return torch.device("cpu")


_CPU_INT64 = _CpuInt64()


def _verify_outs(backend, bs: int, n: int, num_steps: int) -> dict:
    dev, idt = backend.device(), backend.index_dtype
    return {
        "predicts": torch.empty(bs * n, dtype=torch.int64, device=dev),
        "accept_index": torch.empty(bs, num_steps + 1, dtype=idt, device=dev),
        "accept_length": torch.empty(bs, dtype=idt, device=dev),
    }


@pytest.mark.parametrize("topk,num_steps,n", [(1, 5, 6), (4, 4, 16), (8, 3, 64)])
def test_verify_tree_greedy_matches_reference(backend, reference_backend, topk, num_steps, n):
    bs, vocab = 8, 30
    candidates, tree, target_predict = _verify_case(SEED + n, bs, topk, num_steps, n, vocab)
    links = ("retrive_index", "retrive_next_token", "retrive_next_sibling")
    args = {
        "candidates": _dev(backend, candidates),
        **{k: _idx(backend, tree[k]) for k in links},
        "target_predict": _dev(backend, target_predict),
    }
    ref_args = {
        "candidates": candidates,
        **{k: tree[k] for k in links},
        "target_predict": target_predict,
    }
    got = _call_poisoned(
        backend.kernels.verify_tree_greedy, args, _verify_outs(backend, bs, n, num_steps)
    )
    ref = _call_poisoned(
        reference_backend.kernels.verify_tree_greedy,
        ref_args,
        _verify_outs(_CPU_INT64, bs, n, num_steps),
    )
    _check_outs(got, ref, "verify_tree_greedy")
    assert int(ref[0]["accept_length"].max()) >= 2, "test case too weak: no long accept path"


@pytest.mark.parametrize("with_draft_probs", [False, True])
@pytest.mark.parametrize("topk,num_steps,n", [(1, 4, 5), (4, 3, 10)])
def test_verify_tree_sampling_matches_reference(
    backend, reference_backend, with_draft_probs, topk, num_steps, n
):
    bs, vocab = 16, 12
    candidates, tree, _ = _verify_case(SEED + 7 * n, bs, topk, num_steps, n, vocab)
    g = _gen(SEED + 3)
    # Peaked targets so that children are often accepted and rejections also happen.
    target_probs = (3.0 * torch.randn(bs, n, vocab, generator=g)).softmax(-1)
    target_probs.scatter_add_(2, candidates.roll(-1, 1).unsqueeze(2), torch.full((bs, n, 1), 2.0))
    target_probs /= target_probs.sum(-1, keepdim=True)
    draft_probs = torch.randn(bs, n, vocab, generator=g).softmax(-1) if with_draft_probs else None
    coins = torch.rand(bs, n, generator=g)
    final_coins = torch.rand(bs, generator=g)
    links = ("retrive_index", "retrive_next_token", "retrive_next_sibling")
    ref_args = {
        "candidates": candidates,
        **{k: tree[k] for k in links},
        "target_probs": target_probs,
        "draft_probs": draft_probs,
        "coins": coins,
        "final_coins": final_coins,
    }
    args = {
        "candidates": _dev(backend, candidates),
        **{k: _idx(backend, tree[k]) for k in links},
        "target_probs": _dev(backend, target_probs),
        "draft_probs": None if draft_probs is None else _dev(backend, draft_probs),
        "coins": _dev(backend, coins),
        "final_coins": _dev(backend, final_coins),
    }
    got = _call_poisoned(
        backend.kernels.verify_tree_sampling, args, _verify_outs(backend, bs, n, num_steps)
    )
    ref = _call_poisoned(
        reference_backend.kernels.verify_tree_sampling,
        ref_args,
        _verify_outs(_CPU_INT64, bs, n, num_steps),
    )
    _check_outs(got, ref, "verify_tree_sampling")
    # The reference against the loop oracle (draws within 1e-4 of a threshold left out), and
    # the case reaches a sibling accepted after a rejection when the tree has siblings.
    from polyspec.testing import oracles

    later = 0
    for b in range(bs):
        want = oracles.verify_sampling(
            candidates[b].tolist(), tree["retrive_index"][b].tolist(),
            tree["retrive_next_token"][b].tolist(), tree["retrive_next_sibling"][b].tolist(),
            target_probs[b].double().tolist(),
            None if draft_probs is None else draft_probs[b].double().tolist(),
            coins[b].tolist(), float(final_coins[b]), num_steps,
        )  # fmt: skip
        if want.margin < 1e-4:
            continue
        later += want.later_acceptances
        assert ref[0]["accept_index"][b].tolist() == want.accept_index, f"request {b}"
        emitted = {g: int(ref[0]["predicts"][g]) for g in want.predicts}
        assert emitted == want.predicts, f"request {b}"
    assert topk == 1 or later > 0, "test case too weak: no sibling accepted after a rejection"
    # Repeating with the same coins is deterministic.
    again = _call_poisoned(
        backend.kernels.verify_tree_sampling, args, _verify_outs(backend, bs, n, num_steps)
    )
    _check_outs(again, got, "verify_tree_sampling (repeat)")


def _chi_square_critical(df: int, z: float = 4.753) -> float:
    """Upper chi-square quantile at p ~ 1e-6 (z = 4.753), Wilson-Hilferty approximation."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def _chi_square(counts: torch.Tensor, expected_p: torch.Tensor, total: int) -> tuple[float, int]:
    expected = expected_p.double() * total
    keep = expected > 0
    assert int(counts[~keep].sum()) == 0, f"outcomes of probability 0 were drawn: {counts}"
    stat = float(((counts[keep].double() - expected[keep]) ** 2 / expected[keep]).sum())
    return stat, int(keep.sum()) - 1


def test_verify_tree_sampling_target_only_is_lossless(backend):
    """With target-only drafts, the emitted pair (first token, second token or END) follows the
    target's law: x1 ~ p_root; if x1 is a root child's token, x2 ~ p_child; else END.
    The tree has a duplicate child token and one grandchild, so rejections, residual updates and
    a second depth are all exercised.
    20000 trials in one batched call, chi-square at p ~ 1e-6 (seeded: deterministic)."""
    trials, vocab, n, num_steps = 20000, 6, 5, 2
    # Tree: root -> nodes 1 (token 2), 2 (token 0), 3 (token 2, duplicate); node 1 -> node 4.
    candidates = torch.tensor([5, 2, 0, 2, 4])
    next_token = torch.tensor([1, 4, -1, -1, -1])
    next_sibling = torch.tensor([-1, 2, 3, -1, -1])
    p = torch.tensor(
        [
            [0.10, 0.05, 0.40, 0.05, 0.15, 0.25],  # after the root
            [0.30, 0.10, 0.10, 0.10, 0.20, 0.20],  # after node 1 (token 2)
            [1.0 / 6] * 6,
            [1.0 / 6] * 6,
            [1.0 / 6] * 6,
        ]
    )
    g = _gen(SEED + 11)
    dev = backend.device()
    out = _verify_outs(backend, trials, n, num_steps)
    backend.kernels.verify_tree_sampling(
        candidates=candidates.expand(trials, n).to(dev),
        retrive_index=_idx(backend, torch.arange(trials * n).view(trials, n)),
        retrive_next_token=_idx(backend, next_token.expand(trials, n)),
        retrive_next_sibling=_idx(backend, next_sibling.expand(trials, n)),
        target_probs=p.expand(trials, n, vocab).contiguous().to(dev),
        draft_probs=None,
        coins=torch.rand(trials, n, generator=g).to(dev),
        final_coins=torch.rand(trials, generator=g).to(dev),
        **out,
    )
    predicts = _cpu(out["predicts"]).view(trials, n)
    length = _cpu(out["accept_length"]).long()
    first = _cpu(out["accept_index"]).long()[:, 1] % n  # node accepted at depth 1
    x1 = predicts[:, 0]
    x2 = torch.where(length >= 1, predicts.gather(1, first.unsqueeze(1)).squeeze(1), vocab)
    # A child is accepted exactly when its token is emitted; the duplicate (node 3) never is.
    assert torch.equal(length >= 1, (x1 == 2) | (x1 == 0))
    assert int(((length >= 1) & (first == 3)).sum()) == 0
    continues = {2: p[1], 0: p[2]}  # emitted child token -> law of the next token
    expected = torch.zeros(vocab, vocab + 1, dtype=torch.float64)
    for a in range(vocab):
        if a in continues:
            expected[a, :vocab] = p[0, a] * continues[a]
        else:
            expected[a, vocab] = p[0, a]
    counts = torch.bincount(x1 * (vocab + 1) + x2, minlength=vocab * (vocab + 1))
    stat, df = _chi_square(counts, expected.flatten(), trials)
    assert stat < _chi_square_critical(df), f"chi2={stat:.1f} df={df}: not the target law"


def test_verify_tree_sampling_with_draft_probs_is_lossless(backend):
    """Children drawn i.i.d. from draft_probs: the first emitted token still follows the target.
    20000 trials, 3 sampled children each, chi-square at p ~ 1e-6."""
    trials, vocab, n = 20000, 6, 4
    g = _gen(SEED + 12)
    p = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
    q = torch.tensor([0.30, 0.05, 0.25, 0.10, 0.10, 0.20])
    children = torch.multinomial(q, trials * 3, replacement=True, generator=g).view(trials, 3)
    candidates = torch.cat([torch.zeros(trials, 1, dtype=torch.long), children], dim=1)
    probs = torch.zeros(n, vocab)
    probs[:] = p
    dev = backend.device()
    out = _verify_outs(backend, trials, n, 1)
    backend.kernels.verify_tree_sampling(
        candidates=candidates.to(dev),
        retrive_index=_idx(backend, torch.arange(trials * n).view(trials, n)),
        retrive_next_token=_idx(backend, torch.tensor([1, -1, -1, -1]).expand(trials, n)),
        retrive_next_sibling=_idx(backend, torch.tensor([-1, 2, 3, -1]).expand(trials, n)),
        target_probs=probs.expand(trials, n, vocab).contiguous().to(dev),
        draft_probs=q.expand(trials, n, vocab).contiguous().to(dev),
        coins=torch.rand(trials, n, generator=g).to(dev),
        final_coins=torch.rand(trials, generator=g).to(dev),
        **out,
    )
    x1 = _cpu(out["predicts"]).view(trials, n)[:, 0]
    stat, df = _chi_square(torch.bincount(x1, minlength=vocab), p, trials)
    assert stat < _chi_square_critical(df), f"chi2={stat:.1f} df={df}: not the target law"
    assert 0 < int(_cpu(out["accept_length"]).sum()) < trials


# -------------------------------------------------------------------------- slot bookkeeping


@pytest.mark.parametrize("topk,num_steps,page_size", [(1, 3, 1), (4, 3, 1), (4, 5, 4), (2, 2, 16)])
def test_assign_draft_cache_locs_matches_reference(
    backend, reference_backend, topk, num_steps, page_size
):
    g = _gen(SEED + page_size)
    bs, rows, cols = 4, 6, 64
    width = (
        num_steps if page_size == 1 else page_size * -(-(page_size - 1 + num_steps) // page_size)
    )
    req_to_token = torch.randint(1, 10000, (rows, cols), generator=g)
    req_pool_indices = torch.randperm(rows, generator=g)[:bs]
    seq_lens = torch.randint(1, cols - 1, (bs,), generator=g)
    seq_lens[0] = page_size * 2  # tail 0
    alloc_slots = torch.randperm(20000, generator=g)[: bs * topk * width] + 1
    copies = bs * topk * (page_size - 1)

    def outs(b):
        dev, idt = b.device(), b.index_dtype
        return {
            "lane_locs": torch.empty(bs, topk, width, dtype=idt, device=dev),
            "tail_lens": torch.empty(bs, dtype=idt, device=dev),
            "copy_src": torch.empty(copies, dtype=idt, device=dev),
            "copy_dst": torch.empty(copies, dtype=idt, device=dev),
        }

    common = {"topk": topk, "num_steps": num_steps, "page_size": page_size}
    args = {
        "req_pool_indices": _idx(backend, req_pool_indices),
        "req_to_token": _idx(backend, req_to_token),
        "seq_lens": _idx(backend, seq_lens),
        "alloc_slots": _idx(backend, alloc_slots),
        **common,
    }
    ref_args = {
        "req_pool_indices": req_pool_indices,
        "req_to_token": req_to_token,
        "seq_lens": seq_lens,
        "alloc_slots": alloc_slots,
        **common,
    }
    got = _call_poisoned(backend.kernels.assign_draft_cache_locs, args, outs(backend))
    ref = _call_poisoned(
        reference_backend.kernels.assign_draft_cache_locs, ref_args, outs(_CPU_INT64)
    )
    _check_outs(got, ref, "assign_draft_cache_locs")
    # Independent spot check of the reference: lane 1 of request 1 copies the prefix tail.
    r = ref[0]
    tail = int(seq_lens[1]) % page_size
    assert int(r["tail_lens"][1]) == tail
    if page_size > 1 and topk > 1 and tail > 0:
        at = (1 * topk + 1) * (page_size - 1)
        src = req_to_token[req_pool_indices[1], int(seq_lens[1]) - tail : int(seq_lens[1])]
        _assert_equal(r["copy_src"][at : at + tail], src, "copy_src tail")
        _assert_equal(r["copy_dst"][at : at + tail], r["lane_locs"][1, 1, :tail], "copy_dst tail")


def _segments_case(g: torch.Generator, bs: int, rows: int, cols: int):
    req_pool_indices = torch.randperm(rows, generator=g)[:bs]
    start = torch.randint(0, cols // 2, (bs,), generator=g)
    lens = torch.randint(0, cols // 2, (bs,), generator=g)
    lens[1] = 0  # an empty segment
    return req_pool_indices, start, start + lens


def test_assign_req_to_token_and_extend_cache_locs_match_reference(backend, reference_backend):
    g = _gen(SEED + 21)
    bs, rows, cols = 5, 8, 40
    req_pool_indices, start, end = _segments_case(g, bs, rows, cols)
    total = int((end - start).sum())
    slots = torch.randperm(10000, generator=g)[:total] + 1
    table = torch.randint(1, 10000, (rows, cols), generator=g)

    got_table = _idx(backend, table)
    backend.kernels.assign_req_to_token(
        _idx(backend, req_pool_indices),
        got_table,
        _idx(backend, start),
        _idx(backend, end),
        _idx(backend, slots),
    )
    ref_table = table.clone()
    reference_backend.kernels.assign_req_to_token(req_pool_indices, ref_table, start, end, slots)
    _assert_equal(got_table, ref_table, "assign_req_to_token")
    b = 2  # independent check of one segment
    seg_at = int((end - start)[:b].sum())
    seg = slots[seg_at : seg_at + int(end[b] - start[b])]
    _assert_equal(ref_table[req_pool_indices[b], start[b] : end[b]], seg, "segment 2")

    args = {
        "req_pool_indices": _idx(backend, req_pool_indices),
        "req_to_token": _idx(backend, table),
        "start": _idx(backend, start),
        "end": _idx(backend, end),
    }
    ref_args = {
        "req_pool_indices": req_pool_indices,
        "req_to_token": table,
        "start": start,
        "end": end,
    }
    got = _call_poisoned(
        backend.kernels.assign_extend_cache_locs,
        args,
        {"out": torch.empty(total, dtype=backend.index_dtype, device=backend.device())},
    )
    ref = _call_poisoned(
        reference_backend.kernels.assign_extend_cache_locs,
        ref_args,
        {"out": torch.empty(total, dtype=torch.int64)},
    )
    _check_outs(got, ref, "assign_extend_cache_locs")
    expected = torch.cat([table[r, s:e] for r, s, e in zip(req_pool_indices, start, end)])
    _assert_equal(ref[0]["out"], expected, "assign_extend_cache_locs (independent)")


def test_assign_block_cache_locs_matches_reference(backend, reference_backend):
    """A captured forward's fixed-width blocks: each request's slots from its start, the
    padding slot 0 past its length (a padding request: length 0), positions clamped into
    the table (a block running past its last column)."""
    g = _gen(SEED + 22)
    bs, rows, cols, width = 5, 8, 40, 6
    req_pool_indices = torch.randperm(rows, generator=g)[:bs]
    start = torch.tensor([0, 7, 36, 20, 3])  # request 2's block runs past column 39
    lens = torch.tensor([6, 0, 4, 3, 1])
    table = torch.randint(1, 10000, (rows, cols), generator=g)
    n = bs * width
    got = _call_poisoned(
        backend.kernels.assign_block_cache_locs,
        {"req_pool_indices": _idx(backend, req_pool_indices), "req_to_token": _idx(backend, table),
         "start": _idx(backend, start), "lens": _idx(backend, lens), "width": width},
        {"out_loc": torch.empty(n, dtype=backend.index_dtype, device=backend.device()),
         "positions": torch.empty(n, dtype=torch.int64, device=backend.device())},
    )  # fmt: skip
    ref = _call_poisoned(
        reference_backend.kernels.assign_block_cache_locs,
        {"req_pool_indices": req_pool_indices, "req_to_token": table, "start": start,
         "lens": lens, "width": width},
        {"out_loc": torch.empty(n, dtype=torch.int64),
         "positions": torch.empty(n, dtype=torch.int64)},
    )  # fmt: skip
    _check_outs(got, ref, "assign_block_cache_locs")
    pos = [[min(int(s) + j, cols - 1) for j in range(width)] for s in start]
    loc = [
        [int(table[r, p]) if j < int(m) else 0 for j, p in enumerate(ps)]
        for r, m, ps in zip(req_pool_indices, lens, pos)
    ]
    _assert_equal(ref[0]["positions"], torch.tensor(pos).flatten(), "positions (independent)")
    _assert_equal(ref[0]["out_loc"], torch.tensor(loc).flatten(), "out_loc (independent)")


def _accept_case(g: torch.Generator, bs: int, num_steps: int, n: int, cols: int):
    """Accepted paths as verify leaves them: root first, then nodes of the tree (global ids
    b*N + j), -1 past the path; request 1 is a graph's padding request (width 0) and request
    2 ends near the table's last column (positions clamp)."""
    depth = num_steps + 1
    accept_length = torch.randint(0, depth, (bs,), generator=g)
    accept_length[0] = num_steps  # a whole path
    accept_index = torch.full((bs, depth), -1)
    for b in range(bs):
        nodes = torch.randperm(n - 1, generator=g)[: int(accept_length[b])] + 1
        accept_index[b, 0] = b * n
        accept_index[b, 1 : 1 + nodes.numel()] = nodes.sort().values + b * n
    seq_lens = torch.randint(0, cols - n, (bs,), generator=g)
    seq_lens[2] = cols - 2
    widths = torch.full((bs,), n)
    widths[1] = 0
    return seq_lens, widths, accept_index, accept_length


@pytest.mark.parametrize("num_steps,n", [(3, 8), (1, 2), (5, 16)])
def test_assign_accept_locs_matches_reference(backend, reference_backend, num_steps, n):
    g = _gen(SEED + 24 + num_steps)
    bs, rows, cols = 5, 9, 48
    depth = num_steps + 1
    req_pool_indices = torch.randperm(rows, generator=g)[:bs]
    table = torch.randint(1, 10000, (rows, cols), generator=g)
    seq_lens, widths, accept_index, accept_length = _accept_case(g, bs, num_steps, n, cols)
    names = ("req_pool_indices", "req_to_token", "seq_lens", "widths", "accept_index")
    values = (req_pool_indices, table, seq_lens, widths, accept_index)
    args = {k: _idx(backend, v) for k, v in zip(names, values)}
    args |= {"accept_length": _idx(backend, accept_length), "num_draft_tokens": n}
    ref_args = dict(zip(names, values)) | {"accept_length": accept_length, "num_draft_tokens": n}

    def outs(device, index_dtype) -> dict[str, torch.Tensor]:
        flat = {k: torch.empty(bs * depth, dtype=index_dtype, device=device)
                for k in ("src_loc", "dst_loc")}  # fmt: skip
        flat |= {k: torch.empty(bs * depth, dtype=torch.int64, device=device)
                 for k in ("positions", "path_node", "last_index")}  # fmt: skip
        flat["last_index"] = flat["last_index"][:bs]
        return flat | {"extend_lens": torch.empty(bs, dtype=index_dtype, device=device)}

    got = _call_poisoned(
        backend.kernels.assign_accept_locs, args, outs(backend.device(), backend.index_dtype)
    )
    ref = _call_poisoned(
        reference_backend.kernels.assign_accept_locs, ref_args, outs("cpu", torch.int64)
    )
    _check_outs(got, ref, "assign_accept_locs")

    # The reference against the formula, entry by entry.
    r = ref[0]
    for b in range(bs):
        row, s, a = int(req_pool_indices[b]), int(seq_lens[b]), int(accept_length[b])
        active = int(widths[b]) > 0
        assert int(r["extend_lens"][b]) == (a + 1 if active else 0)
        assert int(r["last_index"][b]) == b * depth + (a if active else 0)
        for d in range(depth):
            e = b * depth + d
            pos = min(s + d, cols - 1)
            assert int(r["positions"][e]) == pos
            assert int(r["path_node"][e]) == int(accept_index[b, min(d, a)])
            if active and d <= a:
                j = int(accept_index[b, d]) - b * n
                assert int(r["src_loc"][e]) == int(table[row, min(s + j, cols - 1)])
                assert int(r["dst_loc"][e]) == int(table[row, pos])
            else:
                assert int(r["src_loc"][e]) == int(r["dst_loc"][e]) == 0


# ----------------------------------------------------------------------------- model kernels

_TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
}


def _model_dtypes(backend) -> list[torch.dtype]:
    return [getattr(torch, d) for d in backend.capabilities.dtypes]


def test_rms_norm_and_fused_add_match_reference(backend, reference_backend):
    g = _gen(SEED + 31)
    for dtype in _model_dtypes(backend):
        x = (3 * torch.randn(7, 64, generator=g)).to(dtype)
        res = torch.randn(7, 64, generator=g).to(dtype)
        w = (1 + 0.1 * torch.randn(64, generator=g)).to(dtype)
        x0, res0 = x.clone(), res.clone()
        got = backend.kernels.rms_norm(_dev(backend, x), _dev(backend, w), 1e-6)
        ref = reference_backend.kernels.rms_norm(x, w, 1e-6)
        assert got.dtype == ref.dtype
        torch.testing.assert_close(_cpu(got), ref, **_TOL[dtype])
        xf = x.float()
        normed = (xf / (xf.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()).to(dtype)
        torch.testing.assert_close(ref, w * normed, **_TOL[dtype])  # independent formula
        got_n, got_s = backend.kernels.fused_add_rms_norm(
            _dev(backend, x), _dev(backend, res), _dev(backend, w), 1e-6
        )
        ref_n, ref_s = reference_backend.kernels.fused_add_rms_norm(x, res, w, 1e-6)
        torch.testing.assert_close(_cpu(got_s), ref_s, **_TOL[dtype])
        torch.testing.assert_close(_cpu(got_n), ref_n, **_TOL[dtype])
        torch.testing.assert_close(ref_n, reference_backend.kernels.rms_norm(x + res, w, 1e-6))
        _assert_equal(x, x0, "fused_add_rms_norm modified x")
        _assert_equal(res, res0, "fused_add_rms_norm modified residual")


def test_draft_layer_input_matches_reference(backend, reference_backend):
    """An EAGLE-3 head's layer input: both halves are the backend's own RMSNorm of the
    embedding rows and of the features (so the draft computes what the separate kernels did),
    and close to the reference."""
    g = _gen(SEED + 34)
    for dtype in _model_dtypes(backend):
        embed = (2 * torch.randn(40, 64, generator=g)).to(dtype)
        feats = (3 * torch.randn(6, 64, generator=g)).to(dtype)
        w_e, w_f = ((1 + 0.1 * torch.randn(64, generator=g)).to(dtype) for _ in range(2))
        ids = torch.tensor([3, 0, 39, 3, 17, 8])
        got = backend.kernels.draft_layer_input(
            _idx(backend, ids), _dev(backend, embed), _dev(backend, feats), _dev(backend, w_e),
            _dev(backend, w_f), 1e-6,
        )  # fmt: skip
        ref = reference_backend.kernels.draft_layer_input(ids, embed, feats, w_e, w_f, 1e-6)
        assert got.dtype == ref.dtype == dtype and got.shape == ref.shape == (6, 128)
        torch.testing.assert_close(_cpu(got), ref, **_TOL[dtype])
        norm = reference_backend.kernels.rms_norm
        _assert_equal(ref, torch.cat([norm(embed[ids], w_e, 1e-6), norm(feats, w_f, 1e-6)], -1),
                      "the reference's halves")  # fmt: skip
        own = backend.kernels.rms_norm
        halves = (own(_dev(backend, embed[ids]), _dev(backend, w_e), 1e-6),
                  own(_dev(backend, feats), _dev(backend, w_f), 1e-6))  # fmt: skip
        _assert_equal(_cpu(got), _cpu(torch.cat(halves, -1)), "the backend's own RMSNorms")


def _cos_sin_cache(max_pos: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    freqs = torch.arange(max_pos, dtype=torch.float32).unsqueeze(1) * inv
    return torch.cat([freqs.cos(), freqs.sin()], dim=1)  # [max_pos, dim]


@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_embedding_matches_reference(backend, reference_backend, is_neox):
    g = _gen(SEED + 32)
    dim, max_pos = 16, 64
    cache = _cos_sin_cache(max_pos, dim)
    positions = torch.randint(0, max_pos, (9,), generator=g)
    for dtype in _model_dtypes(backend):
        q = torch.randn(9, 4, dim, generator=g).to(dtype)
        k = torch.randn(9, 2, dim, generator=g).to(dtype)
        gq, gk = backend.kernels.rotary_embedding(
            _idx(backend, positions),
            _dev(backend, q),
            _dev(backend, k),
            _dev(backend, cache),
            is_neox,
        )
        rq, rk = reference_backend.kernels.rotary_embedding(positions, q, k, cache, is_neox)
        assert gq.dtype == dtype and gk.dtype == dtype
        torch.testing.assert_close(_cpu(gq), rq, **_TOL[dtype])
        torch.testing.assert_close(_cpu(gk), rk, **_TOL[dtype])
    # Independent: complex multiplication by e^{i * pos * theta}.
    q = torch.randn(9, 4, dim, generator=g)
    rq, _ = reference_backend.kernels.rotary_embedding(positions, q, q[:, :2], cache, is_neox)
    half = dim // 2
    angle = positions.float().unsqueeze(1) * (
        1.0 / 10000.0 ** (torch.arange(0, dim, 2).float() / dim)
    )
    rot = torch.polar(torch.ones_like(angle), angle).unsqueeze(1)  # [T, 1, D/2]
    if is_neox:
        z = torch.complex(q[..., :half], q[..., half:]) * rot
        expected = torch.cat([z.real, z.imag], dim=-1)
    else:
        z = torch.complex(q[..., 0::2], q[..., 1::2]) * rot
        expected = torch.stack([z.real, z.imag], dim=-1).flatten(-2)
    torch.testing.assert_close(rq, expected, atol=1e-5, rtol=1e-5)


def test_silu_and_mul_matches_reference(backend, reference_backend):
    g = _gen(SEED + 33)
    for dtype in _model_dtypes(backend):
        x = torch.randn(5, 2 * 24, generator=g).to(dtype)
        got = backend.kernels.silu_and_mul(_dev(backend, x))
        ref = reference_backend.kernels.silu_and_mul(x)
        assert got.dtype == dtype and got.shape == (5, 24)
        torch.testing.assert_close(_cpu(got), ref, **_TOL[dtype])
        xf = x.float()
        expected = (xf[:, :24] * torch.sigmoid(xf[:, :24]) * xf[:, 24:]).to(dtype)
        torch.testing.assert_close(ref, expected, **_TOL[dtype])


@pytest.mark.parametrize("k", [1, 3, 8])
def test_softmax_topk_matches_reference(backend, k):
    """The draft's top-k: the same ids (as a set of logits: equal ones may swap) in descending
    order, and the softmax probabilities within fp32 rounding."""
    from polyspec.kernels import reference

    g = _gen(SEED + 34)
    for dtype in _model_dtypes(backend):
        for rows, vocab in ((3, 1000), (1, 13)):
            logits = (4 * torch.randn(rows, vocab, generator=g)).to(dtype)
            logits[0, 7] = logits[0, 9] = logits[0].max() + 1  # a tie at the top
            p, idx = backend.kernels.softmax_topk(_dev(backend, logits), k)
            want_p, want_idx = reference.softmax_topk(logits, k)
            assert p.dtype == torch.float32 and p.shape == (rows, k)
            assert idx.dtype == torch.int64 and idx.shape == (rows, k)
            torch.testing.assert_close(_cpu(p), want_p, rtol=1e-5, atol=1e-7)
            lf = logits.float()
            assert torch.equal(lf.gather(1, _cpu(idx)), lf.gather(1, want_idx))
            assert (_cpu(p)[:, :-1] >= _cpu(p)[:, 1:]).all(), "not in descending order"
            full = torch.softmax(lf, dim=-1)  # independent formula
            torch.testing.assert_close(want_p, full.gather(1, want_idx))
            # ids through an EAGLE head's draft -> target map
            index_map = torch.randperm(vocab, generator=g) * 3 + 5
            mp, midx = backend.kernels.softmax_topk(
                _dev(backend, logits), k, index_map=_dev(backend, index_map)
            )
            assert midx.dtype == torch.int64 and torch.equal(_cpu(mp), _cpu(p))
            assert torch.equal(_cpu(midx), index_map[_cpu(idx)])


# -------------------------------------------------------------------------- sampling helpers


def test_top_k_top_p_renorm_matches_reference(backend, reference_backend):
    g = _gen(SEED + 41)
    bs, vocab = 8, 50
    probs = (2 * torch.randn(bs, vocab, generator=g)).softmax(-1)
    top_k = torch.tensor([0, 1, 5, 50, 70, 10, -1, 3])
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.3, 0.95, 1.0, 0.01, 0.0])
    got = backend.kernels.top_k_top_p_renorm(
        _dev(backend, probs), _idx(backend, top_k), _dev(backend, top_p)
    )
    ref = reference_backend.kernels.top_k_top_p_renorm(probs, top_k, top_p)
    torch.testing.assert_close(_cpu(got), ref, atol=1e-6, rtol=1e-5)
    _assert_equal(_cpu(got) > 0, ref > 0, "top_k_top_p_renorm support")
    # Independent hand-computed case.
    p = torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.1, 0.4, 0.2, 0.3], [0.1, 0.4, 0.2, 0.3]])
    out = reference_backend.kernels.top_k_top_p_renorm(
        p, torch.tensor([0, 3, 2]), torch.tensor([0.65, 1.0, 0.5])
    )
    expected = torch.tensor(
        [[0.0, 4 / 7, 0.0, 3 / 7], [0.0, 4 / 9, 2 / 9, 3 / 9], [0.0, 1.0, 0.0, 0.0]]
    )
    torch.testing.assert_close(out, expected)


def test_sample_matches_reference_and_law(backend, reference_backend):
    g = _gen(SEED + 42)
    bs, vocab = 20000, 8
    p = torch.tensor([0.02, 0.3, 0.1, 0.0, 0.18, 0.25, 0.1, 0.05])
    probs = p.expand(bs, vocab).contiguous()
    noise = torch.empty(bs, vocab).exponential_(generator=g)
    got = backend.kernels.sample(_dev(backend, probs), _dev(backend, noise))
    ref = reference_backend.kernels.sample(probs, noise)
    _assert_equal(got, ref, "sample")
    assert _cpu(got).dtype == torch.int64
    stat, df = _chi_square(torch.bincount(ref, minlength=vocab), p, bs)
    assert stat < _chi_square_critical(df), f"chi2={stat:.1f} df={df}: sample is not exact"


# -------------------------------------------------------------------------- structured output


def _bitmask_case(g: torch.Generator, rows: int, vocab: int, width: int):
    """Random bitmasks (one all-ones row, one allowing a single token) and the allowed set
    decoded bit by bit in Python, independently of either kernel."""
    words = torch.randint(-(2**31), 2**31, (rows, width), generator=g, dtype=torch.int64)
    mask = words.to(torch.int32)
    mask[0] = -1  # an unconstrained row of a mixed batch
    if rows > 1:
        mask[1] = 0
        mask[1, 1] = 1 << 3  # token 35 alone
    allowed = torch.zeros(rows, vocab, dtype=torch.bool)
    for r, row in enumerate(mask.tolist()):
        for t in range(min(vocab, 32 * width)):
            allowed[r, t] = bool((row[t // 32] >> (t % 32)) & 1)
    return mask, allowed


def test_apply_token_bitmask_matches_reference(backend):
    """-inf exactly where the row's bit is clear (and past 32 * W), every other logit
    unchanged, an all-ones row untouched; widths shorter and longer than the vocabulary,
    batches with and without an all-ones row, logits that are a view into wider rows."""
    from polyspec.kernels import reference

    g = _gen(SEED + 51)
    for dtype in (torch.float32, *_model_dtypes(backend)):
        for rows, vocab, width in ((4, 300, 10), (3, 1000, 30), (2, 70, 3)):
            logits = (4 * torch.randn(rows, vocab, generator=g)).to(dtype)
            mask, allowed = _bitmask_case(g, rows, vocab, width)
            want = logits.clone()
            reference.apply_token_bitmask(want, mask)
            expected = torch.where(allowed, logits, torch.tensor(float("-inf"), dtype=dtype))
            assert torch.equal(want, expected), "reference"
            got = _dev(backend, logits)
            backend.kernels.apply_token_bitmask(got, _dev(backend, mask))
            assert torch.equal(_cpu(got), expected), f"{dtype} {rows}x{vocab} W={width}"
            # no all-ones row in the batch
            got = _dev(backend, logits[1:])
            backend.kernels.apply_token_bitmask(got, _dev(backend, mask[1:]))
            assert torch.equal(_cpu(got), expected[1:]), f"{dtype} {rows - 1}x{vocab} W={width}"
            # logits that are columns of a wider tensor: written in place, nothing beside
            wide = _dev(backend, torch.zeros(rows, vocab + 5, dtype=dtype))
            wide[:, 2 : 2 + vocab] = _dev(backend, logits)
            backend.kernels.apply_token_bitmask(wide[:, 2 : 2 + vocab], _dev(backend, mask))
            wide = _cpu(wide)
            assert torch.equal(wide[:, 2 : 2 + vocab], expected), f"{dtype} a strided view"
            assert not wide[:, :2].any() and not wide[:, 2 + vocab :].any()


def test_argmax_matches_reference(backend):
    """Each row's greedy token, as the reference gives it (the first index of the row's
    maximum): ties inside and far apart in a row, a row of -inf (index 0), logits in float32
    and the backend's model dtypes, a vocabulary of SmolLM2's size, a strided view."""
    from polyspec.kernels import reference

    g = _gen(SEED + 61)
    for dtype in (torch.float32, *_model_dtypes(backend)):
        for rows, vocab in ((1, 49152), (6, 5000), (3, 7)):
            logits = (4 * torch.randn(rows, vocab, generator=g)).to(dtype)
            if vocab > 4000:
                logits[0, [17, vocab - 3]] = 1000.0  # a tie far apart: the first index
            if rows > 2:
                logits[1, [2, 3]] = 1000.0  # a tie of neighbours
                logits[2] = float("-inf")
            want = reference.argmax(logits)
            if vocab > 4000:
                assert want[0] == 17
            got = backend.kernels.argmax(_dev(backend, logits))
            assert torch.equal(_cpu(got).long(), want), f"{dtype} {rows}x{vocab}"
        wide = (4 * torch.randn(2, 300, generator=g)).to(dtype)
        got = backend.kernels.argmax(_dev(backend, wide)[:, 100:250])
        assert torch.equal(_cpu(got).long(), reference.argmax(wide[:, 100:250])), "a view"
