"""Golden cases for the draft-tree kernels: hand-computed answers, every mask layout.

Trees (node 0 is the root; ``c`` = candidate id, K = topk):
  chain:   K=1, S=3, N=4: root -> 1 -> 2 -> 3.
  branchy: K=2, S=3, N=7, driven through select_top_k / organize_draft_results from chosen
           probabilities: root -> {1, 2}; 1 -> 3; 2 -> 4; 4 -> 5; 3 -> 6.
  broken:  parents that were not selected, a parent cycle, out-of-range and duplicate ids; the
           kernels must stay bounded and produce the documented answer.
"""

from __future__ import annotations

import pytest
import torch

from polyspec.backend import TreeMaskMode


def _idx(backend, values) -> torch.Tensor:
    return torch.as_tensor(values).to(device=backend.device(), dtype=backend.index_dtype)


def _cpu_long(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").long()


def _expected_layout(rows: list[list[set[int]]], seq_lens: list[int], mode: TreeMaskMode):
    """The mask layout built by plain loops from per-request row sets."""
    n = len(rows[0])
    assert mode is TreeMaskMode.TREE_ONLY
    return torch.tensor([[[j in r for j in range(n)] for r in req] for req in rows])


def _build(backend, parent_list, selected, seq_lens, topk, num_steps, n, mode):
    bs = len(seq_lens)
    dev, idt = backend.device(), backend.index_dtype
    outs = {
        "tree_mask": torch.full((bs, n, n), True, device=dev),
        "positions": torch.full((bs * n,), -7, dtype=idt, device=dev),
        "retrive_index": torch.full((bs, n), -7, dtype=idt, device=dev),
        "retrive_next_token": torch.full((bs, n), -7, dtype=idt, device=dev),
        "retrive_next_sibling": torch.full((bs, n), -7, dtype=idt, device=dev),
    }
    backend.kernels.build_tree(
        _idx(backend, parent_list),
        _idx(backend, selected),
        _idx(backend, seq_lens),
        topk,
        num_steps,
        n,
        mode,
        **outs,
    )
    return {k: v.detach().to("cpu") for k, v in outs.items()}


def _check_tree(out, rows, depths, next_token, next_sibling, seq_lens, mode):
    bs, n = len(rows), len(rows[0])
    expected_mask = _expected_layout(rows, seq_lens, mode)
    assert torch.equal(out["tree_mask"], expected_mask), f"{mode} mask:\n{out['tree_mask']}"
    positions = [s + d for s, req in zip(seq_lens, depths) for d in req]
    assert out["positions"].long().tolist() == positions
    assert out["retrive_index"].long().tolist() == [
        [b * n + j for j in range(n)] for b in range(bs)
    ]
    assert out["retrive_next_token"].long().tolist() == next_token
    assert out["retrive_next_sibling"].long().tolist() == next_sibling


def _verify(backend, candidates, tree, target_predict, num_steps):
    bs, n = len(candidates), len(candidates[0])
    dev, idt = backend.device(), backend.index_dtype
    outs = {
        "predicts": torch.full((bs * n,), -7, dtype=torch.int64, device=dev),
        "accept_index": torch.full((bs, num_steps + 1), -7, dtype=idt, device=dev),
        "accept_length": torch.full((bs,), -7, dtype=idt, device=dev),
    }
    backend.kernels.verify_tree_greedy(
        torch.tensor(candidates, device=dev),
        tree["retrive_index"].to(dev),
        tree["retrive_next_token"].to(dev),
        tree["retrive_next_sibling"].to(dev),
        torch.tensor(target_predict, device=dev),
        **outs,
    )
    return {k: _cpu_long(v).tolist() for k, v in outs.items()}


MODES = list(TreeMaskMode)


@pytest.mark.parametrize("mode", MODES)
def test_chain(backend, mode):
    # K=1, S=3: candidates 0, 1, 2 (one per step); parent_list = [-1, 0, 1].
    out = _build(backend, [[-1, 0, 1]], [[0, 1, 2]], [5], 1, 3, 4, mode)
    rows = [[{0}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}]]
    _check_tree(out, rows, [[0, 1, 2, 3]], [[1, 2, 3, -1]], [[-1, -1, -1, -1]], [5], mode)

    # Target agrees with nodes 1 and 2, then predicts 42 after node 2: two accepted, bonus 42.
    got = _verify(backend, [[7, 11, 12, 13]], out, [[11, 12, 42, 99]], 3)
    assert got["accept_length"] == [2]
    assert got["accept_index"] == [[0, 1, 2, -1]]
    assert got["predicts"] == [11, 12, 42, 0]
    # Everything accepted: the bonus is the target after the last node.
    got = _verify(backend, [[7, 11, 12, 13]], out, [[11, 12, 13, 99]], 3)
    assert got == {
        "predicts": [11, 12, 13, 99],
        "accept_index": [[0, 1, 2, 3]],
        "accept_length": [3],
    }


