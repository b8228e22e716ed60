"""Every Triton kernel of ``polyspec.kernels.triton`` against the PyTorch reference.

Runs on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``, set by this directory's
conftest before any kernel is defined), or compiled on a device when ``POLYSPEC_TRITON_DEVICE``
names one (ci/device_cuda.sh). Shapes are tiny because the interpreter runs each program in
Python. Output tensors are poisoned with two different sentinels so that an entry a kernel
forgets to write fails; the golden tree cases of the conformance suite run on a backend whose
kernels are the Triton ones.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install 'polyspec[cuda]')")

from polyspec.backend import KernelSet, TreeMaskMode  # noqa: E402
from polyspec.backends.cpu.backend import CPUBackend  # noqa: E402
from polyspec.kernels import reference as ref  # noqa: E402
from polyspec.kernels.triton import KERNELS, triton_kernel_overrides  # noqa: E402

# The conformance suite's accepted-path case and golden tree cases, run here on the Triton
# kernels (fixture below).
from polyspec.testing.test_kernels import (  # noqa: E402, F401
    _accept_case,
    test_assign_accept_locs_matches_reference,
)
from polyspec.testing.test_tree_golden import (  # noqa: E402, F401
    test_chain,
    test_missing_parent,
    test_out_of_range_and_duplicate_ids,
    test_parent_cycle_is_bounded,
    test_topk_tree,
    test_verify_greedy_garbage_links_are_bounded,
    test_verify_sampling_golden,
)

SEED = 1234
TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
}
FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _assert_rounded_equal(got: torch.Tensor, expected: torch.Tensor, device: str, what: str):
    """Exact on a device; within one ulp under the interpreter, whose fp32 -> bf16 / fp16 casts
    truncate where compiled Triton (and torch) round to nearest even."""
    if device != "cpu" or expected.dtype == torch.float32:
        assert torch.equal(got.cpu(), expected), f"{what}: not bit-exact"
    else:
        torch.testing.assert_close(got.cpu(), expected, **TOL[expected.dtype], msg=what)


@pytest.fixture(scope="module")
def kernels() -> dict:
    return triton_kernel_overrides()


class _TritonBackend:
    """What the golden cases need of a backend: device, index dtype, kernels, capabilities."""

    def __init__(self, device: str, index_dtype: torch.dtype) -> None:
        self._device = torch.device(device)
        self.index_dtype = index_dtype
        self.capabilities = CPUBackend().capabilities
        self.kernels = dataclasses.replace(ref.reference_kernels(), **triton_kernel_overrides())

    def device(self, rank: int = 0) -> torch.device:
        return self._device


def test_every_kernel_takes_pdl_off_by_default(kernels):
    """The cuda backend binds ``pdl=True`` into every entry on sm_90 (backends/cuda/backend.py);
    an entry without the keyword would fail there at its first call."""
    import inspect

    for name, fn in kernels.items():
        param = inspect.signature(fn).parameters.get("pdl")
        assert param is not None and param.default is False, name


@pytest.fixture(scope="module", params=[torch.int64, torch.int32], ids=["int64", "int32"])
def backend(request, triton_device):
    """A backend whose kernels are the Triton ones (overrides the pytest plugin's fixture)."""
    return _TritonBackend(triton_device, request.param)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _poisoned(fn, args: dict, outs: dict, device: str) -> list[dict[str, torch.Tensor]]:
    """Call ``fn`` once per sentinel with every out tensor filled with it; CPU results."""
    results = []
    for which in range(2):
        filled = {}
        for name, t in outs.items():
            if t.dtype == torch.bool:
                value = (True, False)[which]
            elif t.dtype.is_floating_point:
                value = (float("nan"), -7.0)[which]
            else:
                value = (-7, 1234567)[which]
            filled[name] = torch.full_like(t, value, device=device)
        fn(**args, **filled)
        results.append({k: v.cpu() for k, v in filled.items()})
    return results


def _same(got: list[dict], expected: dict, what: str) -> None:
    for run in got:
        for name, exp in expected.items():
            a = run[name]
            assert a.shape == exp.shape, f"{what}.{name}: shape {a.shape} != {exp.shape}"
            assert torch.equal(
                a.long() if a.dtype != torch.bool else a,
                exp.long() if exp.dtype != torch.bool else exp,
            ), f"{what}.{name} differs:\n got {a}\n expected {exp}"


def _on(t: torch.Tensor, device: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    return t.to(device=device, dtype=dtype or t.dtype, copy=True)


# ----------------------------------------------------------------------------- overrides


def test_overrides_cover_the_assigned_kernels(kernels):
    expected = {name for names in KERNELS.values() for name in names}
    assert set(kernels) == expected
    assert expected <= set(KernelSet.names())
    assert {"build_tree", "verify_tree_greedy", "verify_tree_sampling", "assign_accept_locs"} <= (
        expected
    )


def test_importing_the_package_does_not_import_triton():
    code = "import sys, polyspec.kernels.triton; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ----------------------------------------------------------------------------- draft tree


def _random_tree(seed: int, bs: int, topk: int, num_steps: int, n: int):
    """A well-formed tree from the reference draft pipeline (parent_list, selected, tokens)."""
    g = _gen(seed)
    scores, levels = None, []
    for step in range(num_steps):
        rows = bs if step == 0 else bs * topk
        p, i = torch.randn(rows, 40, generator=g).softmax(-1).topk(topk, dim=-1)
        _, _, scores, level = ref.select_top_k(step, p, i, torch.zeros(rows, 2), scores, topk)
        levels.append(level)
    return ref.organize_draft_results(*[[lv[k] for lv in levels] for k in range(3)], n)


def _drive_draft(select, organize, steps, topk: int, n: int, dev: str):
    """select_top_k over every step, then organize_draft_results; outputs on the CPU."""
    scores, levels, selects = None, [], []
    for step, (p, i, h) in enumerate(steps):
        ids, hidden, scores, level = select(
            step, _on(p, dev), _on(i, dev), _on(h, dev), scores, topk
        )
        levels.append(level)
        selects.append([t.cpu() for t in (ids, hidden, scores, *level)])
    organized = organize(*[[lv[k] for lv in levels] for k in range(3)], n)
    return selects, [t.cpu() for t in organized]


@pytest.mark.parametrize("nan", [False, True], ids=["finite", "nan"])
@pytest.mark.parametrize(
    "bs,topk,num_steps,n",
    [(3, 1, 3, 4), (2, 3, 3, 8), (3, 4, 4, 16), (2, 2, 1, 3), (1, 8, 2, 40), (1, 8, 6, 64)],
)
def test_select_top_k_and_organize_match_reference(
    kernels, triton_device, bs, topk, num_steps, n, nan
):
    """Every output of the draft loop's expansion and of the node choice equals the
    reference's: tokens, routed hidden states, path probabilities, parents, the chosen ids
    (ascending) and their tokens; with NaN probabilities too (a broken draft), which rank
    first as in torch.topk."""
    g = _gen(SEED + 50 + topk * 10 + num_steps)
    steps = []
    for step in range(num_steps):
        rows = bs if step == 0 else bs * topk
        p, i = torch.randn(rows, 60, generator=g).softmax(-1).topk(topk, dim=-1)
        if nan and step == num_steps - 1:  # one NaN: NaNs among themselves may come in any order
            p[0, 0] = float("nan")
        steps.append((p, i, torch.randn(rows, 1100, generator=g)))
    got = _drive_draft(
        kernels["select_top_k"], kernels["organize_draft_results"], steps, topk, n, triton_device
    )
    want = _drive_draft(ref.select_top_k, ref.organize_draft_results, steps, topk, n, "cpu")
    for step, (a, b) in enumerate(zip(got[0], want[0])):
        for name, x, y in zip(
            ("ids", "hidden", "scores", "tree_scores", "tokens", "parents"), a, b
        ):
            assert x.shape == y.shape and x.dtype == y.dtype, (step, name, x.shape, y.shape)
            assert torch.equal(x, y) or torch.allclose(x, y, equal_nan=True), (step, name, x, y)
    for name, x, y in zip(("parent_list", "top_scores_index", "draft_tokens"), got[1], want[1]):
        assert x.dtype == y.dtype and torch.equal(x, y), (name, x, y)


def _tree_outs(mode: TreeMaskMode, bs: int, n: int, seq_lens: torch.Tensor, idt) -> dict:
    assert mode is TreeMaskMode.TREE_ONLY  # the one layout
    return {
        "tree_mask": torch.empty(bs, n, n, dtype=torch.bool),
        "positions": torch.empty(bs * n, dtype=idt),
        "retrive_index": torch.empty(bs, n, dtype=idt),
        "retrive_next_token": torch.empty(bs, n, dtype=idt),
        "retrive_next_sibling": torch.empty(bs, n, dtype=idt),
    }


@pytest.mark.parametrize("mode", list(TreeMaskMode))
@pytest.mark.parametrize("topk,num_steps,n", [(1, 3, 4), (3, 3, 9), (4, 4, 36), (8, 6, 64)])
def test_build_tree_matches_reference(kernels, triton_device, mode, topk, num_steps, n):
    bs = 2
    parent_list, selected, _ = _random_tree(SEED + n, bs, topk, num_steps, n)
    seq_lens = torch.randint(1, 20, (bs,), generator=_gen(n))
    common = {"topk": topk, "num_steps": num_steps, "num_draft_tokens": n, "tree_mask_mode": mode}
    expected = _poisoned(
        ref.build_tree,
        {"parent_list": parent_list, "top_scores_index": selected, "seq_lens": seq_lens, **common},
        _tree_outs(mode, bs, n, seq_lens, torch.int64),
        "cpu",
    )[0]
    for idt in (torch.int64, torch.int32):
        args = {
            "parent_list": _on(parent_list, triton_device, idt),
            "top_scores_index": _on(selected, triton_device, idt),
            "seq_lens": _on(seq_lens, triton_device, idt),
            **common,
        }
        got = _poisoned(
            kernels["build_tree"], args, _tree_outs(mode, bs, n, seq_lens, idt), triton_device
        )
        _same(got, expected, f"build_tree[{mode.value}, {idt}]")


def test_build_tree_garbage_matches_reference(kernels, triton_device):
    """Random garbage ids and parents (missing parents, duplicates, cycles, negatives)."""
    g = _gen(SEED + 5)
    bs, topk, num_steps, n = 3, 3, 4, 12
    parent_list = torch.randint(-3, 40, (bs, topk * (num_steps - 1) + 1), generator=g)
    selected = torch.randint(-4, 40, (bs, n - 1), generator=g)
    seq_lens = torch.randint(0, 10, (bs,), generator=g)
    mode = TreeMaskMode.TREE_ONLY
    common = {"topk": topk, "num_steps": num_steps, "num_draft_tokens": n, "tree_mask_mode": mode}
    expected = _poisoned(
        ref.build_tree,
        {"parent_list": parent_list, "top_scores_index": selected, "seq_lens": seq_lens, **common},
        _tree_outs(mode, bs, n, seq_lens, torch.int64),
        "cpu",
    )[0]
    args = {
        "parent_list": _on(parent_list, triton_device),
        "top_scores_index": _on(selected, triton_device),
        "seq_lens": _on(seq_lens, triton_device),
        **common,
    }
    got = _poisoned(
        kernels["build_tree"], args, _tree_outs(mode, bs, n, seq_lens, torch.int64), triton_device
    )
    _same(got, expected, "build_tree[garbage]")


def _verify_case(seed: int, bs: int, topk: int, num_steps: int, n: int, vocab: int):
    parent_list, selected, tokens = _random_tree(seed, bs, topk, num_steps, n)
    seq_lens = torch.full((bs,), 3)
    tree = _tree_outs(TreeMaskMode.TREE_ONLY, bs, n, seq_lens, torch.int64)
    ref.build_tree(
        parent_list, selected, seq_lens, topk, num_steps, n, TreeMaskMode.TREE_ONLY, **tree
    )
    g = _gen(seed + 1)
    candidates = torch.cat([torch.randint(0, vocab, (bs, 1), generator=g), tokens % vocab], 1)
    first_child = tree["retrive_next_token"]
    follow = candidates.gather(1, first_child.clamp(min=0))
    use = (torch.rand(bs, n, generator=g) < 0.7) & (first_child >= 0)
    target = torch.where(use, follow, torch.randint(0, vocab, (bs, n), generator=g))
    links = {k: tree[k] for k in ("retrive_index", "retrive_next_token", "retrive_next_sibling")}
    return candidates, links, target


def _verify_outs(bs: int, n: int, num_steps: int, idt) -> dict:
    return {
        "predicts": torch.empty(bs * n, dtype=torch.int64),
        "accept_index": torch.empty(bs, num_steps + 1, dtype=idt),
        "accept_length": torch.empty(bs, dtype=idt),
    }


@pytest.mark.parametrize("topk,num_steps,n", [(1, 4, 5), (4, 3, 10), (2, 5, 12), (8, 6, 64)])
def test_verify_tree_greedy_matches_reference(kernels, triton_device, topk, num_steps, n):
    bs, vocab = 5, 6
    candidates, links, target = _verify_case(SEED + n, bs, topk, num_steps, n, vocab)
    expected = _poisoned(
        ref.verify_tree_greedy,
        {"candidates": candidates, **links, "target_predict": target},
        _verify_outs(bs, n, num_steps, torch.int64),
        "cpu",
    )[0]
    assert int(expected["accept_length"].max()) >= 2, "test case too weak"
    for idt in (torch.int64, torch.int32):
        args = {
            "candidates": _on(candidates, triton_device),
            **{k: _on(v, triton_device, idt) for k, v in links.items()},
            "target_predict": _on(target, triton_device),
        }
        got = _poisoned(
            kernels["verify_tree_greedy"], args, _verify_outs(bs, n, num_steps, idt), triton_device
        )
        _same(got, expected, f"verify_tree_greedy[{idt}]")


@pytest.mark.parametrize("with_draft_probs", [False, True])
@pytest.mark.parametrize(
    "topk,num_steps,n,vocab", [(1, 3, 4, 7), (3, 3, 8, 12), (2, 2, 5, 1500), (8, 6, 64, 50)]
)
def test_verify_tree_sampling_matches_reference(
    kernels, triton_device, with_draft_probs, topk, num_steps, n, vocab
):
    bs = 6 if vocab < 100 else 2
    candidates, links, _ = _verify_case(SEED + 3 * n, bs, topk, num_steps, n, vocab)
    g = _gen(SEED + vocab)
    target_probs = (3.0 * torch.randn(bs, n, vocab, generator=g)).softmax(-1)
    # Mass on the first child's token so that acceptances and rejections both happen.
    target_probs.scatter_add_(2, candidates.roll(-1, 1).unsqueeze(2), torch.full((bs, n, 1), 2.0))
    target_probs /= target_probs.sum(-1, keepdim=True)
    draft_probs = torch.randn(bs, n, vocab, generator=g).softmax(-1) if with_draft_probs else None
    coins = torch.rand(bs, n, generator=g)
    final_coins = torch.rand(bs, generator=g)
    base = {"target_probs": target_probs, "draft_probs": draft_probs, "coins": coins}
    expected = _poisoned(
        ref.verify_tree_sampling,
        {"candidates": candidates, **links, **base, "final_coins": final_coins},
        _verify_outs(bs, n, num_steps, torch.int64),
        "cpu",
    )[0]
    args = {
        "candidates": _on(candidates, triton_device),
        **{k: _on(v, triton_device) for k, v in links.items()},
        **{k: None if v is None else _on(v, triton_device) for k, v in base.items()},
        "final_coins": _on(final_coins, triton_device),
    }
    got = _poisoned(
        kernels["verify_tree_sampling"],
        args,
        _verify_outs(bs, n, num_steps, torch.int64),
        triton_device,
    )
    _same(got, expected, "verify_tree_sampling")
    assert int(expected["accept_length"].max()) >= 1, "test case too weak: nothing accepted"


# ----------------------------------------------------------------------------- slot bookkeeping


@pytest.mark.parametrize(
    "topk,num_steps,page_size", [(1, 3, 1), (4, 3, 1), (3, 5, 4), (2, 2, 16), (8, 6, 1)]
)
def test_assign_draft_cache_locs_matches_reference(
    kernels, triton_device, topk, num_steps, page_size
):
    g = _gen(SEED + page_size + topk)
    bs, rows, cols = 3, 5, 48
    width = ref.draft_lane_width(num_steps, page_size)
    req_to_token = torch.randint(1, 10000, (rows, cols), generator=g)
    req_pool_indices = torch.randperm(rows, generator=g)[:bs]
    seq_lens = torch.randint(1, cols - 1, (bs,), generator=g)
    seq_lens[0] = 2 * page_size  # a prefix without a partial page
    alloc_slots = torch.randperm(20000, generator=g)[: bs * topk * width] + 1
    copies = bs * topk * (page_size - 1)

    def outs(idt):
        return {
            "lane_locs": torch.empty(bs, topk, width, dtype=idt),
            "tail_lens": torch.empty(bs, dtype=idt),
            "copy_src": torch.empty(copies, dtype=idt),
            "copy_dst": torch.empty(copies, dtype=idt),
        }

    common = {"topk": topk, "num_steps": num_steps, "page_size": page_size}
    tensors = {
        "req_pool_indices": req_pool_indices,
        "req_to_token": req_to_token,
        "seq_lens": seq_lens,
        "alloc_slots": alloc_slots,
    }
    expected = _poisoned(
        ref.assign_draft_cache_locs, {**tensors, **common}, outs(torch.int64), "cpu"
    )[0]
    for idt in (torch.int64, torch.int32):
        args = {k: _on(v, triton_device, idt) for k, v in tensors.items()}
        got = _poisoned(
            kernels["assign_draft_cache_locs"], {**args, **common}, outs(idt), triton_device
        )
        _same(got, expected, f"assign_draft_cache_locs[{idt}]")


def test_assign_req_to_token_and_extend_cache_locs_match_reference(kernels, triton_device):
    g = _gen(SEED + 21)
    bs, rows, cols = 4, 6, 300
    req_pool_indices = torch.randperm(rows, generator=g)[:bs]
    start = torch.randint(0, 20, (bs,), generator=g)
    lens = torch.tensor([3, 0, 150, 7])  # an empty segment and one longer than a block
    end = start + lens
    slots = torch.randperm(10000, generator=g)[: int(lens.sum())] + 1
    table = torch.randint(1, 10000, (rows, cols), generator=g)
    for idt in (torch.int64, torch.int32):
        expected = table.clone()
        ref.assign_req_to_token(req_pool_indices, expected, start, end, slots)
        got = _on(table, triton_device, idt)
        dev = {k: _on(v, triton_device, idt) for k, v in
               {"req_pool_indices": req_pool_indices, "start": start, "end": end}.items()}  # fmt: skip
        kernels["assign_req_to_token"](
            dev["req_pool_indices"], got, dev["start"], dev["end"], _on(slots, triton_device, idt)
        )
        assert torch.equal(got.cpu().long(), expected), f"assign_req_to_token[{idt}]"

        out = {"out": torch.empty(int(lens.sum()), dtype=idt)}
        exp = _poisoned(
            ref.assign_extend_cache_locs,
            {
                "req_pool_indices": req_pool_indices,
                "req_to_token": table,
                "start": start,
                "end": end,
            },
            {"out": torch.empty(int(lens.sum()), dtype=torch.int64)},
            "cpu",
        )[0]
        res = _poisoned(
            kernels["assign_extend_cache_locs"],
            {**dev, "req_to_token": _on(table, triton_device, idt)},
            out,
            triton_device,
        )
        _same(res, exp, f"assign_extend_cache_locs[{idt}]")


def test_assign_block_cache_locs_matches_reference(kernels, triton_device):
    """Fixed-width blocks wider than the kernel's 128-slot step, a padding request, a block
    past the table's last column, and per-request inputs that are strided columns of one
    upload (as a captured prefill passes them)."""
    g = _gen(SEED + 22)
    bs, rows, cols, width = 4, 6, 300, 150
    req_pool_indices = torch.randperm(rows, generator=g)[:bs]
    start = torch.tensor([0, 9, 250, 40])
    lens = torch.tensor([150, 0, 37, 129])
    table = torch.randint(1, 10000, (rows, cols), generator=g)
    n = bs * width
    exp = _poisoned(
        ref.assign_block_cache_locs,
        {"req_pool_indices": req_pool_indices, "req_to_token": table, "start": start,
         "lens": lens, "width": width},
        {"out_loc": torch.empty(n, dtype=torch.int64), "positions": torch.empty(n, dtype=torch.int64)},
        "cpu",
    )[0]  # fmt: skip
    for idt in (torch.int64, torch.int32):
        host = _on(torch.stack([req_pool_indices, start, lens], 1), triton_device, idt)  # [bs, 3]
        res = _poisoned(
            kernels["assign_block_cache_locs"],
            {"req_pool_indices": host[:, 0], "req_to_token": _on(table, triton_device, idt),
             "start": host[:, 1], "lens": host[:, 2], "width": width},
            {"out_loc": torch.empty(n, dtype=idt), "positions": torch.empty(n, dtype=torch.int64)},
            triton_device,
        )  # fmt: skip
        _same(res, exp, f"assign_block_cache_locs[{idt}]")


@pytest.mark.parametrize("cache_dtype", FLOATS)
def test_store_kv_casts_and_reads_strided_inputs(triton_device, cache_dtype):
    """The K/V store of the cuda backend's row-invariant attention (not a KernelSet entry)."""
    from polyspec.kernels.triton.cache import store_kv

    g = _gen(SEED + 24)
    k = torch.randn(32, 2, 8, generator=g).to(cache_dtype)
    v = torch.randn(32, 2, 8, generator=g).to(cache_dtype)
    loc = torch.tensor([3, 31, 1, 17, 9])
    # k / v as slices of a fused [T, Hq + 2*Hkv, D] fp32 projection: strided, another dtype.
    qkv = torch.randn(5, 6, 8, generator=g)
    nk, nv = qkv[:, 2:4], qkv[:, 4:6]
    ek, ev = k.clone(), v.clone()
    ek[loc], ev[loc] = nk.to(cache_dtype), nv.to(cache_dtype)
    gk, gv = _on(k, triton_device), _on(v, triton_device)
    dq = _on(qkv, triton_device)
    store_kv(gk, gv, _on(loc, triton_device), dq[:, 2:4], dq[:, 4:6])
    _assert_rounded_equal(gk, ek, triton_device, "store_kv k")
    _assert_rounded_equal(gv, ev, triton_device, "store_kv v")
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[loc] = False
    assert torch.equal(gk.cpu()[untouched], k[untouched]), "store_kv touched an unlisted slot"


def test_assign_accept_locs_reads_strided_columns(kernels, triton_device):
    """A captured round passes rows / lengths / widths as columns of one [bs, 4] upload (its
    transpose), and accept_length may be a strided slice too."""
    g = _gen(SEED + 25)
    bs, num_steps, n, cols = 4, 3, 8, 40
    depth = num_steps + 1
    table = torch.randint(1, 10000, (6, cols), generator=g)
    rows = torch.randperm(6, generator=g)[:bs]
    seq_lens, widths, accept_index, accept_length = _accept_case(g, bs, num_steps, n, cols)
    host = torch.stack([rows, seq_lens, widths, accept_length], dim=1)  # [bs, 4]

    def outs(device: str) -> dict[str, torch.Tensor]:
        flat = {k: torch.empty(bs * depth, dtype=torch.int64, device=device)
                for k in ("src_loc", "dst_loc", "positions", "path_node")}  # fmt: skip
        return flat | {k: torch.empty(bs, dtype=torch.int64, device=device)
                       for k in ("extend_lens", "last_index")}  # fmt: skip

    expected = outs("cpu")
    ref.assign_accept_locs(rows, table, seq_lens, widths, accept_index, accept_length, n,
                           **expected)  # fmt: skip
    dh = _on(host, triton_device)
    got = _poisoned(
        kernels["assign_accept_locs"],
        {
            "req_pool_indices": dh[:, 0],
            "req_to_token": _on(table, triton_device),
            "seq_lens": dh[:, 1],
            "widths": dh[:, 2],
            "accept_index": _on(accept_index, triton_device),
            "accept_length": dh[:, 3],
            "num_draft_tokens": n,
        },
        outs(triton_device),
        triton_device,
    )
    _same(got, expected, "assign_accept_locs (strided)")


# ----------------------------------------------------------------------------- model kernels


@pytest.mark.parametrize("dtype", FLOATS)
def test_rms_norm_and_fused_add_match_reference(kernels, triton_device, dtype):
    g = _gen(SEED + 31)
    x = (3 * torch.randn(5, 48, generator=g)).to(dtype)
    res = torch.randn(5, 48, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(48, generator=g)).to(dtype)
    x0, res0 = x.clone(), res.clone()
    dx, dres, dw = _on(x, triton_device), _on(res, triton_device), _on(w, triton_device)
    got = kernels["rms_norm"](dx, dw, 1e-6)
    expected = ref.rms_norm(x, w, 1e-6)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got.cpu(), expected, **TOL[dtype])
    got_n, got_s = kernels["fused_add_rms_norm"](dx, dres, dw, 1e-6)
    exp_n, exp_s = ref.fused_add_rms_norm(x, res, w, 1e-6)
    _assert_rounded_equal(got_s, exp_s, triton_device, "fused_add_rms_norm sum")
    torch.testing.assert_close(got_n.cpu(), exp_n, **TOL[dtype])
    assert torch.equal(dx.cpu(), x0) and torch.equal(dres.cpu(), res0), "inputs modified"
    # fp32 weight on a low-precision input promotes like the reference.
    wf = w.float()
    got = kernels["rms_norm"](dx, _on(wf, triton_device), 1e-6)
    expected = ref.rms_norm(x, wf, 1e-6)
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got.cpu(), expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_draft_layer_input_matches_reference(kernels, triton_device, dtype, index_dtype):
    """One launch for the embedding lookup and both RMSNorms: each half is exactly what the
    Triton ``rms_norm`` gives its input, and close to the reference; a strided features view
    reads right."""
    g = _gen(SEED + 34)
    embed = (2 * torch.randn(30, 48, generator=g)).to(dtype)
    wide = (3 * torch.randn(5, 96, generator=g)).to(dtype)
    feats = wide[:, 24:72]  # row stride 96
    w_e, w_f = ((1 + 0.1 * torch.randn(48, generator=g)).to(dtype) for _ in range(2))
    ids = torch.tensor([29, 0, 7, 7, 12])
    d = {n: _on(t, triton_device) for n, t in (("embed", embed), ("w_e", w_e), ("w_f", w_f))}
    dfeats = _on(wide, triton_device)[:, 24:72]
    got = kernels["draft_layer_input"](
        _on(ids, triton_device, index_dtype), d["embed"], dfeats, d["w_e"], d["w_f"], 1e-6
    )
    expected = ref.draft_layer_input(ids, embed, feats, w_e, w_f, 1e-6)
    assert got.dtype == expected.dtype and got.shape == (5, 96)
    torch.testing.assert_close(got.cpu(), expected, **TOL[dtype])
    halves = (kernels["rms_norm"](d["embed"][_on(ids, triton_device)], d["w_e"], 1e-6),
              kernels["rms_norm"](dfeats.contiguous(), d["w_f"], 1e-6))  # fmt: skip
    assert torch.equal(got.cpu(), torch.cat(halves, -1).cpu()), "not the Triton rms_norm's"
    with pytest.raises(ValueError, match="embed_weight"):
        kernels["draft_layer_input"](
            _on(ids, triton_device), d["embed"][:, :40], dfeats, d["w_e"], d["w_f"], 1e-6
        )


def _cos_sin_cache(max_pos: int, dim: int) -> torch.Tensor:
    inv = 1.0 / 10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    freqs = torch.arange(max_pos, dtype=torch.float32).unsqueeze(1) * inv
    return torch.cat([freqs.cos(), freqs.sin()], dim=1)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype", FLOATS)
def test_rotary_embedding_matches_reference(kernels, triton_device, is_neox, dtype):
    g = _gen(SEED + 32)
    dim = 16
    cache = _cos_sin_cache(64, dim)
    positions = torch.randint(0, 64, (6,), generator=g)
    qkv = torch.randn(6, 4 + 2 + 2, dim, generator=g).to(dtype)
    q, k = qkv[:, :4], qkv[:, 4:6]  # strided views, as after a fused projection
    eq, ek = ref.rotary_embedding(positions, q, k, cache, is_neox)
    d = _on(qkv, triton_device)
    gq, gk = kernels["rotary_embedding"](
        _on(positions, triton_device, torch.int32),
        d[:, :4],
        d[:, 4:6],
        _on(cache, triton_device),
        is_neox,
    )
    assert gq.dtype == dtype and gk.dtype == dtype
    torch.testing.assert_close(gq.cpu(), eq, **TOL[dtype])
    torch.testing.assert_close(gk.cpu(), ek, **TOL[dtype])
    assert torch.equal(d.cpu(), qkv), "inputs modified"


def test_rotary_embedding_strided_positions(kernels, triton_device):
    """Positions may be a broadcast view (one position per request, repeated for its K draft
    lanes: stride 0); the kernel must read the values, not the memory after the first one.
    On the H200 this once read past the tensor inside a captured draft loop."""
    g = _gen(SEED + 34)
    dim = 16
    cache = _cos_sin_cache(64, dim)
    base = torch.tensor([37])
    positions = base[:, None].expand(1, 4).reshape(-1)  # [4], stride 0
    assert positions.stride() == (0,)
    q = torch.randn(4, 3, dim, generator=g)
    k = torch.randn(4, 1, dim, generator=g)
    eq, ek = ref.rotary_embedding(positions.contiguous(), q, k, cache, True)
    dev_pos = _on(base, triton_device)[:, None].expand(1, 4).reshape(-1)
    gq, gk = kernels["rotary_embedding"](
        dev_pos, _on(q, triton_device), _on(k, triton_device), _on(cache, triton_device), True
    )
    torch.testing.assert_close(gq.cpu(), eq)
    torch.testing.assert_close(gk.cpu(), ek)


@pytest.mark.parametrize("cache_dtype", FLOATS)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype", FLOATS)
def test_rotary_store_kv_is_rotary_then_store_kv(triton_device, dtype, is_neox, cache_dtype):
    """The row-invariant attention's fused rotary + K/V store writes bitwise what the Triton
    ``rotary_embedding`` then ``store_kv`` write (q returned, k and v in the cache, nothing
    else touched), from strided views of a fused projection and broadcast positions."""
    from polyspec.kernels.triton.cache import store_kv
    from polyspec.kernels.triton.rope import rotary_embedding, rotary_store_kv

    g = _gen(SEED + 35)
    dim, slots = 16, 40
    cache = _on(_cos_sin_cache(64, dim), triton_device)
    qkv = _on(torch.randn(6, 4 + 2 + 2, dim, generator=g).to(dtype), triton_device)
    q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    positions = _on(torch.tensor([5, 37, 37]), triton_device)[:, None].expand(3, 2).reshape(-1)
    loc = _on(torch.tensor([3, 39, 1, 17, 9, 22]), triton_device)
    k_cache = _on(torch.randn(slots, 2, dim, generator=g).to(cache_dtype), triton_device)
    v_cache = _on(torch.randn(slots, 2, dim, generator=g).to(cache_dtype), triton_device)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_q, rotated_k = rotary_embedding(positions, q, k, cache, is_neox)
    store_kv(want_k, want_v, loc, rotated_k, v)
    got_q = rotary_store_kv(positions, q, k, v, cache, is_neox, k_cache, v_cache, loc)
    assert got_q.dtype == dtype and torch.equal(got_q.cpu(), want_q.cpu()), "q"
    assert torch.equal(k_cache.cpu(), want_k.cpu()), "k cache"
    assert torch.equal(v_cache.cpu(), want_v.cpu()), "v cache"
    with pytest.raises(ValueError, match="v must be"):
        rotary_store_kv(positions, q, k, v[:, :1], cache, is_neox, k_cache, v_cache, loc)


@pytest.mark.parametrize("dtype", FLOATS)
def test_silu_and_mul_matches_reference(kernels, triton_device, dtype):
    g = _gen(SEED + 33)
    x = torch.randn(2, 3, 2 * 20, generator=g).to(dtype)
    got = kernels["silu_and_mul"](_on(x, triton_device))
    expected = ref.silu_and_mul(x)
    assert got.dtype == dtype and got.shape == (2, 3, 20)
    torch.testing.assert_close(got.cpu(), expected, **TOL[dtype])


@pytest.mark.parametrize("form", ["auto", "loop", "whole"])
@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_topk_matches_reference(kernels, triton_device, dtype, k, form):
    """Ids of equal logits to the reference's (equal logits may swap), probabilities within
    fp32 rounding, best first, over rows that span several of the loop form's blocks; ties
    come lower id first, and -inf logits (a masked vocabulary) get probability 0. Both forms
    of the kernel, and the one the wrapper picks (``auto``: the whole row up to WHOLE_MAX)."""
    from polyspec.kernels.triton.topk import softmax_topk_form

    def call(x, k, index_map=None):
        if form == "auto":
            return kernels["softmax_topk"](x, k, index_map=index_map)
        return softmax_topk_form(x, k, form=form, index_map=index_map)

    g = _gen(SEED + 34 + k)
    for rows, vocab in ((3, 5000), (2, 13), (1, 2048)):
        logits = (4 * torch.randn(rows, vocab, generator=g)).to(dtype)
        logits[0, 7] = logits[0, 2100 % vocab] = logits[0].max() + 1  # a tie at the top
        if rows > 1 and vocab > 20:
            logits[1, 10:] = float("-inf")  # only 10 finite logits
        p, idx = call(_on(logits, triton_device), k)
        want_p, want_idx = ref.softmax_topk(logits, k)
        assert p.dtype == torch.float32 and p.shape == (rows, k)
        assert idx.dtype == torch.int64 and idx.shape == (rows, k)
        lf = logits.float()
        assert torch.equal(lf.gather(1, idx.cpu()), lf.gather(1, want_idx))
        torch.testing.assert_close(p.cpu(), want_p, rtol=1e-5, atol=1e-7)
        assert int(idx[0, 0]) == 7, "ties come lower id first"
        assert (p.cpu()[:, :-1] >= p.cpu()[:, 1:]).all()
        index_map = torch.randperm(vocab, generator=g) * 3 + 5  # a draft -> target map
        mp, midx = call(_on(logits, triton_device), k, _on(index_map, triton_device))
        assert midx.dtype == torch.int64 and torch.equal(mp.cpu(), p.cpu())
        assert torch.equal(midx.cpu(), index_map[idx.cpu()]), "ids not mapped in the launch"
    strided = (4 * torch.randn(4, 600, generator=g)).to(dtype)[:, ::2]
    p, idx = call(_on(strided, triton_device), k)
    want_p, _ = ref.softmax_topk(strided, k)
    torch.testing.assert_close(p.cpu(), want_p, rtol=1e-5, atol=1e-7)
    few = torch.full((2, 40), float("-inf"), dtype=dtype)
    few[0, 3], few[1, 5], few[1, 30] = 1.0, 2.0, 2.0  # fewer finite logits than k (k = 3, 8)
    p, idx = call(_on(few, triton_device), k)
    p, idx = p.cpu(), idx.cpu()
    assert int(idx[0, 0]) == 3 and float(p[0, 0]) == 1.0
    assert idx[1, :2].tolist() == [5, 30][:k] and torch.allclose(p[1, :2], torch.tensor(0.5))
    assert (p[:, 2:] == 0).all() and (p[0, 1:] == 0).all()
    if form != "loop":  # the loop form fills the places past the finite logits with id 0
        assert all(len(set(r)) == len(r) for r in idx.tolist()), "an id picked twice in a row"


def test_softmax_topk_past_the_whole_form_loops(kernels, triton_device):
    """Vocabularies past WHOLE_MAX (a full target vocabulary) take the loop form; the whole
    form refuses them with a clear error."""
    from polyspec.kernels.triton.topk import WHOLE_MAX, softmax_topk_form

    g = _gen(SEED + 35)
    logits = torch.randn(1, WHOLE_MAX + 5, generator=g)
    logits[0, WHOLE_MAX + 2] = 9.0
    p, idx = kernels["softmax_topk"](_on(logits, triton_device), 2)
    want_p, want_idx = ref.softmax_topk(logits, 2)
    assert idx.cpu().tolist() == want_idx.tolist()
    torch.testing.assert_close(p.cpu(), want_p, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="whole form reads at most"):
        softmax_topk_form(_on(logits, triton_device), 2, form="whole")


def test_bad_shapes_raise_clear_errors(kernels, triton_device):
    with pytest.raises(ValueError, match="top_scores_index"):
        outs = _tree_outs(TreeMaskMode.TREE_ONLY, 1, 4, torch.tensor([2]), torch.int64)
        kernels["build_tree"](
            torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long),
            torch.tensor([2]), 1, 3, 4, TreeMaskMode.TREE_ONLY, **outs,
        )  # fmt: skip
    with pytest.raises(ValueError, match="even last dim"):
        kernels["silu_and_mul"](torch.zeros(2, 5, device=triton_device))
    with pytest.raises(ValueError, match="weight"):
        kernels["rms_norm"](torch.zeros(2, 8, device=triton_device), torch.ones(4), 1e-6)


