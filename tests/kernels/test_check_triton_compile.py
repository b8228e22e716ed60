"""``ci/check_triton_compile.py``: recorded Triton launches compiled for a GPU without one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install 'polyspec[cuda]')")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "ci" / "check_triton_compile.py"
SILU = {
    "module": "polyspec.kernels.triton.activation",
    "kernel": "_silu_and_mul_kernel",
    "signature": {
        "x_ptr": "*bf16", "out_ptr": "*bf16", "inter": "i32", "stride_x": "i32",
        "BLOCK": "constexpr", "PDL": "constexpr",
    },
    "constexprs": {"BLOCK": 64, "PDL": False},
    "options": {"num_warps": 2},
}  # fmt: skip


def _check(tmp_path: Path, specs: list[dict]) -> subprocess.CompletedProcess:
    record = tmp_path / "launches.json"
    record.write_text(json.dumps(specs))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(record), "--jobs", "1"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip


def test_a_launch_the_gpu_compiler_rejects_fails_the_check(tmp_path):
    """A block of 48 (tl.arange needs a power of two) does not lower; 64 does (each also
    compiled with programmatic dependent launch)."""
    bad = json.loads(json.dumps(SILU))
    bad["constexprs"]["BLOCK"] = 48
    run = _check(tmp_path, [SILU, bad])
    assert run.returncode == 1, run.stdout + run.stderr
    assert "4 launches of 1 kernels compiled for cuda sm_90" in run.stdout
    assert "2 failed" in run.stdout
    assert "FAILED polyspec.kernels.triton.activation._silu_and_mul_kernel" in run.stdout
    assert "'BLOCK': 48" in run.stdout

    ok = _check(tmp_path, [SILU])
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "0 failed" in ok.stdout


def test_no_record_is_a_clear_error(tmp_path):
    run = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "none.json")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2
    assert "no such record file" in run.stderr and "POLYSPEC_TRITON_RECORD" in run.stderr


def test_interpreter_upcasts_are_also_compiled_as_the_gpu_runs_them():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from check_triton_compile import device_variants
    finally:
        sys.path.remove(str(SCRIPT.parent))
    spec = {
        "module": "m", "kernel": "k", "signature": {"x_ptr": "*bf16", "UPCAST": "constexpr"},
        "constexprs": {"UPCAST": True, "IEEE": True}, "options": {},
    }  # fmt: skip
    interp, gpu = device_variants(spec)
    assert interp == spec
    assert gpu["constexprs"] == {"UPCAST": False, "IEEE": False}
    spec["signature"]["x_ptr"] = "*fp32"
    assert device_variants(spec)[1]["constexprs"] == {"UPCAST": False, "IEEE": True}
    spec["constexprs"]["UPCAST"] = False
    assert device_variants(spec) == [spec]


def test_kernels_with_a_pdl_switch_are_also_compiled_with_it_on():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from check_triton_compile import device_variants
    finally:
        sys.path.remove(str(SCRIPT.parent))
    off, on = device_variants(SILU)
    assert off == SILU
    assert on["constexprs"] == {"BLOCK": 64, "PDL": True}
    assert on["options"] == {"num_warps": 2, "launch_pdl": True}
    upcast = json.loads(json.dumps(SILU))
    upcast["constexprs"]["UPCAST"] = True
    variants = device_variants(upcast)  # the interpreter's, the GPU's, the GPU's with PDL
    pairs = [(v["constexprs"]["UPCAST"], v["constexprs"]["PDL"]) for v in variants]
    assert pairs == [(True, False), (False, False), (False, True)]
