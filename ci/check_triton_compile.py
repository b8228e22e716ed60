#!/usr/bin/env python3
"""Compile every Triton kernel launch the CPU tests made for a GPU, without a GPU.

    POLYSPEC_TRITON_RECORD=launches.json pytest tests/kernels    # records (tests/kernels/conftest.py)
    python ci/check_triton_compile.py launches.json* [--arch 90] [--jobs 2]

Why: CI runs the Triton kernels in Triton's interpreter, which executes their Python with numpy
and never lowers them, so a kernel that the GPU compiler rejects (a type it cannot lower, a
block too large for shared memory, a construct the interpreter tolerates) passes CI and fails
on the first GPU run, which is rarer and costlier than a CI run. Here each recorded launch (kernel, argument types, constexprs, ``num_warps``) is
compiled ahead of time for ``cuda`` at compute capability ``--arch`` through Triton's own
pipeline, down to a cubin with the ptxas Triton ships. Launches the interpreter made with
``UPCAST`` (16-bit inputs widened for numpy, ``kernels/triton/_util.interpreted``) are also
compiled as the GPU runs them: ``UPCAST`` off, ``IEEE`` on only for fp32 inputs; a kernel with a
``PDL`` switch is compiled with it on as well (the cuda backend's launch on sm_90).

Prints one line per kernel (specializations compiled, seconds) and every failure with its
error; exits 1 if any failed, 2 if there was nothing to compile.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path


def device_variants(spec: dict) -> list[dict]:
    """``spec`` and the launches the GPU makes of it: for an interpreter-only ``UPCAST``
    launch, the same without it; for a kernel with a ``PDL`` switch, the cuda backend's launch
    with programmatic dependent launch (``PDL`` on, ``launch_pdl``)."""
    out = [spec]
    if spec["constexprs"].get("UPCAST"):
        first_pointer = next(t for t in spec["signature"].values() if t.startswith("*"))
        gpu = copy.deepcopy(spec)
        gpu["constexprs"]["UPCAST"] = False
        if "IEEE" in gpu["constexprs"]:
            gpu["constexprs"]["IEEE"] = first_pointer == "*fp32"
        out.append(gpu)
    for variant in list(out):
        if "PDL" in variant["constexprs"] and not variant["constexprs"].get("UPCAST"):
            pdl = copy.deepcopy(variant)
            pdl["constexprs"]["PDL"] = True
            pdl["options"]["launch_pdl"] = True
            out.append(pdl)
    return out


def load_specs(paths: list[str]) -> list[dict]:
    """The distinct launches recorded in ``paths``, with their GPU variants."""
    seen: dict[str, dict] = {}
    for path in paths:
        for spec in json.loads(Path(path).read_text()):
            for variant in device_variants(spec):
                seen.setdefault(json.dumps(variant, sort_keys=True), variant)
    return sorted(seen.values(), key=lambda s: (s["module"], s["kernel"]))


def compile_one(spec: dict, arch: int) -> tuple[str, float, str | None]:
    """Compile one launch for ``cuda`` at ``arch``: (kernel name, seconds, error or None)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    name = f"{spec['module']}.{spec['kernel']}"
    start = time.perf_counter()
    try:
        fn = getattr(importlib.import_module(spec["module"]), spec["kernel"])
        source = ASTSource(fn=fn, signature=spec["signature"], constexprs=spec["constexprs"])
        options = {"num_warps": 4, **spec["options"]}
        kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
        if not kernel.asm.get("cubin"):
            raise RuntimeError("no cubin came out")
        error = None
    except Exception as exc:  # noqa: BLE001 -- every failure is reported, then the exit code says so
        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc) else ''}"
        error += f"\n    constexprs {spec['constexprs']}, options {spec['options']}"
    return name, time.perf_counter() - start, error


def _worker_init() -> None:
    # The interpreter is chosen when @triton.jit runs, at import: this process must compile.
    os.environ.pop("TRITON_INTERPRET", None)
    # FP fusion on, as the device's Triton compiles by default (newer Triton warns while the
    # default is unset, once per process, and means to turn it off).
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records", nargs="+", help="JSON files written by the recording tests")
    ap.add_argument("--arch", type=int, default=90, help="compute capability (90: H100 / H200)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    missing = [p for p in args.records if not Path(p).is_file()]
    if missing:
        print(f"check_triton_compile: no such record file: {', '.join(missing)} (run the "
              "kernel tests with POLYSPEC_TRITON_RECORD=FILE first)", file=sys.stderr)  # fmt: skip
        return 2
    specs = load_specs(args.records)
    if not specs:
        print("check_triton_compile: the records hold no launch", file=sys.stderr)
        return 2
    start = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs, initializer=_worker_init) as pool:
        results = list(pool.map(compile_one, specs, [args.arch] * len(specs)))
    by_kernel: dict[str, list[float]] = defaultdict(list)
    failures = []
    for name, seconds, error in results:
        by_kernel[name].append(seconds)
        if error:
            failures.append(f"{name}: {error}")
    for name, times in sorted(by_kernel.items()):
        print(f"{name:70s} {len(times):3d} specializations {sum(times):6.1f} s")
    print(
        f"{len(specs)} launches of {len(by_kernel)} kernels compiled for cuda sm_{args.arch} in "
        f"{time.perf_counter() - start:.1f} s; {len(failures)} failed"
    )
    for line in failures:
        print("FAILED", line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