def _branchy_draft(backend):
    """Drive the K=2, S=3 draft with chosen probabilities (see the module docstring).

    Scores: c0 .6, c1 .4 | c2 .30, c3 .18, c4 .36, c5 .04 (lanes: c4, c2) |
    c6 .198, c7 .072 (children of c4), c8 .21, c9 .03 (children of c2).
    Best 6: c0, c1, c4, c2, c8, c6 -> ids [0, 1, 2, 4, 6, 8].
    """
    dev = backend.device()
    k = backend.kernels

    def idx(v):
        return _idx(backend, v)

    p0, t0 = torch.tensor([[0.6, 0.4]], device=dev), idx([[10, 11]])
    ids0, h0, s0, lv0 = k.select_top_k(0, p0, t0, torch.tensor([[1.0]], device=dev), None, 2)
    assert _cpu_long(ids0).tolist() == [10, 11]
    assert h0.tolist() == [[1.0], [1.0]]

    p1 = torch.tensor([[0.5, 0.3], [0.9, 0.1]], device=dev)
    t1 = idx([[20, 21], [22, 23]])
    h1 = torch.tensor([[1.0], [2.0]], device=dev)  # the two lanes' new hidden states
    ids1, hid1, s1, lv1 = k.select_top_k(1, p1, t1, h1, s0, 2)
    assert _cpu_long(ids1).tolist() == [22, 20]  # c4 (.36) then c2 (.30)
    assert hid1.tolist() == [[2.0], [1.0]]  # c4 came from lane 1, c2 from lane 0
    torch.testing.assert_close(s1.cpu(), torch.tensor([[0.36, 0.30]]))
    assert _cpu_long(lv1[2]).tolist() == [[4, 2]]

    p2 = torch.tensor([[0.55, 0.2], [0.7, 0.1]], device=dev)
    t2 = idx([[30, 31], [32, 33]])
    _, _, s2, lv2 = k.select_top_k(2, p2, t2, torch.zeros(2, 1, device=dev), s1, 2)
    assert _cpu_long(lv2[2]).tolist() == [[8, 6]]  # c8 (.21), c6 (.198)

    parent_list, selected, tokens = k.organize_draft_results(
        [lv0[0], lv1[0], lv2[0]], [lv0[1], lv1[1], lv2[1]], [lv0[2], lv1[2], lv2[2]], 7
    )
    assert _cpu_long(parent_list).tolist() == [[-1, 0, 1, 4, 2]]
    assert _cpu_long(selected).tolist() == [[0, 1, 2, 4, 6, 8]]
    assert _cpu_long(tokens).tolist() == [[10, 11, 20, 22, 30, 32]]
    return _cpu_long(parent_list).tolist()[0], _cpu_long(selected).tolist()[0]