@pytest.mark.parametrize("dtype", FLOATS)
def test_apply_token_bitmask_matches_reference(kernels, triton_device, dtype):
    """Bit-exact with the reference: -inf where the bit is clear or past 32 * W, every other
    logit untouched; rows spanning several blocks, a strided logits view, an all-ones row."""
    g = _gen(SEED + 51)
    for rows, vocab, width in ((3, 2500, 79), (2, 70, 2), (1, 33, 2)):
        logits = (4 * torch.randn(rows, vocab, generator=g)).to(dtype)
        mask = torch.randint(-(2**31), 2**31, (rows, width), generator=g).to(torch.int32)
        mask[0] = -1
        want = logits.clone()
        ref.apply_token_bitmask(want, mask)
        got = _on(logits, triton_device)
        kernels["apply_token_bitmask"](got, _on(mask, triton_device))
        assert torch.equal(got.cpu(), want), f"{rows}x{vocab} W={width}"
        assert torch.equal(got.cpu()[0, : 32 * width], logits[0, : 32 * width])
    wide = (4 * torch.randn(2, 200, generator=g)).to(dtype)
    view = wide[:, 50:150]  # row stride 200, 100 logits
    mask = torch.randint(-(2**31), 2**31, (2, 4), generator=g).to(torch.int32)
    want = view.clone()
    ref.apply_token_bitmask(want, mask)
    dev = _on(wide, triton_device)
    kernels["apply_token_bitmask"](dev[:, 50:150], _on(mask, triton_device))
    assert torch.equal(dev.cpu()[:, 50:150], want)
    assert torch.equal(dev.cpu()[:, :50], wide[:, :50]), "wrote outside the view"


