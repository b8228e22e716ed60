"""ci/npu_sim_bench.py's own options (the bench itself runs in ci/device_npu.sh's compare)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
import torch.nn.functional as F

SCRIPT = Path(__file__).resolve().parents[2] / "ci" / "npu_sim_bench.py"


def _script():
    spec = importlib.util.spec_from_file_location("npu_sim_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rowwise_linear_computes_each_row_alone(monkeypatch):
    monkeypatch.setattr(F, "linear", F.linear)  # restored after the test
    batched = F.linear
    _script().rowwise_linear()
    assert F.linear is not batched
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(48, 64, generator=g).to(torch.bfloat16)
    b = torch.randn(48, generator=g).to(torch.bfloat16)
    got = F.linear(x, w, b)
    want = torch.stack([torch.cat([batched(r[None], w, b) for r in rows]) for rows in x])
    assert got.shape == (2, 3, 48) and torch.equal(got, want)


def test_unknown_options_before_the_separator_are_refused():
    assert _script().main(["--rowwise", "--", "--num-prompts", "1"]) == 2
