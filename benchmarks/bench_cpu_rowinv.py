"""Benchmarks for rowinv.linear / rowinv.attention against stock PyTorch CPU paths.

Usage: python benchmarks/bench_cpu_rowinv.py [--quick] [--skip-shapes] [--skip-model] [--skip-attn] [--skip-large]
Prints markdown tables (times are medians, microseconds unless noted). The model and per-shape
tables time every rowinv.linear path the CPU has (avx2, avx512); the other tables, the default
one (POLYSPEC_ROWINV_ISA picks another).
"""

# ruff: noqa: B023  (every lambda here is timed at once, inside its loop iteration)
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from polyspec.backends.cpu import rowinv

HIDDEN, INTER, VOCAB, LAYERS = 576, 1536, 49152, 30
# (name, N, K): the seven linears of one SmolLM2-135M layer, then the lm_head.
LAYER_SHAPES = [
    ("q", 576, 576),
    ("k", 192, 576),
    ("v", 192, 576),
    ("o", 576, 576),
    ("gate", INTER, HIDDEN),
    ("up", INTER, HIDDEN),
    ("down", HIDDEN, INTER),
]
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]


def median_time(
    fn: Callable[[], object], budget_s: float = 0.4, min_reps: int = 3, max_reps: int = 300
) -> float:
    """Median seconds per call; repetitions sized to a time budget so slow baselines stay cheap."""
    fn()
    t = time.perf_counter()
    fn()
    once = time.perf_counter() - t
    reps = max(min_reps, min(max_reps, int(budget_s / max(once, 1e-7))))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def packed(w_f32: torch.Tensor, m: int) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w_f32, m)


def mkldnn_linear(x_f32: torch.Tensor, w_packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x_f32, w_packed, None, "none", [], "")


def machine() -> str:
    name = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (
        f"{name}, {os.cpu_count()} logical CPUs, torch {torch.__version__}, "
        f"capability {torch.backends.cpu.get_cpu_capability()}, threads {torch.get_num_threads()}"
    )


def on_path(mod, isa: str, fn: Callable[..., object]) -> Callable[..., object]:
    """fn, run on rowinv path `isa` (switched per call: the switch costs nanoseconds)."""

    def run(*args):
        mod.set_isa(isa)
        return fn(*args)

    return run


def bench_shapes(ms: list[int], mod) -> None:
    isas, default = mod.available_isas(), mod.isa()
    print(
        "\n### Per-shape linear, weights warm in cache (us; ratio = F.linear bf16 / rowinv "
        f"{default}; rowinv fp32-x on {default})\n"
    )
    ri_cols = " | ".join(f"rowinv {isa} bf16" for isa in isas)
    print(
        f"| N x K | M | {ri_cols} | F.linear bf16 | F.linear fp32 | mkldnn packed fp32 | rowinv fp32-x "
        "| bf16/rowinv |"
    )
    print("|---|---|" + "---|" * (len(isas) + 5))
    for n, k in SHAPES:
        w = torch.randn(n, k).bfloat16()
        wf = w.float()
        for m in ms:
            x = torch.randn(m, k).bfloat16()
            xf = x.float()
            wp = packed(wf, m)
            t_ri = {
                isa: median_time(on_path(mod, isa, lambda: mod.linear(x, w, None))) for isa in isas
            }
            mod.set_isa(default)
            t_bf = median_time(lambda: F.linear(x, w))
            t_f32 = median_time(lambda: F.linear(xf, wf))
            t_pk = median_time(lambda: mkldnn_linear(xf, wp))
            t_rif = median_time(lambda: mod.linear(xf, w, None))
            ri = " | ".join(f"{t * 1e6:.1f}" for t in t_ri.values())
            print(
                f"| {n}x{k} | {m} | {ri} | {t_bf * 1e6:.1f} | {t_f32 * 1e6:.1f} | {t_pk * 1e6:.1f} "
                f"| {t_rif * 1e6:.1f} | {t_bf / t_ri[default]:.2f} |",
                flush=True,
            )


def bench_threads(mod) -> None:
    print("\n### rowinv.linear, 1 vs 2 threads (us)\n")
    print("| N x K | M | 1 thread | 2 threads |")
    print("|---|---|---|---|")
    saved = torch.get_num_threads()
    for n, k in [(576, 576), (1536, 576), (49152, 576)]:
        w = torch.randn(n, k).bfloat16()
        for m in (1, 6, 128):
            x = torch.randn(m, k).bfloat16()
            res = []
            for th in (1, 2):
                torch.set_num_threads(th)
                res.append(median_time(lambda: mod.linear(x, w, None)))
            print(f"| {n}x{k} | {m} | {res[0] * 1e6:.1f} | {res[1] * 1e6:.1f} |", flush=True)
    torch.set_num_threads(saved)