@pytest.mark.parametrize("dtype", FLOATS)
def test_argmax_matches_reference(kernels, triton_device, dtype):
    """Equal to the reference (the first index of each row's maximum): vocabularies of one
    block, several and a ragged last block; ties inside a block and across blocks (the first
    block's index wins), a maximum in the ragged tail, a row of -inf (index 0), a strided view."""
    from polyspec.kernels.triton.argmax import BLOCK

    g = _gen(SEED + 61)
    for rows, vocab in ((3, 100), (4, 2 * BLOCK), (5, 3 * BLOCK + 17)):
        logits = (4 * torch.randn(rows, vocab, generator=g)).to(dtype)
        if vocab > BLOCK:
            logits[1, [5, BLOCK + 3]] = 100.0  # a tie across blocks
            logits[2, [BLOCK - 1, BLOCK - 2]] = 100.0  # a tie inside a block
            logits[3, vocab - 1] = 100.0  # the maximum in the last block
        logits[0] = float("-inf")
        want = ref.argmax(logits)
        got = kernels["argmax"](_on(logits, triton_device))
        assert got.dtype == torch.int64 and torch.equal(got.cpu(), want), f"{rows}x{vocab}"
    wide = (4 * torch.randn(2, 300, generator=g)).to(dtype)
    view = wide[:, 100:250]
    got = kernels["argmax"](_on(wide, triton_device)[:, 100:250])
    assert torch.equal(got.cpu(), ref.argmax(view))
    assert kernels["argmax"](_on(wide[:0], triton_device)).shape == (0,)
