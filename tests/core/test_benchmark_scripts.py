"""``benchmarks/tree_acceptance.py`` and ``benchmarks/unmasked_agreement.py`` on the default
model, one short MT-bench turn each: they run, print what their docstrings say, and check what
they claim to check."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tree_acceptance_prints_one_row_per_tree_with_equal_texts(capsys):
    script = _script("tree_acceptance")
    args = ["--trees", "3-2-4,2-1-3", "--num-prompts", "1", "--max-new-tokens", "6"]
    assert script.main([*args, "--batch-size", "1", "--dtype", "float32"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["tree"] for r in rows] == ["3-2-4", "2-1-3"]
    for r in rows:
        assert r["texts_equal_first"] and r["prompts"] == 1 and r["rounds"] >= 1
        assert 1.0 <= r["acceptance"] <= 4.0  # at most S + 1 tokens a round
    with pytest.raises(SystemExit):
        script.main(["--trees", "3-2"])


def test_unmasked_agreement_counts_runs_between_misses(capsys):
    pytest.importorskip("llguidance")
    script = _script("unmasked_agreement")
    assert script.runs_between_misses([True, True, False, True, False, False]) == [2, 1, 0, 0]
    assert script.runs_between_misses([True, True]) == [2]
    schema = Path(__file__).resolve().parents[2] / "benchmarks" / "schemas" / "record.json"
    args = ["--json-schema", str(schema), "--num-prompts", "1", "--max-new-tokens", "8"]
    assert script.main(args) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    agreed, total = (int(x) for x in last.split()[1].split("/"))
    assert 0 <= agreed <= total and total >= 1
    assert "mean run between disagreements" in last