def bench_model(ms: list[int], mod, reps: int) -> None:
    """One decode/verify step's worth of linears with distinct weights per layer (~270 MB of bf16),
    so the weights stream from DRAM as they do in the real model (the per-shape table does not).
    The methods are interleaved rep by rep, so a slow phase of the (shared, noisy) VM hits all."""
    print(
        f"\n### Full model step: {LAYERS} layers x 7 linears + lm_head, distinct weights "
        f"(ms, median of {reps} interleaved reps; [min])\n"
    )
    torch.manual_seed(0)
    layers = [
        [torch.randn(n, k).bfloat16() * 0.02 for _, n, k in LAYER_SHAPES] for _ in range(LAYERS)
    ]
    head = torch.randn(VOCAB, HIDDEN).bfloat16() * 0.02
    all_w = [w for layer in layers for w in layer] + [head]
    ks = [k for _, _, k in LAYER_SHAPES] * LAYERS + [HIDDEN]
    w_f32 = [w.float() for w in all_w]
    isas, default = mod.available_isas(), mod.isa()
    ri_cols = " | ".join(f"rowinv {isa} bf16" for isa in isas)
    ratio_cols = " | ".join(f"{isa} M / {isa} M=1" for isa in isas)
    print(f"| M | {ri_cols} | F.linear bf16 | F.linear fp32 | mkldnn packed fp32 | {ratio_cols} |")
    print("|---|" + "---|" * (2 * len(isas) + 3))
    base = None
    for m in ms:
        xs = {k: torch.randn(m, k).bfloat16() for k in (HIDDEN, INTER)}
        xfs = {k: v.float() for k, v in xs.items()}
        w_pk = [packed(w, m) for w in w_f32]
        methods = [(lambda x, w, isa=isa: mod.linear(x, w, None), xs, all_w, isa) for isa in isas]
        methods += [
            (F.linear, xs, all_w, None),
            (F.linear, xfs, w_f32, None),
            (mkldnn_linear, xfs, w_pk, None),
        ]
        times: list[list[float]] = [[] for _ in methods]
        for rep in range(reps + 1):  # rep 0 warms up
            for i, (fn, xd, ws, isa) in enumerate(methods):
                if isa:
                    mod.set_isa(isa)
                t = time.perf_counter()
                for w, k in zip(ws, ks):
                    fn(xd[k], w)
                if rep:
                    times[i].append(time.perf_counter() - t)
        mod.set_isa(default)
        med = [statistics.median(t) for t in times]
        mins = [min(t) for t in times]
        base = base or med[: len(isas)]
        cells = " | ".join(f"{a * 1e3:.2f} [{b * 1e3:.2f}]" for a, b in zip(med, mins))
        ratios = " | ".join(f"{a / b:.2f}" for a, b in zip(med, base))
        print(f"| {m} | {cells} | {ratios} |", flush=True)
        del w_pk


def bench_large(mod) -> None:
    print("\n### Large M (prefill), ms\n")
    print("| N x K | M | rowinv bf16 | F.linear fp32 | mkldnn packed fp32 | rowinv / fp32 |")
    print("|---|---|---|---|---|---|")
    for n, k in [(576, 576), (1536, 576), (576, 1536)]:
        w = torch.randn(n, k).bfloat16()
        wf = w.float()
        for m in (128, 512, 2048):
            x = torch.randn(m, k).bfloat16()
            xf = x.float()
            wp = packed(wf, m)
            t_ri = median_time(lambda: mod.linear(x, w, None), budget_s=0.5)
            t_f32 = median_time(lambda: F.linear(xf, wf), budget_s=0.5)
            t_pk = median_time(lambda: mkldnn_linear(xf, wp), budget_s=0.5)
            print(
                f"| {n}x{k} | {m} | {t_ri * 1e3:.2f} | {t_f32 * 1e3:.2f} | {t_pk * 1e3:.2f} | {t_ri / t_f32:.2f} |",
                flush=True,
            )


