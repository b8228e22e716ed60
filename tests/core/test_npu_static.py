"""What can be checked of the npu backend without Ascend hardware.

1. Importing every ``polyspec.backends.npu`` module and running the probe imports no
   ``torch_npu`` (checked in a fresh interpreter, where a booby-trapped ``torch_npu`` package
   shadows any real one: importing it raises).
2. Every npu source file parses, and every ``torch_npu.X`` / ``torch.npu.X`` it uses is in the
   documented list of known API names (``backends/npu/api_names.py``, with sources).
3. An unusable install (torch_npu importable but CANN missing) is reported with the CANN hint.
"""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
NPU_DIR = REPO / "backends" / "npu"
MODULES = sorted(p.stem for p in NPU_DIR.glob("*.py") if p.stem != "__init__")


def _run(code: str, extra_path: Path | None = None) -> subprocess.CompletedProcess:
    env_path = [str(extra_path)] if extra_path else []
    prelude = f"import sys; sys.path[:0] = {env_path!r}\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


@pytest.fixture()
def trapped_torch_npu(tmp_path: Path) -> Path:
    """A directory holding a ``torch_npu`` package whose import raises."""
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('torch_npu was imported (trap)')\n")
    return tmp_path


def test_npu_modules_and_probe_import_no_torch_npu(trapped_torch_npu):
    assert {"plugin", "backend", "attention", "kernels", "kv_pool", "runtime"} <= set(MODULES)
    code = f"""
    import importlib, os, sys
    for name in {MODULES!r}:
        importlib.import_module("polyspec.backends.npu." + name)
    from polyspec.backends.npu import plugin
    result = plugin.probe(dict(os.environ))
    from polyspec.plugins import discover
    reports = {{r.name: r for r in discover()}}
    loaded = sorted(m for m in sys.modules if m.split(".")[0] == "torch_npu")
    assert not loaded, loaded
    assert not hasattr(sys.modules["torch"], "npu"), "torch.npu was registered"
    print("probe:", result.available, result.reason)
    print("report:", reports["npu"].available, reports["npu"].reason)
    """
    proc = _run(code, trapped_torch_npu)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The trap is importable by find_spec, so the probe sees "torch_npu installed" and goes on
    # to the other checks (no device here).
    assert "no Ascend NPU" in proc.stdout


def test_unusable_install_reports_the_cann_hint(trapped_torch_npu):
    code = """
    from polyspec.errors import PluginError
    from polyspec.backends.npu.backend import NPUBackend
    try:
        NPUBackend()
    except PluginError as exc:
        print("ERROR:", exc)
    else:
        raise SystemExit("NPUBackend() succeeded without an NPU")
    """
    proc = _run(code, trapped_torch_npu)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "cannot import torch_npu" in proc.stdout
    assert "set_env.sh" in proc.stdout and "CANN" in proc.stdout


def test_probe_reasons_name_the_fix(monkeypatch):
    from polyspec.backends.npu import plugin as npu

    monkeypatch.setattr(npu, "has_module", lambda name: True)
    monkeypatch.setattr(npu, "device_nodes", lambda pattern: ["/dev/davinci0"])
    monkeypatch.setattr(npu, "torch_build_info", lambda: ("2.5.1", {"cuda": None}))
    monkeypatch.setattr(npu, "_version", lambda dist: "2.5.1.post1")
    old = npu.probe({"ASCEND_HOME_PATH": "/x"})
    assert not old.available and "older than 2.10.0" in old.reason
    assert "torch-npu==2.10.0.post4" in old.reason
    monkeypatch.setattr(npu, "torch_build_info", lambda: ("2.10.0", {"cuda": None}))
    monkeypatch.setattr(npu, "_version", lambda dist: "2.10.0.post4")
    ok = npu.probe({"ASCEND_HOME_PATH": "/usr/local/Ascend/ascend-toolkit/latest"})
    assert ok.available, ok.reason
    no_cann = npu.probe({})
    assert not no_cann.available and "set_env.sh" in no_cann.reason
    monkeypatch.setattr(npu, "torch_build_info", lambda: ("2.10.0+cu121", {"cuda": "12.1"}))
    cuda = npu.probe({"ASCEND_HOME_PATH": "/x"})
    assert "CUDA build" in cuda.reason and "separate environment" in cuda.reason
    monkeypatch.setattr(npu, "torch_build_info", lambda: ("2.6.0", {"cuda": None}))
    mismatch = npu.probe({"ASCEND_HOME_PATH": "/x"})
    assert "does not match torch 2.6.0" in mismatch.reason


