"""Time of SmolLM2-135M's linear layers on this CPU by input rows (docs/benchmarks.md).

    python ci/bench_cpu_linear.py [--threads 2]

For each weight shape of a decoder layer (stacked 30 times, so the weights stream from
memory as in a real forward) and the tied lm_head: ``F.linear`` in bf16, ``F.linear`` in fp32,
the oneDNN-packed fp32 kernel, and what ``CPUBackend.linear_fn`` picks, at 1, 2, 3, 6 and 16
input rows (decode, draft, verify widths). Prints a markdown table of milliseconds.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    backend = CPUBackend()
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