def sdpa_reference(q, k_cache, v_cache, lens):
    """Stock path for comparison: gather each row's keys, SDPA in fp32 per row."""
    outs = []
    start = 0
    for t, n in enumerate(lens):
        kk = k_cache[start : start + n].float().transpose(0, 1)  # [Hkv, n, D]
        vv = v_cache[start : start + n].float().transpose(0, 1)
        qq = q[t].float().unsqueeze(1)  # [Hq, 1, D]
        outs.append(F.scaled_dot_product_attention(qq, kk, vv, enable_gqa=True).squeeze(1))
        start += n
    return torch.stack(outs).bfloat16()


def bench_attention(mod) -> None:
    """Two slot layouts: "seq" = T verify rows of one sequence (row t sees the first L+t tokens),
    tokens in 16-slot pages scattered over a pool, as a paged KV cache would hold them;
    "rand" = every row has its own keys at random slots (worst case for the gather)."""
    print("\n### Attention (Hq=9, Hkv=3), us\n")
    print(
        "| layout | T | keys per row | D | rowinv 2 threads | rowinv 1 thread | rowinv 2 threads, cold cache "
        "| per-row fp32 SDPA (stock, for scale) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    flush = torch.zeros(
        64 * 1024 * 1024 // 4
    )  # 64 MB > L3: in the model, weights evict the KV cache

    def cold_time(fn, reps=40):
        times = []
        for _ in range(reps):
            flush.add_(1.0)
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    hq, hkv = 9, 3
    gen = torch.Generator().manual_seed(0)
    cases = [
        ("seq", 1, 400, 64),
        ("seq", 6, 400, 64),
        ("seq", 16, 400, 64),
        ("seq", 1, 2048, 64),
        ("seq", 6, 2048, 64),
        ("seq", 1, 400, 128),
        ("rand", 1, 400, 64),
        ("rand", 6, 400, 64),
        ("rand", 6, 2048, 64),
    ]
    for layout, t_rows, n_keys, d in cases:
        lens = [n_keys + i for i in range(t_rows)]
        pool = 8192 + sum(lens)
        if layout == "seq":
            pages = torch.randperm(pool // 16, generator=gen)[: (lens[-1] + 15) // 16]
            seq_slots = (pages[:, None] * 16 + torch.arange(16)).reshape(-1)[: lens[-1]]
            indices = torch.cat([seq_slots[:n] for n in lens])
        else:
            indices = torch.randperm(pool, generator=gen)[: sum(lens)]
        indices = indices.to(torch.int64)
        k_cache = torch.randn(pool, hkv, d, generator=gen).bfloat16()
        v_cache = torch.randn(pool, hkv, d, generator=gen).bfloat16()
        q = torch.randn(t_rows, hq, d, generator=gen).bfloat16()
        indptr = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64)
        scale = d**-0.5
        t2 = median_time(lambda: mod.attention(q, k_cache, v_cache, indptr, indices, scale))
        torch.set_num_threads(1)
        t1 = median_time(lambda: mod.attention(q, k_cache, v_cache, indptr, indices, scale))
        torch.set_num_threads(2)
        tc = cold_time(lambda: mod.attention(q, k_cache, v_cache, indptr, indices, scale))
        kc, vc = k_cache[indices], v_cache[indices]
        tr = median_time(lambda: sdpa_reference(q, kc, vc, lens))
        print(
            f"| {layout} | {t_rows} | {n_keys}..{lens[-1]} | {d} | {t2 * 1e6:.1f} | {t1 * 1e6:.1f} | {tc * 1e6:.1f} "
            f"| {tr * 1e6:.1f} |",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer M values and repetitions")
    ap.add_argument("--skip-shapes", action="store_true")
    ap.add_argument("--skip-model", action="store_true")
    ap.add_argument("--skip-attn", action="store_true")
    ap.add_argument("--skip-large", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    mod = rowinv.load()
    if mod is None:
        sys.exit(f"rowinv unavailable: {rowinv.unavailable_reason()}")
    print(f"Machine: {machine()}")
    print(f"rowinv.linear paths: {', '.join(mod.available_isas())}; default {mod.isa()}")
    print(f"Load average at start (other processes skew CPU timings): {os.getloadavg()}")
    ms = [1, 6] if args.quick else [1, 2, 4, 6, 8, 16, 128]
    if not args.skip_model:
        bench_model(
            [1, 6] if args.quick else [1, 2, 4, 6, 8, 16], mod, reps=5 if args.quick else 11
        )
    if not args.skip_shapes:
        bench_shapes(ms, mod)
        bench_threads(mod)
    if not args.skip_large:
        bench_large(mod)
    if not args.skip_attn:
        bench_attention(mod)
    print(f"\nLoad average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
