"""Conformance: the draft-tree kernels against independent loop oracles (:mod:`.oracles`).

"Matches the reference" compares the reference with itself on the cpu backend; these tests
hold ``backend.kernels`` (and the reference kernels, where the backend has its own) to
plain-loop versions of the documented algorithms on seeded random cases, well-formed and
corrupted. The sampling cases are built to reach every branch (siblings, a rejection, a later
acceptance, draws an un-normalised residual would decide the other way), and each test asserts
that its cases did.
"""

from __future__ import annotations

import random

import pytest
import torch

from polyspec.backend import TreeMaskMode
from polyspec.kernels.reference import reference_kernels
from polyspec.testing import oracles

CASES = 40


class _Reference:
    """The reference kernels on the CPU with int64 indices, in the place of a backend."""

    index_dtype = torch.int64
    kernels = reference_kernels()

    @staticmethod
    def device() -> torch.device:
        return torch.device("cpu")


def _under_test(backend, kernel: str) -> list:
    """The backend, plus the reference kernels when the backend's ``kernel`` is not the
    reference function itself (the cpu backend's tree kernels switch to C++ loops once its
    extension is loaded; other backends have their own)."""
    ref = _Reference()
    same = getattr(backend.kernels, kernel) is getattr(ref.kernels, kernel)
    return [backend] if same else [backend, ref]


def _idx(be, values) -> torch.Tensor:
    return torch.as_tensor(values).to(device=be.device(), dtype=be.index_dtype)


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu")


def _draft_steps(g: torch.Generator, bs: int, topk: int, num_steps: int, vocab: int):
    steps = []
    for step in range(num_steps):
        rows = bs if step == 0 else bs * topk
        p, i = (2 * torch.randn(rows, vocab, generator=g)).softmax(-1).topk(topk, dim=-1)
        steps.append((p, i, torch.randn(rows, 3, generator=g)))
    return steps


def _shape(rng: random.Random, max_n: int = 16) -> tuple[int, int, int, int]:
    topk, num_steps = rng.randint(1, 4), rng.randint(1, 4)
    cands = topk + (num_steps - 1) * topk * topk
    return rng.randint(1, 3), topk, num_steps, rng.randint(2, min(max_n, cands + 1))


# ----------------------------------------------------------------------- draft-tree selection


def test_draft_tree_selection_matches_oracle(backend):
    rng = random.Random(101)
    for case in range(CASES):
        bs, topk, num_steps, n = _shape(rng, max_n=24)
        g = torch.Generator().manual_seed(case)
        steps = _draft_steps(g, bs, topk, num_steps, vocab=30)
        want = oracles.draft_tree(steps, topk, n)
        for be in _under_test(backend, "select_top_k"):
            dev, k = be.device(), be.kernels
            scores, levels = None, []
            for step, (p, i, h) in enumerate(steps):
                ids, hidden, scores, level = k.select_top_k(
                    step, p.to(dev), _idx(be, i), h.to(dev), scores, topk
                )
                levels.append(level)
                what = f"case {case} (bs {bs} K {topk} S {num_steps} N {n}) step {step}"
                assert _cpu(ids).view(bs, topk).tolist() == want.input_ids[step], what
                rows = torch.tensor(want.lane_rows[step]).flatten()
                assert torch.equal(_cpu(hidden), h[rows]), f"{what}: lane hidden states"
                torch.testing.assert_close(
                    _cpu(scores).double(), torch.tensor(want.scores[step], dtype=torch.float64)
                )
            parent_list, selected, tokens = k.organize_draft_results(
                [lv[0] for lv in levels], [lv[1] for lv in levels], [lv[2] for lv in levels], n
            )
            what = f"case {case} (bs {bs} K {topk} S {num_steps} N {n})"
            assert _cpu(parent_list).long().tolist() == want.parent_list, what
            assert _cpu(selected).long().tolist() == want.selected, what
            assert _cpu(tokens).long().tolist() == want.draft_tokens, what


# --------------------------------------------------------------------------------- build_tree