@pytest.mark.parametrize("mode", MODES)
def test_topk_tree(backend, mode):
    parent_list, selected = _branchy_draft(backend)
    # Nodes: 1=c0, 2=c1 (root children); 3=c2 (parent c0 -> node 1); 4=c4 (parent c1 -> node 2);
    # 5=c6 (parent lane c4 -> node 4); 6=c8 (parent lane c2 -> node 3). Two requests, the same
    # tree, different prefix lengths.
    seq_lens = [3, 9]
    out = _build(backend, [parent_list] * 2, [selected] * 2, seq_lens, 2, 3, 7, mode)
    req_rows = [{0}, {0, 1}, {0, 2}, {0, 1, 3}, {0, 2, 4}, {0, 2, 4, 5}, {0, 1, 3, 6}]
    depths = [0, 1, 1, 2, 2, 3, 3]
    next_token = [1, 3, 4, 6, 5, -1, -1]
    next_sibling = [-1, 2, -1, -1, -1, -1, -1]
    _check_tree(
        out, [req_rows] * 2, [depths] * 2, [next_token] * 2, [next_sibling] * 2, seq_lens, mode
    )

    tokens = [5, 10, 11, 20, 22, 30, 32]
    # Request 0 follows root -> 2 (11) -> 4 (22) -> 5 (30), bonus 99 after node 5.
    # Request 1 takes node 1 (10), then the target wants 77, which is no child of node 1.
    target = [[11, 0, 22, 0, 30, 99, 0], [10, 77, 0, 0, 0, 0, 0]]
    got = _verify(backend, [tokens, tokens], out, target, 3)
    assert got["accept_length"] == [3, 1]
    assert got["accept_index"] == [[0, 2, 4, 5], [7, 8, -1, -1]]
    assert got["predicts"] == [11, 0, 22, 0, 30, 99, 0] + [10, 77, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("mode", MODES)
def test_missing_parent(backend, mode):
    # K=2, S=2: parent_list [-1, 0, 1]. Selected [0, 4, 5]: c4 and c5 are children of c1,
    # which was not selected. They are unreachable; their rows hold themselves and the root.
    out = _build(backend, [[-1, 0, 1]], [[0, 4, 5]], [4], 2, 2, 4, mode)
    rows = [[{0}, {0, 1}, {0, 2}, {0, 3}]]
    _check_tree(out, rows, [[0, 1, 1, 1]], [[1, -1, -1, -1]], [[-1, -1, -1, -1]], [4], mode)
    # The target wants node 2's token: it is not reachable, so nothing is accepted.
    got = _verify(backend, [[1, 8, 9, 9]], out, [[9, 0, 0, 0]], 2)
    assert got == {"predicts": [9, 0, 0, 0], "accept_index": [[0, -1, -1]], "accept_length": [0]}


def test_parent_cycle_is_bounded(backend):
    # K=1, S=3, N=3: c1's parent is c2 and c2's parent is c1 (garbage). The ancestor walk stops
    # after S=3 nodes; the verify walk stops after S depths.
    out = _build(backend, [[-1, 2, 1]], [[1, 2]], [0], 1, 3, 3, TreeMaskMode.TREE_ONLY)
    rows = [[{0}, {0, 1, 2}, {0, 1, 2}]]
    _check_tree(out, rows, [[0, 3, 3]], [[-1, 2, 1]], [[-1, -1, -1]], [0], TreeMaskMode.TREE_ONLY)
    got = _verify(backend, [[4, 4, 4]], out, [[4, 4, 4]], 3)
    assert got["accept_length"] == [0]  # the root has no children


def test_out_of_range_and_duplicate_ids(backend):
    # K=2, S=2, N=5: ids -3 (negative) and 100 (parent slot out of range) have no parent;
    # the duplicate c0 is linked twice (both root children); c2's parent c0 is the first match.
    out = _build(backend, [[-1, 0, 1]], [[-3, 0, 0, 2]], [2], 2, 2, 5, TreeMaskMode.TREE_ONLY)
    rows = [[{0}, {0, 1}, {0, 2}, {0, 3}, {0, 2, 4}]]
    _check_tree(
        out,
        rows,
        [[0, 1, 1, 1, 2]],
        [[2, -1, 4, -1, -1]],
        [[-1, -1, 3, -1, -1]],
        [2],
        TreeMaskMode.TREE_ONLY,
    )
    out = _build(backend, [[-1, 0, 1]], [[0, 100]], [2], 2, 2, 3, TreeMaskMode.TREE_ONLY)
    _check_tree(
        out,
        [[{0}, {0, 1}, {0, 2}]],
        [[0, 1, 1]],
        [[1, -1, -1]],
        [[-1, -1, -1]],
        [2],
        TreeMaskMode.TREE_ONLY,
    )
    # Verify on the duplicate tree: both root children carry token 6; the first is accepted.
    dup = _build(backend, [[-1, 0, 1]], [[-3, 0, 0, 2]], [2], 2, 2, 5, TreeMaskMode.TREE_ONLY)
    got = _verify(backend, [[1, 5, 6, 6, 7]], dup, [[6, 0, 7, 0, 3]], 2)
    assert got == {"predicts": [6, 0, 7, 0, 3], "accept_index": [[0, 2, 4]], "accept_length": [2]}


def test_verify_greedy_garbage_links_are_bounded(backend):
    # Links outside [0, N) end a list; a self-loop is walked at most S depths.
    tree = {
        "retrive_index": torch.tensor([[0, 1, 2]]),
        "retrive_next_token": torch.tensor([[1, 1, 57]]),
        "retrive_next_sibling": torch.tensor([[-9, 40, -1]]),
    }
    tree = {k: v.to(backend.index_dtype) for k, v in tree.items()}
    got = _verify(backend, [[3, 3, 3]], tree, [[3, 3, 3]], 4)
    assert got == {"predicts": [3, 3, 0], "accept_index": [[0, 1, 1, 1, 1]], "accept_length": [4]}


def test_verify_sampling_golden(backend):
    # Chain root -> 1 (token 1) -> 2 (token 0), V=3, target-only.
    # Depth 1: r = [.5, .3, .2], coin .2 < .3 -> accept node 1 (predicts[root] = 1).
    # Depth 2: r = [.1, .6, .3], coin .5 >= .1 -> reject; residual [0, .6, .3] / .9;
    # final coin .7: cdf [0, .667, 1.0], .7 -> token 2 (predicts[node 1] = 2).
    dev = backend.device()
    target = torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [1 / 3, 1 / 3, 1 / 3]]], device=dev)
    outs = {
        "predicts": torch.full((3,), -7, dtype=torch.int64, device=dev),
        "accept_index": torch.full((1, 3), -7, dtype=backend.index_dtype, device=dev),
        "accept_length": torch.full((1,), -7, dtype=backend.index_dtype, device=dev),
    }

    def run(coins, final):
        backend.kernels.verify_tree_sampling(
            torch.tensor([[2, 1, 0]], device=dev),
            _idx(backend, [[0, 1, 2]]),
            _idx(backend, [[1, 2, -1]]),
            _idx(backend, [[-1, -1, -1]]),
            target,
            None,
            torch.tensor([coins], device=dev),
            torch.tensor([final], device=dev),
            **outs,
        )
        return {k: _cpu_long(v).tolist() for k, v in outs.items()}

    assert run([0.0, 0.2, 0.5], 0.7) == {
        "predicts": [1, 2, 0],
        "accept_index": [[0, 1, -1]],
        "accept_length": [1],
    }
    # Final coin .5 lands in token 1's mass instead.
    assert run([0.0, 0.2, 0.5], 0.5)["predicts"] == [1, 1, 0]
    # Both accepted (coin .05 < .1): the bonus after node 2 is drawn from its target, .9 -> 2.
    assert run([0.0, 0.2, 0.05], 0.9) == {
        "predicts": [1, 0, 2],
        "accept_index": [[0, 1, 2]],
        "accept_length": [2],
    }
    # Root child rejected (coin .95 >= .3): residual [.5, 0, .2] / .7, final .8 -> token 2.
    assert run([0.0, 0.95, 0.0], 0.8) == {
        "predicts": [2, 0, 0],
        "accept_index": [[0, -1, -1]],
        "accept_length": [0],
    }


