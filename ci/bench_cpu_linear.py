"""Time of SmolLM2-135M's linear layers on this CPU by input rows (docs/benchmarks.md).

    python ci/bench_cpu_linear.py [--threads 2] [--linear-fn-only | --in-cache]

For each weight shape of a decoder layer (stacked 30 times, so the weights stream from
memory as in a real forward) and the tied lm_head: ``F.linear`` in bf16, ``F.linear`` in fp32,
the oneDNN-packed fp32 kernel, and what ``CPUBackend.linear_fn`` picks, at 1, 2, 3, 6 and 16
input rows (decode, draft, verify widths). Prints a markdown table of milliseconds.

``--linear-fn-only``: only ``linear_fn``, and per row count the sum over all shapes (one
forward's linears). ``--in-cache``: ``linear_fn`` on one [2048, 576] weight (2.4 MB, in the
last-level cache) called over and over, by rows: GFLOP/s, the kernel's arithmetic rate
without DRAM in the way (compare with ``torch.mm``'s fp32 rate on the same thread count,
printed first).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from polyspec.backends.cpu.backend import CPUBackend, _onednn_bf16

SHAPES = [  # (out, in, copies): SmolLM2-135M
    (960, 576, 30),  # qkv_proj
    (576, 576, 30),  # o_proj
    (3072, 576, 30),  # gate_up_proj
    (576, 1536, 30),  # down_proj
    (49152, 576, 1),  # lm_head (tied)
]
ROWS = (1, 2, 3, 6, 16)


def ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e3


def time_rows(xb, wb, wf, packed, fns) -> tuple[float, float, float, float]:  # xb [rows, in]
    """Milliseconds for one pass over all copies: bf16, fp32, packed fp32, linear_fn."""
    xf = xb.float()
    return (
        ms(lambda: [F.linear(xb, w) for w in wb]),
        ms(lambda: [F.linear(xf, w) for w in wf]),
        ms(
            lambda: [
                torch.ops.mkldnn._linear_pointwise(xf, p, None, "none", [], "") for p in packed
            ]
        ),
        ms(lambda: [f(xb, None) for f in fns]),
    )


def in_cache(backend: CPUBackend) -> None:
    """GFLOP/s of linear_fn with its weight in cache, by rows; torch.mm fp32 as the yardstick."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(1024, 1024, generator=g), torch.randn(1024, 1024, generator=g)
    print(f"torch.mm fp32 1024^3: {2 * 1024**3 / ms(lambda: torch.mm(a, b)) / 1e6:.1f} GFLOP/s")
    w = torch.randn(2048, 576, generator=g).bfloat16()
    fn = backend.linear_fn(w)
    print("| rows | us per call | GFLOP/s |\n|---|---|---|")
    for rows in (1, 2, 3, 4, 6, 8):
        x = torch.randn(rows, 576, generator=g).bfloat16()
        t = min(ms(lambda x=x: fn(x, None), reps=300) for _ in range(5))
        print(f"| {rows} | {t * 1e3:.1f} | {2 * rows * w.numel() / t / 1e6:.1f} |")


def linear_fn_only(backend: CPUBackend) -> None:
    """Milliseconds of one forward's linears (every shape, all copies) by rows."""
    g = torch.Generator().manual_seed(0)
    fns = [
        (in_f, backend.linear_fn(torch.randn(out_f, in_f, generator=g).bfloat16()))
        for out_f, in_f, copies in SHAPES
        for _ in range(copies)
    ]
    print("| rows | all linears of a forward, ms |\n|---|---|")
    for rows in (1, 2, 3, 4, 6, 8):
        xs = {k: torch.randn(rows, k, generator=g).bfloat16() for k in {k for k, _ in fns}}
        t = min(ms(lambda xs=xs: [f(xs[k], None) for k, f in fns], reps=10) for _ in range(3))
        print(f"| {rows} | {t:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--linear-fn-only", action="store_true")
    mode.add_argument("--in-cache", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    backend = CPUBackend()
    if args.in_cache or args.linear_fn_only:
        print(f"torch {torch.__version__}, {args.threads} threads")
        (in_cache if args.in_cache else linear_fn_only)(backend)
        return
    print(
        f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"oneDNN native bf16: {_onednn_bf16()}, {args.threads} threads"
    )
    print("| weight [out, in] x copies | rows | bf16 F.linear | fp32 F.linear | fp32 packed | "
          "linear_fn (bf16) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for out_f, in_f, copies in SHAPES:
        wb = [torch.randn(out_f, in_f, generator=g).bfloat16() for _ in range(copies)]
        wf = [w.float() for w in wb]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in wf]
        fns = [backend.linear_fn(w) for w in wb]
        for rows in ROWS:
            xb = torch.randn(rows, in_f, generator=g).bfloat16()
            t_bf16, t_fp32, t_pack, t_fn = time_rows(xb, wb, wf, packed, fns)
            print(
                f"| [{out_f}, {in_f}] x {copies} | {rows} | {t_bf16:.2f} | {t_fp32:.2f} | "
                f"{t_pack:.2f} | {t_fn:.2f} |"
            )


if __name__ == "__main__":
    main()