def _corrupt(rng: random.Random, kind: str, parent_list, selected, topk: int, num_steps: int):
    cands = topk + (num_steps - 1) * topk * topk
    parent_list = [list(r) for r in parent_list]
    selected = [list(r) for r in selected]
    for b in range(len(selected)):
        if kind == "random_parents":
            parent_list[b] = [-1] + [rng.randint(-2, cands + 1) for _ in parent_list[b][1:]]
        elif kind == "random_ids":
            selected[b] = [rng.randint(-3, cands + 3) for _ in selected[b]]
        elif kind == "duplicates" and len(selected[b]) > 1:
            selected[b][rng.randrange(len(selected[b]))] = selected[b][0]
        elif kind == "cycle" and len(parent_list[b]) > 1 and len(selected[b]) > 1:
            # a node that is its own ancestor: the walk must stay bounded
            j = rng.randrange(len(selected[b]))
            parent_list[b][selected[b][j] // topk] = selected[b][j]
    return parent_list, selected


def _build_outs(be, mode, bs: int, n: int, seq_lens: list[int]) -> dict:
    dev, idt = be.device(), be.index_dtype
    mask = torch.full((bs, n, n), True, device=dev)  # TREE_ONLY, the one layout
    outs = {"tree_mask": mask, "positions": torch.full((bs * n,), -7, dtype=idt, device=dev)}
    for name in ("retrive_index", "retrive_next_token", "retrive_next_sibling"):
        outs[name] = torch.full((bs, n), -7, dtype=idt, device=dev)
    return outs


def _expected_build(parent_list, selected, seq_lens, topk, num_steps, mode) -> dict:
    trees = [oracles.build_tree(p, s, topk, num_steps) for p, s in zip(parent_list, selected)]
    n = len(selected[0]) + 1
    return {
        "tree_mask": oracles.tree_mask_layout([t.rows for t in trees], seq_lens, mode),
        "positions": torch.tensor([s + d for s, t in zip(seq_lens, trees) for d in t.depth]),
        "retrive_index": torch.arange(len(trees) * n).view(len(trees), n),
        "retrive_next_token": torch.tensor([t.next_token for t in trees]),
        "retrive_next_sibling": torch.tensor([t.next_sibling for t in trees]),
    }


def _run_build(be, parent_list, selected, seq_lens, topk, num_steps, mode) -> dict:
    bs, n = len(selected), len(selected[0]) + 1
    outs = _build_outs(be, mode, bs, n, seq_lens)
    width = len(parent_list[0])
    plist = torch.tensor(parent_list) if width else torch.zeros(bs, 0, dtype=torch.long)
    be.kernels.build_tree(
        _idx(be, plist), _idx(be, selected), _idx(be, seq_lens), topk, num_steps, n, mode, **outs
    )
    return {k: _cpu(v) for k, v in outs.items()}


@pytest.mark.parametrize("mode", list(TreeMaskMode))
def test_build_tree_matches_oracle(backend, mode):
    rng = random.Random(202)
    kinds = ("none", "none", "random_parents", "random_ids", "duplicates", "cycle")
    for case in range(24):
        bs, topk, num_steps, n = _shape(rng)
        kind = kinds[case % len(kinds)]
        g = torch.Generator().manual_seed(1000 + case)
        tree = oracles.draft_tree(_draft_steps(g, bs, topk, num_steps, vocab=20), topk, n)
        parent_list, selected = _corrupt(
            rng, kind, tree.parent_list, tree.selected, topk, num_steps
        )
        seq_lens = [rng.randint(0, 9) for _ in range(bs)]
        want = _expected_build(parent_list, selected, seq_lens, topk, num_steps, mode)
        for be in _under_test(backend, "build_tree"):
            got = _run_build(be, parent_list, selected, seq_lens, topk, num_steps, mode)
            for name, expected in want.items():
                assert torch.equal(got[name].long(), expected.long()), (
                    f"build_tree.{name}, case {case} ({kind}, K {topk} S {num_steps} N {n}): "
                    f"{got[name].tolist()} != oracle {expected.tolist()}"
                )


# ------------------------------------------------------------------------------ verification


def _random_tree(rng: random.Random, case: int, min_topk: int = 1):
    """A well-formed tree of one request (lists): (K, S, N, next_token, next_sibling)."""
    while True:
        _, topk, num_steps, n = _shape(rng)
        if topk >= min_topk:
            break
    g = torch.Generator().manual_seed(5000 + case)
    tree = oracles.draft_tree(_draft_steps(g, 1, topk, num_steps, vocab=20), topk, n)
    built = oracles.build_tree(tree.parent_list[0], tree.selected[0], topk, num_steps)
    return topk, num_steps, n, built.next_token, built.next_sibling


def _verify_outs(be, bs: int, n: int, num_steps: int) -> dict:
    dev, idt = be.device(), be.index_dtype
    return {
        "predicts": torch.full((bs * n,), -7, dtype=torch.int64, device=dev),
        "accept_index": torch.full((bs, num_steps + 1), -7, dtype=idt, device=dev),
        "accept_length": torch.full((bs,), -7, dtype=idt, device=dev),
    }


def _expected_verify(results: list[oracles.Verified], bs: int, n: int) -> dict:
    predicts = [0] * (bs * n)
    for r in results:
        for gid, tok in r.predicts.items():
            predicts[gid] = tok
    return {
        "predicts": torch.tensor(predicts),
        "accept_index": torch.tensor([r.accept_index for r in results]),
        "accept_length": torch.tensor([r.accept_length for r in results]),
    }


def _off_chain(r: oracles.Verified, next_token: list[int], n: int, b: int) -> bool:
    """Whether the accepted path took a child other than its parent's first."""
    nodes = [gid - b * n for gid in r.accept_index[: r.accept_length + 1]]
    return any(next_token[u] != c for u, c in zip(nodes, nodes[1:]))


def test_verify_tree_greedy_matches_oracle(backend):
    rng = random.Random(303)
    long_paths = off_chain = 0
    for case in range(CASES):
        topk, num_steps, n, nt, ns = _random_tree(rng, case)
        bs, vocab = 4, rng.randint(2, 5)  # a tiny vocabulary makes matches common
        next_token, next_sibling = [list(nt) for _ in range(bs)], [list(ns) for _ in range(bs)]
        if case % 4 == 3:  # garbage links: out of range, self-loops, shared children
            for b in range(bs):
                next_token[b] = [rng.randint(-2, n + 1) for _ in range(n)]
                next_sibling[b] = [rng.randint(-2, n + 1) for _ in range(n)]
        candidates = [[rng.randrange(vocab) for _ in range(n)] for _ in range(bs)]
        target = [[rng.randrange(vocab) for _ in range(n)] for _ in range(bs)]
        results = [
            oracles.verify_greedy(
                candidates[b],
                list(range(b * n, (b + 1) * n)),
                next_token[b],
                next_sibling[b],
                target[b],
                num_steps,
            )  # fmt: skip
            for b in range(bs)
        ]
        want = _expected_verify(results, bs, n)
        long_paths += sum(r.accept_length >= 2 for r in results)
        off_chain += sum(_off_chain(r, next_token[b], n, b) for b, r in enumerate(results))
        for be in _under_test(backend, "verify_tree_greedy"):
            outs = _verify_outs(be, bs, n, num_steps)
            be.kernels.verify_tree_greedy(
                torch.tensor(candidates, device=be.device()),
                _idx(be, [list(range(b * n, (b + 1) * n)) for b in range(bs)]),
                _idx(be, next_token),
                _idx(be, next_sibling),
                torch.tensor(target, device=be.device()),
                **outs,
            )
            for name, expected in want.items():
                got = _cpu(outs[name]).long()
                assert torch.equal(got, expected), (
                    f"verify_tree_greedy.{name}, case {case} (K {topk} S {num_steps} N {n}): "
                    f"{got.tolist()} != oracle {expected.tolist()}"
                )
    assert long_paths >= 10 and off_chain >= 10, (
        f"cases too weak: {long_paths} paths of 2+ nodes, {off_chain} off the first-child chain"
    )


def _peaked_probs(rng: random.Random, rows: int, vocab: int, favour: list[int]) -> list:
    """Random distributions, row r leaning towards token ``favour[r]`` (often a child's)."""
    out = []
    for r in range(rows):
        w = [rng.random() ** 2 for _ in range(vocab)]
        w[favour[r]] += rng.random() * 2
        total = sum(w)
        out.append([x / total for x in w])
    return out


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_verify_tree_sampling_matches_oracle(backend, with_draft_probs):
    rng = random.Random(404 + with_draft_probs)
    cases = skipped = 0
    stats = {"deciding_renorm": 0, "later_acceptances": 0, "long_paths": 0}
    for case in range(CASES):
        topk, num_steps, n, nt, ns = _random_tree(rng, case, min_topk=2)
        bs, vocab = 6, rng.randint(3, 6)
        candidates = [[rng.randrange(vocab) for _ in range(n)] for _ in range(bs)]
        # each node's target leans to its first child's token (rejections, then siblings)
        first = [[candidates[b][c] if c >= 0 else 0 for c in nt] for b in range(bs)]
        target = [_peaked_probs(rng, n, vocab, first[b]) for b in range(bs)]
        draft = None
        if with_draft_probs:
            draft = [_peaked_probs(rng, n, vocab, first[b]) for b in range(bs)]
        coins = [[rng.random() for _ in range(n)] for _ in range(bs)]
        final = [rng.random() for _ in range(bs)]
        gidx = [list(range(b * n, (b + 1) * n)) for b in range(bs)]
        results = [
            oracles.verify_sampling(
                candidates[b],
                gidx[b],
                nt,
                ns,
                target[b],
                None if draft is None else draft[b],
                coins[b],
                final[b],
                num_steps,
            )  # fmt: skip
            for b in range(bs)
        ]
        close = [r.margin < 1e-4 for r in results]  # float32 may round such a draw either way
        skipped += sum(close)
        cases += bs
        for r, c in zip(results, close):
            if not c:
                stats["deciding_renorm"] += r.deciding_renorm
                stats["later_acceptances"] += r.later_acceptances
                stats["long_paths"] += r.accept_length >= 2
        want = _expected_verify(results, bs, n)
        for be in _under_test(backend, "verify_tree_sampling"):
            dev = be.device()
            outs = _verify_outs(be, bs, n, num_steps)
            be.kernels.verify_tree_sampling(
                torch.tensor(candidates, device=dev),
                _idx(be, gidx),
                _idx(be, [nt] * bs),
                _idx(be, [ns] * bs),
                torch.tensor(target, dtype=torch.float32, device=dev),
                None if draft is None else torch.tensor(draft, dtype=torch.float32, device=dev),
                torch.tensor(coins, dtype=torch.float32, device=dev),
                torch.tensor(final, dtype=torch.float32, device=dev),
                **outs,
            )
            pred = _cpu(outs["predicts"]).long().view(bs, n)
            for b in range(bs):
                if close[b]:
                    continue
                for name in ("accept_index", "accept_length"):
                    got, expected = _cpu(outs[name]).long()[b], want[name][b]
                    assert torch.equal(got, expected), (
                        f"verify_tree_sampling.{name}, case {case} request {b} (K {topk} "
                        f"S {num_steps} N {n}): {got.tolist()} != oracle {expected.tolist()}"
                    )
                expected = want["predicts"].view(bs, n)[b]
                assert torch.equal(pred[b], expected), (
                    f"verify_tree_sampling.predicts, case {case} request {b}: "
                    f"{pred[b].tolist()} != oracle {expected.tolist()}"
                )
    assert skipped <= cases // 20, f"{skipped} of {cases} draws too close to a threshold"
    assert stats["deciding_renorm"] >= 5 and stats["later_acceptances"] >= 10, (
        f"cases too weak: {stats} (draws where only the renormalised residual accepts a later "
        "sibling, siblings accepted after a rejection)"
    )
    assert stats["long_paths"] >= 10, f"cases too weak: {stats}"


# ---------------------------------------------------------- the documented algorithm's own law


def test_sampling_oracle_is_lossless():
    """The oracle's exact outcome law equals the target's law on random trees with duplicate
    sibling tokens (one-hot drafts, any depth), and, with drafts drawn i.i.d. from q, the first
    emitted token follows the target after averaging over every draw of the children."""
    rng = random.Random(505)
    for case in range(30):
        topk, num_steps, n, nt, ns = _random_tree(rng, case, min_topk=2)
        vocab = rng.randint(2, 4)
        candidates = [rng.randrange(vocab) for _ in range(n)]
        target = _peaked_probs(rng, n, vocab, [rng.randrange(vocab) for _ in range(n)])
        got = oracles.sampling_outcome_law(candidates, nt, ns, target, None, num_steps)
        want = oracles.target_sequence_law(candidates, nt, ns, target, num_steps)
        assert set(got) <= set(want) and abs(sum(got.values()) - 1) < 1e-9
        for seq, p in want.items():
            assert abs(got.get(seq, 0.0) - p) < 1e-9, f"case {case}: P{seq} {got.get(seq)} != {p}"
    for _ in range(10):
        vocab, m = 3, rng.randint(1, 3)  # m children drawn i.i.d. from q
        p = _peaked_probs(rng, 1, vocab, [0])[0]
        q = _peaked_probs(rng, 1, vocab, [rng.randrange(vocab)])[0]
        n = m + 1
        nt = [1] + [-1] * m
        ns = [-1] + [c + 1 if c + 1 < n else -1 for c in range(1, n)]
        first = [0.0] * vocab
        for draw in range(vocab**m):
            kids = [(draw // vocab**i) % vocab for i in range(m)]
            weight = 1.0
            for x in kids:
                weight *= q[x]
            law = oracles.sampling_outcome_law([0] + kids, nt, ns, [p] * n, [q] * n, 1)
            for seq, pr in law.items():
                first[seq[0]] += weight * pr
        assert all(abs(a - b) < 1e-9 for a, b in zip(first, p)), f"{first} != {p}"


# ----------------------------------------------------------------------- sampling transforms

# (temperature, top_k, top_p): temperature with top-p, top-k with top-p, each alone
TRANSFORMS = [(0.6, 0, 0.8), (1.7, 0, 0.75), (1.4, 6, 0.7), (0.8, 4, 0.9), (1.0, 5, 1.0)]


def _wrong_order(logits: list[float], temperature: float, top_k: int, top_p: float):
    """The top-k / top-p mask taken at temperature 1, then the temperature: a classic bug."""
    mask = oracles.transformed_probs(logits, 1.0, top_k, top_p)
    p = oracles.transformed_probs(logits, temperature, 0, 1.0)
    kept = [x if m > 0 else 0.0 for x, m in zip(p, mask)]
    return [x / sum(kept) for x in kept]


def test_top_k_top_p_renorm_matches_oracle(backend):
    """The caller applies the temperature to the logits, the kernel then top-k, then top-p
    (the documented order); the result is the oracle's law of the transformed row. Rows
    include ties (equal logits, ranked by token id)."""
    g = torch.Generator().manual_seed(606)
    vocab = 40
    logits = 2.5 * torch.randn(len(TRANSFORMS) * 4, vocab, generator=g, dtype=torch.float64)
    logits[::4, 5:9] = logits[::4, 3:4]  # ties
    rows = [i % len(TRANSFORMS) for i in range(logits.shape[0])]
    temps = torch.tensor([TRANSFORMS[r][0] for r in rows], dtype=torch.float64)
    top_k = torch.tensor([TRANSFORMS[r][1] for r in rows])
    top_p = torch.tensor([TRANSFORMS[r][2] for r in rows], dtype=torch.float32)
    probs = torch.softmax(logits / temps[:, None], dim=-1).float()
    want = torch.tensor(
        [oracles.transformed_probs(logits[i].tolist(), *TRANSFORMS[r]) for i, r in enumerate(rows)],
        dtype=torch.float64,
    )
    wrong = torch.tensor(
        [_wrong_order(logits[i].tolist(), *TRANSFORMS[r]) for i, r in enumerate(rows)],
        dtype=torch.float64,
    )
    apart = (want - wrong).abs().sum(dim=1) > 0.05
    assert int(apart.sum()) >= logits.shape[0] // 3, "cases too weak: the order rarely matters"
    for be in _under_test(backend, "top_k_top_p_renorm"):
        got = _cpu(
            be.kernels.top_k_top_p_renorm(
                probs.to(be.device()), _idx(be, top_k), top_p.to(be.device())
            )
        )
        torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)
        assert torch.equal(got > 0, want > 0), "top_k_top_p_renorm kept other tokens"


def test_sample_follows_the_transformed_law(backend):
    """``sample`` over the transformed probabilities draws from the oracle's law:
    20000 draws per transform, chi-square at p ~ 1e-6, and no token outside the law."""
    g = torch.Generator().manual_seed(607)
    vocab, draws = 12, 20000
    for temperature, top_k, top_p in TRANSFORMS[:3]:
        logits = 2.0 * torch.randn(vocab, generator=g, dtype=torch.float64)
        law = oracles.transformed_probs(logits.tolist(), temperature, top_k, top_p)
        want = torch.tensor(law, dtype=torch.float64)
        probs = torch.softmax(logits / temperature, -1).float().expand(draws, vocab).contiguous()
        noise = torch.empty(draws, vocab).exponential_(generator=g)
        for be in _under_test(backend, "sample"):
            dev = be.device()
            kept = be.kernels.top_k_top_p_renorm(
                probs.to(dev),
                _idx(be, torch.full((draws,), top_k)),
                torch.full((draws,), top_p, device=dev),
            )
            tokens = _cpu(be.kernels.sample(kept, noise.to(dev))).long()
            counts = torch.bincount(tokens, minlength=vocab).double()
            assert int(counts[want == 0].sum()) == 0, f"drew tokens outside the law: {counts}"
            expected = want * draws
            keep = expected > 0
            stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
            df = int(keep.sum()) - 1
            if df == 0:
                continue
            a = 2.0 / (9.0 * df)
            critical = df * (1.0 - a + 4.753 * a**0.5) ** 3
            assert stat < critical, f"T {temperature} k {top_k} p {top_p}: chi2 {stat:.1f}"
