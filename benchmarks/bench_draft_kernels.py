"""The cpu backend's draft-side kernels and its attention, timed alone (docs/benchmarks.md,
"Draft weights, int8 or bf16").

    python benchmarks/bench_draft_kernels.py [--threads 2]

- the draft lm_head (16384 x 576) as bf16 (``rowinv.linear``) and int8 (``rowinv.linear_w8``),
  streamed from memory: 64 copies of the weight (~0.6-1.2 GB) read in turn, so no call finds
  its weight in the caches, as in a decode round, where the target's forward evicts the head;
- ``softmax_topk`` and ``select_top_k`` (a draft step of S=3 K=3) against the reference;
- ``fused_add_rms_norm`` at 1, 8 and 16 rows of 576;
- ``linear`` (bf16, this CPU's path) of SmolLM2's down projection, 576 x 1536, at 1, 8 and 16
  rows, its weight in the caches (what x's packing for the tiles costs shows here);
- ``attention`` (SmolLM2's 9 query and 3 kv heads of 64) at 1, 8 and 16 query rows over 250
  keys each, on the avx2 path and on this CPU's best path (avx512 or amx: the AVX-512 kernel,
  bit-identical to the avx2 one).
Medians of repeated calls, microseconds (the lm_head in milliseconds).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from polyspec.backends.cpu import rowinv
from polyspec.kernels import reference
from polyspec.kernels.quant import quantize_int8


def median_us(fn: Callable[[], object], reps: int = 2000) -> float:
    for _ in range(50):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times)


def lm_head_ms(rows: int, copies: int = 64) -> tuple[float, float]:
    """(bf16, int8) milliseconds per call, each call on a weight copy not read since 63 calls."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 576, generator=g).bfloat16()
    bf16 = [torch.randn(16384, 576, generator=g).bfloat16() for _ in range(copies)]
    int8 = [quantize_int8(w) for w in bf16]
    out = []
    for calls in ([lambda w=w: rowinv.linear(x, w) for w in bf16],
                  [lambda q=q, s=s: rowinv.linear_w8(x, q, s) for q, s in int8]):  # fmt: skip
        for f in calls:
            f()
        passes = []
        for _ in range(5):
            t = time.perf_counter()
            for f in calls:
                f()
            passes.append((time.perf_counter() - t) / copies)
        out.append(1e3 * statistics.median(passes))
    return out[0], out[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    torch.set_num_threads(ap.parse_args().threads)
    if rowinv.load() is None:
        raise SystemExit(f"rowinv unavailable: {rowinv.unavailable_reason()}")
    print("| kernel | shape | reference / bf16 | cpu backend |\n|---|---|---|---|")
    for rows in (1, 3):
        b, q = lm_head_ms(rows)
        print(
            f"| draft lm_head, from memory | {rows} x 16384 x 576 | {b:.2f} ms | {q:.2f} ms int8 |"
        )
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 16384, generator=g).bfloat16()
    print(f"| softmax_topk | 3 x 16384, k 3 | {median_us(lambda: reference.softmax_topk(logits, 3)):.1f} "
          f"| {median_us(lambda: rowinv.softmax_topk(logits, 3)):.1f} |")  # fmt: skip
    p, scores = torch.rand(3, 3, generator=g), torch.rand(1, 3, generator=g)
    idx, hidden = torch.randint(0, 49152, (3, 3), generator=g), torch.randn(3, 576).bfloat16()
    args = (1, p, idx, hidden, scores, 3)
    print(f"| select_top_k, step 1 | bs 1, K 3 | {median_us(lambda: reference.select_top_k(*args)):.1f} "
          f"| {median_us(lambda: rowinv.select_top_k(*args)):.1f} |")  # fmt: skip
    w = torch.randn(576, generator=g).bfloat16()
    for rows in (1, 8, 16):
        x, r = torch.randn(rows, 576).bfloat16(), torch.randn(rows, 576).bfloat16()
        us = median_us(lambda x=x, r=r: rowinv.fused_add_rms_norm(x, r, w, 1e-5))
        print(f"| fused_add_rms_norm | {rows} x 576 | | {us:.1f} |")
    down = torch.randn(576, 1536, generator=g).bfloat16()
    for rows in (1, 8, 16):
        x = torch.randn(rows, 1536, generator=g).bfloat16()
        us = median_us(lambda x=x: rowinv.linear(x, down))
        print(f"| linear, cached weight | {rows} x 576 x 1536 | | {us:.1f} ({rowinv.isa()}) |")
    k_cache, v_cache = (torch.randn(2048, 3, 64, generator=g).bfloat16() for _ in range(2))
    best = rowinv.isa()
    for rows in (1, 8, 16):
        q = torch.randn(rows, 9, 64, generator=g).bfloat16()
        # a verify's rows: 250 prefix keys, then each row's own tree ancestors (here: a chain)
        lens = [250 + i for i in range(rows)]
        indptr = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64)
        indices = torch.cat([torch.arange(n) for n in lens])
        times = {}
        for name in ("avx2", best):
            rowinv.set_isa(name)
            times[name] = median_us(
                lambda q=q, p=indptr, i=indices: rowinv.attention(q, k_cache, v_cache, p, i, 0.125)
            )
        rowinv.set_isa(best)
        print(f"| attention | {rows} x 9 heads x ~250 keys | {times['avx2']:.1f} (avx2) "
              f"| {times[best]:.1f} ({best}) |")  # fmt: skip


if __name__ == "__main__":
    main()