def _sample_verify(backend, candidates, next_token, next_sibling, target, draft, coins, final):
    n = len(candidates)
    num_steps = 2
    dev = backend.device()
    outs = {
        "predicts": torch.full((n,), -7, dtype=torch.int64, device=dev),
        "accept_index": torch.full((1, num_steps + 1), -7, dtype=backend.index_dtype, device=dev),
        "accept_length": torch.full((1,), -7, dtype=backend.index_dtype, device=dev),
    }
    backend.kernels.verify_tree_sampling(
        torch.tensor([candidates], device=dev),
        _idx(backend, [list(range(n))]),
        _idx(backend, [next_token]),
        _idx(backend, [next_sibling]),
        torch.tensor([target], device=dev),
        None if draft is None else torch.tensor([draft], device=dev),
        torch.tensor([coins], device=dev),
        torch.tensor([final], device=dev),
        **outs,
    )
    return {k: _cpu_long(v).tolist() for k, v in outs.items()}


def test_verify_sampling_golden_siblings(backend):
    """A rejected sibling, then a later sibling accepted only because the residual is
    renormalised, then an acceptance one level deeper (S = 2)."""
    # Tree: root -> 1 (token 2), 2 (token 1), 3 (token 0); node 2 -> 4 (token 0). V = 3.
    # Root: r = [.2, .3, .5]; node 1 (token 2): coin .6 >= .5 -> reject; r = [.2, .3, 0] / .5
    # = [.4, .6, 0]; node 2 (token 1): coin .45 < .6 -> accept (an un-normalised residual,
    # .3, would reject it). Node 2: r = [.7, .2, .1]; node 4 (token 0): coin .5 < .7 -> accept.
    # Depth S reached: the bonus after node 4 from [.1, .1, .8], final coin .5 -> token 2.
    candidates = [9, 2, 1, 0, 0]
    next_token = [1, -1, 4, -1, -1]
    next_sibling = [-1, 2, 3, -1, -1]
    uniform = [1 / 3] * 3
    target = [[0.2, 0.3, 0.5], uniform, [0.7, 0.2, 0.1], uniform, [0.1, 0.1, 0.8]]
    got = _sample_verify(
        backend, candidates, next_token, next_sibling, target, None,
        [0.0, 0.6, 0.45, 0.9, 0.5], 0.5,
    )  # fmt: skip
    assert got == {
        "predicts": [1, 0, 0, 0, 2],
        "accept_index": [[0, 2, 4]],
        "accept_length": [2],
    }
    # Node 2 rejected too (coin .7 >= .6): r = [.4, 0, 0] / .4 = [1, 0, 0]; node 3 (token 0):
    # coin .99 < 1 -> accept (un-normalised, .2, would reject); it has no child: the bonus
    # after node 3 comes from its target (uniform), final coin .5 -> token 1.
    got = _sample_verify(
        backend, candidates, next_token, next_sibling, target, None,
        [0.0, 0.6, 0.7, 0.99, 0.5], 0.5,
    )  # fmt: skip
    assert got == {
        "predicts": [0, 0, 0, 1, 0],
        "accept_index": [[0, 3, -1]],
        "accept_length": [1],
    }


def test_verify_sampling_golden_siblings_with_draft_probs(backend):
    """Children drawn from q: a rejection leaves r = max(p - q, 0) renormalised, under which
    the next sibling is certain (an un-normalised residual would accept it with .2)."""
    # Root: p = [.6, .3, .1], q = [.5, .4, .1]. Node 1 (token 1): a = .3 / .4 = .75, coin .8
    # -> reject; r = [.1, 0, 0] / .1 = [1, 0, 0]. Node 2 (token 0): a = min(1, 1 / .5) = 1,
    # coin .5 -> accept. Node 2 has no child: bonus from its target [.2, .5, .3], .75 -> 2.
    candidates = [7, 1, 0]
    next_token = [1, -1, -1]
    next_sibling = [-1, 2, -1]
    target = [[0.6, 0.3, 0.1], [1 / 3] * 3, [0.2, 0.5, 0.3]]
    draft = [[0.5, 0.4, 0.1]] * 3
    got = _sample_verify(
        backend, candidates, next_token, next_sibling, target, draft, [0.0, 0.8, 0.5], 0.75
    )
    assert got == {"predicts": [0, 0, 2], "accept_index": [[0, 2, -1]], "accept_length": [1]}
