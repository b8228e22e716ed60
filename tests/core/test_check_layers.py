"""ci/check_layers.py: the repository keeps the layers, and each kind of up-import is caught."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECKER = REPO / "ci" / "check_layers.py"


def _checker():
    spec = importlib.util.spec_from_file_location("check_layers", CHECKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_repository_keeps_its_layers():
    proc = subprocess.run(
        [sys.executable, str(CHECKER)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "check_layers: ok" in proc.stdout


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for folder in ("core", "backends", "kernels"):
        (tmp_path / folder).mkdir(exist_ok=True)
    for rel, body in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(body))
    return tmp_path


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"core/backend.py": "def f():\n    from polyspec.kernels import reference\n"},
         "core/backend.py:2: contract (rank 1) imports kernels (rank 2), above it"),
        ({"core/config.py": "from polyspec.engine.defaults import x\n"},
         "core/config.py:1: config (rank 5) imports engine (rank 11), above it"),
        ({"kernels/triton/attention.py": "from polyspec.backends.cpu.attention import A\n"},
         "kernels/triton/attention.py:1: kernels (rank 2) imports backends (rank 4), above it"),
        ({"backends/cuda/backend.py": "from polyspec.backends.cpu.allocator import A\n"},
         "polyspec.backends.cuda imports another backend, polyspec.backends.cpu"),
        ({"core/spec/worker.py": "from polyspec.kernels.reference import draft_lane_width\n"},
         "spec (core stack) imports kernels (vendor stack)"),
        ({"backends/npu/backend.py": "from ..cpu import graph\n"},
         "polyspec.backends.npu imports another backend, polyspec.backends.cpu"),
        ({"backends/common/pool.py": "import importlib\nimportlib.import_module('polyspec.model')\n"},
         "backends.common (rank 3) imports model (rank 8), above it"),
        ({"core/model/llama.py": "from polyspec.kernels.reference import reference_kernels\n"},
         "model (core stack) imports kernels (vendor stack)"),
        ({"core/newthing/x.py": "import torch\n"}, "polyspec.newthing.x is in no layer"),
    ],
)  # fmt: skip
def test_each_kind_of_violation_is_reported(tmp_path, files, expected):
    found = _checker().scan(_tree(tmp_path, files))
    assert any(expected in line for line in found), found


def test_allowed_imports_pass(tmp_path):
    files = {
        "core/spec/worker.py": "from polyspec.backend import draft_lane_width\nfrom . import base\n",
        "core/spec/base.py": "from polyspec.runtime.graphs import G\nfrom polyspec.config import C\n",
        "backends/cpu/backend.py": "from polyspec.backends.common import P\nfrom . import rowinv\n",
        "kernels/reference.py": "from polyspec.backend import KernelSet\n",
        "core/testing/ascend_like.py": "from polyspec.backends.cpu.backend import CPUBackend\n",
    }
    assert _checker().scan(_tree(tmp_path, files)) == []