def _vendor_attributes(tree: ast.AST) -> tuple[set[str], set[str], set[str]]:
    """(torch_npu.X names, torch_npu.X.Y overloads "X.Y", torch.npu.X names) used in ``tree``.

    Follows the local aliases the npu code uses: ``torch_npu = import_torch_npu()`` and
    ``npu = torch.npu``."""
    npu_aliases = {"torch_npu"}
    dot_npu_aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
            if not isinstance(target, ast.Name):
                continue
            if (
                isinstance(value, ast.Call)
                and isinstance(value.func, ast.Name)
                and value.func.id == "import_torch_npu"
            ):
                npu_aliases.add(target.id)
            if ast.unparse(value) == "torch.npu":
                dot_npu_aliases.add(target.id)
    names, overloads, dot_npu = set(), set(), set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        base = ast.unparse(node.value)
        if base in npu_aliases:
            names.add(node.attr)
        elif isinstance(node.value, ast.Attribute) and ast.unparse(node.value.value) in npu_aliases:
            overloads.add(f"{node.value.attr}.{node.attr}")
        elif base == "torch.npu" or base in dot_npu_aliases:
            dot_npu.add(node.attr)
    return names, overloads, dot_npu


def test_sources_parse_and_use_only_documented_vendor_names():
    from polyspec.backends.npu.api_names import (
        TORCH_DOT_NPU_NAMES,
        TORCH_NPU_NAMES,
        TORCH_NPU_OVERLOADS,
    )

    used_names, used_overloads, used_dot_npu = set(), set(), set()
    for path in sorted(NPU_DIR.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):  # torch_npu is imported in runtime.py only, inside a function
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                )
                if any(m.split(".")[0] == "torch_npu" for m in mods):
                    assert path.name == "runtime.py", f"{path.name} imports torch_npu"
                    assert node.col_offset > 0, "torch_npu imported at module level"
        names, overloads, dot_npu = _vendor_attributes(tree)
        used_names |= names
        used_overloads |= overloads
        used_dot_npu |= dot_npu
    assert used_names, "the static check found no torch_npu use: the alias tracking is broken"
    assert used_names <= set(TORCH_NPU_NAMES), used_names - set(TORCH_NPU_NAMES)
    assert used_overloads <= set(TORCH_NPU_OVERLOADS), used_overloads - set(TORCH_NPU_OVERLOADS)
    assert used_dot_npu <= set(TORCH_DOT_NPU_NAMES), used_dot_npu - set(TORCH_DOT_NPU_NAMES)
    # The attention really uses the operators this backend is built on.
    assert {"npu_fused_infer_attention_score", "npu_scatter_pa_kv_cache"} <= used_names
    assert "_npu_paged_attention" not in used_names  # one fused path for every mode
    assert {"NPUGraph", "graph"} <= used_dot_npu


def test_static_check_catches_an_undocumented_name():
    tree = ast.parse(
        "def f():\n    torch_npu = import_torch_npu()\n    torch_npu.npu_made_up_op(1)\n"
        "    npu = torch.npu\n    npu.not_a_thing()\n"
    )
    names, _, dot_npu = _vendor_attributes(tree)
    assert names == {"npu_made_up_op"} and dot_npu == {"not_a_thing"}


