"""Importing polyspec and listing backends load no vendor runtime; ci/check_vendor_imports.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHECKER = REPO / "ci" / "check_vendor_imports.py"

ACTIONS = (
    "import polyspec",
    "import polyspec.plugins, polyspec.config, polyspec.cli",
    "from polyspec.plugins import discover; discover()",
    "from polyspec.cli import main; assert main(['backends']) == 0",
    "from polyspec.cli import main; assert main(['backends', '--json']) == 0",
    "from polyspec.plugins import create_backend; create_backend('cpu')",
)

INSPECT = """
import sys
VENDOR = ("torch_npu", "triton", "flashinfer", "sgl_kernel")
def inspect(after):
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in VENDOR)
    assert not loaded, f"after {after!r}: vendor modules loaded: {loaded}"
    torch = sys.modules.get("torch")
    if torch is not None:
        assert not torch.cuda.is_initialized(), f"after {after!r}: CUDA was initialised"
"""


def test_no_vendor_runtime_is_loaded():
    # one interpreter, checked after each step: each step only adds to sys.modules
    steps = [INSPECT] + [f"{a}\ninspect({a!r})" for a in ACTIONS] + ["print('clean')"]
    proc = subprocess.run(
        [sys.executable, "-c", "\n".join(steps)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("clean")


def test_checker_passes_on_core():
    proc = subprocess.run(
        [sys.executable, str(CHECKER)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_checker_lists_every_violation_with_file_and_line(tmp_path):
    bad = tmp_path / "core" / "bad.py"
    bad.parent.mkdir()
    bad.write_text(
        textwrap.dedent(
            """\
            import os
            import triton.language as tl
            from torch_npu.contrib import x
            import torch as t
            from torch import cuda
            import importlib
            importlib.import_module("sgl_kernel")
            def f():
                return t.cuda.is_available() or t.npu
            # torch.cuda in a comment is fine
            s = "torch.cuda in a string is fine"
            import flashinfer
            """
        )
    )
    (tmp_path / "core" / "good.py").write_text("import torch\nx = torch.zeros(1)\n")
    proc = subprocess.run(
        [sys.executable, str(CHECKER), str(tmp_path / "core")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    lines = [line.strip() for line in proc.stdout.splitlines() if "bad.py:" in line]
    found = {(line.split(":")[1], line.split(": ", 1)[1]) for line in lines}
    assert found == {
        ("2", "imports triton"),
        ("3", "imports torch_npu"),
        ("5", "imports torch.cuda"),
        ("7", "imports sgl_kernel dynamically"),
        ("9", "uses torch.cuda"),
        ("9", "uses torch.npu"),
        ("12", "imports flashinfer"),
    }
    assert "good.py" not in proc.stdout