def test_npu_kernel_set_falls_back_to_the_reference_without_triton(monkeypatch):
    """Without Triton (as here) every Triton kernel keeps the reference, with the reason."""
    import builtins

    from polyspec.backends.npu.kernels import build_kernels

    real_import = builtins.__import__

    def no_triton(name, *args, **kwargs):
        if name.split(".")[0] == "triton":
            raise ImportError("No module named 'triton' (test)")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_triton)
    for mod in [m for m in sys.modules if m.startswith("polyspec.kernels.triton.")]:
        monkeypatch.delitem(sys.modules, mod)
    built = build_kernels()
    assert built.sources["build_tree"].startswith("reference (import of tree failed")
    from polyspec.kernels import reference

    assert built.kernels.build_tree is reference.build_tree
    assert built.kernels.sample is reference.sample


def test_a_kernel_that_fails_to_compile_falls_back_once_and_says_why():
    from polyspec.backends.npu.kernels import _TritonWithFallback

    class CompilationError(Exception):
        pass

    CompilationError.__module__ = "triton.compiler.errors"  # what Triton raises
    calls = []

    def broken(x):
        calls.append("triton")
        raise CompilationError("unsupported op on this target")

    def reference(x):
        calls.append("reference")
        return x + 1

    sources = {"silu_and_mul": "triton"}
    kernel = _TritonWithFallback("silu_and_mul", broken, reference, sources)
    with pytest.warns(RuntimeWarning, match="using the torch reference"):
        assert kernel(3) == 4
    assert kernel(5) == 6  # same signature (an int not 1, not a multiple of 16): no retry
    assert calls == ["triton", "reference", "reference"]
    assert sources["silu_and_mul"].startswith("reference for 1 signature(s)")
    assert "CompilationError" in sources["silu_and_mul"]

    def picky(x):  # compiles for float32 tensors only
        if x.dtype != torch.float32:
            raise CompilationError("no bf16 on this target")
        calls.append("triton")
        return x * 2

    per_sig = {}
    kernel = _TritonWithFallback("rms_norm", picky, lambda x: x * 3, per_sig)
    with pytest.warns(RuntimeWarning, match=r"bfloat16\[1d\]"):
        assert kernel(torch.ones(2, dtype=torch.bfloat16)).tolist() == [3.0, 3.0]
    assert kernel(torch.ones(2)).tolist() == [2.0, 2.0]  # another signature keeps Triton
    assert per_sig["rms_norm"].startswith("triton, reference for 1 signature(s) ((bfloat16[1d])")

    def bad_input(x):
        raise ValueError("x must be 2-D")  # the wrapper's own contract check: not a fallback

    strict = _TritonWithFallback("rms_norm", bad_input, reference, {})
    with pytest.raises(ValueError, match="2-D"):
        strict(1)


def _npu_attention_on_cpu(num_slots: int = 16 * 128):
    """The npu attention's host-side metadata logic, on a bfloat16 pool on the CPU (building
    metadata for the fused operators calls no torch_npu function)."""
    from polyspec.backends.npu.attention import NPUAttention
    from polyspec.backends.npu.kv_pool import NPUKVPool

    pool = NPUKVPool(num_slots, 1, 2, 16, torch.bfloat16, "cpu")
    return NPUAttention(pool, 4, 2, 16, 0.25, 128)


def _slot_of_column(table, row: int, col: int, page: int = 128) -> int:
    return int(table[row, col // page]) * page + col % page


def test_npu_metadata_expresses_the_tree_and_lane_visibility():
    """Decoding the block tables and masks built for the fused operators gives back exactly
    the keys the ForwardMode contract makes visible (TARGET_VERIFY trees, DRAFT_DECODE lanes)."""
    from polyspec.backend import ForwardBatch, ForwardMode

    attn = _npu_attention_on_cpu()
    i32 = torch.int32
    table = torch.zeros(3, 512, dtype=i32)
    table[2, :256] = torch.arange(3 * 128, 5 * 128, dtype=i32)  # request 0: pages 3, 4
    table[0, :128] = torch.arange(9 * 128, 10 * 128, dtype=i32)  # request 1: page 9
    prefix, n = [130, 7], 4
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    batch = ForwardBatch(
        mode=ForwardMode.TARGET_VERIFY, input_ids=torch.zeros(8, dtype=torch.long),
        positions=torch.zeros(8, dtype=torch.long),
        out_cache_loc=torch.cat([table[2, 130:134], table[0, 7:11]]),
        req_pool_indices=torch.tensor([2, 0], dtype=i32), req_to_token=table,
        prefix_lens=torch.tensor(prefix, dtype=i32), extend_lens=torch.tensor([n, n], dtype=i32),
        prefix_lens_cpu=prefix, extend_lens_cpu=[n, n], tree_mask=torch.stack([tree, tree]),
    )  # fmt: skip
    m = attn.build_metadata(batch)
    assert m.lengths.kv_lens == [134, 11] and m.queries_per_row == n
    kwargs = attn.fia_kwargs(m, m.lengths)
    assert kwargs["actual_seq_lengths"] == [n, n] and kwargs["input_layout"] == "BSND"
    assert kwargs["sparse_mode"] == 0  # a tree (topk > 1): the explicit mask
    chain = torch.ones(n, n, dtype=torch.bool).tril()
    m_chain = attn.build_metadata(dataclasses.replace(batch, tree_mask=torch.stack([chain] * 2)))
    kw_chain = attn.fia_kwargs(m_chain, m_chain.lengths)
    assert kw_chain["input_layout"] == "TND" and kw_chain["sparse_mode"] == 3
    assert kw_chain["actual_seq_lengths"] == [n, 2 * n]  # a chain verifies causally
    for b, row in enumerate([2, 0]):
        for i in range(n):
            seen = [
                _slot_of_column(m.block_table, b, c)
                for c in range(m.atten_mask.shape[-1])
                if not bool(m.atten_mask[b, 0, i, c])
            ]
            want = table[row, : prefix[b]].tolist() + [
                int(table[row, prefix[b] + j]) for j in range(n) if tree[i, j]
            ]
            assert seen == want, (b, i)

    # DRAFT_DECODE: 2 lanes of 1 page each after a page-aligned prefix of 128 (request 0).
    lanes = torch.stack([torch.arange(p * 128, (p + 1) * 128, dtype=i32) for p in (12, 13)])
    batch = ForwardBatch(
        mode=ForwardMode.DRAFT_DECODE, input_ids=torch.zeros(2, dtype=torch.long),
        positions=torch.zeros(2, dtype=torch.long), out_cache_loc=lanes[:, 2].contiguous(),
        req_pool_indices=torch.tensor([2], dtype=i32), req_to_token=table,
        prefix_lens=torch.tensor([128], dtype=i32), extend_lens=torch.tensor([2], dtype=i32),
        prefix_lens_cpu=[128], extend_lens_cpu=[2], lane_locs=lanes[None],
        lane_lens=torch.tensor([3], dtype=i32), lane_lens_cpu=[3], topk=2,
    )  # fmt: skip
    m = attn.build_metadata(batch)
    assert m.lengths.kv_lens == [131, 131] and m.rows == 2
    assert attn.fia_kwargs(m, m.lengths)["actual_seq_lengths"] == [1, 2]  # TND, one query a row
    for lane in range(2):
        seen = [_slot_of_column(m.block_table, lane, c) for c in range(131)]
        assert seen == table[2, :128].tolist() + lanes[lane, :3].tolist()
    with pytest.raises(ValueError, match="page-aligned"):
        attn.build_metadata(
            dataclasses.replace(
                batch, prefix_lens_cpu=[5], prefix_lens=torch.tensor([5], dtype=i32)
            )
        )


def test_npu_metadata_for_extend_uses_cumulative_query_ends():
    from polyspec.backend import ForwardBatch, ForwardMode

    attn = _npu_attention_on_cpu()
    table = torch.zeros(2, 256, dtype=torch.int32)
    table[0, :256] = torch.arange(2 * 128, 4 * 128, dtype=torch.int32)
    table[1, :128] = torch.arange(5 * 128, 6 * 128, dtype=torch.int32)
    batch = ForwardBatch(
        mode=ForwardMode.EXTEND, input_ids=torch.zeros(7, dtype=torch.long),
        positions=torch.zeros(7, dtype=torch.long),
        out_cache_loc=torch.cat([table[0, 125:130], table[1, 0:2]]),
        req_pool_indices=torch.tensor([0, 1], dtype=torch.int32), req_to_token=table,
        prefix_lens=torch.tensor([125, 0], dtype=torch.int32),
        extend_lens=torch.tensor([5, 2], dtype=torch.int32),
        prefix_lens_cpu=[125, 0], extend_lens_cpu=[5, 2],
    )  # fmt: skip
    m = attn.build_metadata(batch)
    kwargs = attn.fia_kwargs(m, m.lengths)
    assert kwargs["input_layout"] == "TND" and kwargs["sparse_mode"] == 3
    assert kwargs["actual_seq_lengths"] == [5, 7] and kwargs["actual_seq_lengths_kv"] == [130, 2]
    assert m.block_table.tolist() == [[2, 3], [5, 0]]
    assert tuple(m.atten_mask.shape) == (2048, 2048) and bool(m.atten_mask[0, 1])
    assert not bool(m.atten_mask[1, 0])
    with pytest.raises(ValueError, match="extend_lens_cpu is missing"):
        attn.build_metadata(dataclasses.replace(batch, extend_lens_cpu=None))


def test_npu_captured_metadata_takes_its_lengths_from_host_lengths():
    """A captured forward: TND / sparse_mode=3 for a chain and BSND / sparse_mode=0 only for a
    tree (ForwardBatch.topk > 1); Q queries a row and prefix + Q keys, from ``host_lengths``
    of the capture ({}) and of the parameters a prepare hands over; none without it."""
    from polyspec.backend import ForwardBatch, ForwardMode, HostLengths

    attn = _npu_attention_on_cpu()
    i32, n = torch.int32, 4
    table = torch.zeros(3, 512, dtype=i32)
    table[2, :256] = torch.arange(3 * 128, 5 * 128, dtype=i32)

    def host_lengths(params):  # one live request of committed length seq_lens[0], one padding
        seq = list(params.get("seq_lens", [130])) + [0]
        return HostLengths(seq, [n, 0])

    chain = torch.ones(n, n, dtype=torch.bool).tril()
    batch = ForwardBatch(
        mode=ForwardMode.TARGET_VERIFY, input_ids=torch.zeros(2 * n, dtype=torch.long),
        positions=torch.zeros(2 * n, dtype=torch.long),
        out_cache_loc=torch.cat([table[2, 130:134], torch.zeros(n, dtype=i32)]),
        req_pool_indices=torch.tensor([2, 0], dtype=i32), req_to_token=table,
        prefix_lens=torch.tensor([130, 0], dtype=i32), extend_lens=torch.tensor([n, 0], dtype=i32),
        tree_mask=torch.stack([chain, chain]), topk=1, host_lengths=host_lengths,
    )  # fmt: skip
    m = attn.build_static_metadata(batch, 256)
    kw = attn.fia_kwargs(m, m.lengths)
    assert (
        kw["input_layout"] == "TND" and kw["sparse_mode"] == 3 and kw["atten_mask"].shape[0] == 2048
    )
    assert kw["actual_seq_lengths"] == [n, 2 * n] and kw["actual_seq_lengths_kv"] == [134, n]
    assert m.block_table.shape == (2, 3)  # ceil((256 + 4) / 128): the bucket plus headroom
    later = attn.fia_kwargs(m, m.replay_lengths({"batch_size": 1, "seq_lens": [131]}))
    assert later["actual_seq_lengths_kv"] == [135, n]  # what prepare re-issues
    tree = dataclasses.replace(batch, topk=2)
    mt = attn.build_static_metadata(tree, 256)
    kwt = attn.fia_kwargs(mt, mt.lengths)
    assert kwt["input_layout"] == "BSND" and kwt["sparse_mode"] == 0
    assert kwt["actual_seq_lengths"] == [n, n] and kwt["actual_seq_lengths_kv"] == [134, n]
    assert tuple(mt.atten_mask.shape) == (2, 1, n, 384)
    with pytest.raises(ValueError, match="host_lengths"):
        attn.build_static_metadata(dataclasses.replace(batch, host_lengths=None), 256)
