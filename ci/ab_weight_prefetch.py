"""The AVX2 linear's weight prefetch hint, A/B in one process (docs/benchmarks.md).

    python ci/ab_weight_prefetch.py [--hints NTA,T0] [--rounds 4] [--threads 2]

Builds ``backends/cpu/rowinv.cpp`` once per hint (``-DPOLYSPEC_WEIGHT_PREFETCH=_MM_HINT_<H>``,
each under its own module name; a few minutes the first time, cached after), checks that the
builds give the same bits, then times one SmolLM2-135M forward's linears (every layer's
weights, so they stream from memory as in decoding) at 1, 2, 3, 4 and 6 rows, the builds
interleaved, ``--rounds`` times. Prints the median milliseconds per build and row count.
The shipped hint is the first one (NTA).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils import cpp_extension

from polyspec.backends.cpu import rowinv

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
LAYERS, VOCAB, HIDDEN = 30, 49152, 576
ROWS = (1, 2, 3, 4, 6)


def build(hint: str):
    return cpp_extension.load(
        name=f"polyspec_rowinv_prefetch_{hint.lower()}",
        sources=[rowinv._SOURCE],
        extra_cflags=[*rowinv._CFLAGS, f"-DPOLYSPEC_WEIGHT_PREFETCH=_MM_HINT_{hint}"],
        extra_ldflags=rowinv._LDFLAGS,
        verbose=False,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hints", default="NTA,T0", help="comma list of _MM_HINT_ suffixes")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    hints = args.hints.split(",")
    mods = {h: build(h) for h in hints}
    for m in mods.values():
        m.set_isa("avx2")  # the hint is the AVX2 tile's
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g).bfloat16() for _ in range(LAYERS) for n, k in SHAPES]
    weights.append(torch.randn(VOCAB, HIDDEN, generator=g).bfloat16())
    fns = {h: [(w.shape[1], m.BoundLinear(w)) for w in weights] for h, m in mods.items()}
    x = torch.randn(5, HIDDEN, generator=g).bfloat16()
    outs = [mods[h].BoundLinear(weights[-1])(x, None) for h in hints]
    if not all(torch.equal(outs[0], o) for o in outs[1:]):
        raise SystemExit("the builds' outputs differ: a prefetch hint must not change bits")

    times: dict[tuple[int, str], list[float]] = {}
    for _ in range(args.rounds):
        for rows in ROWS:
            xs = {k: torch.randn(rows, k, generator=g).bfloat16() for k in (576, 1536)}
            for h in hints:
                calls = fns[h]
                for k, f in calls:  # warm
                    f(xs[k], None)
                best = float("inf")
                for _ in range(6):
                    t = time.perf_counter()
                    for k, f in calls:
                        f(xs[k], None)
                    best = min(best, time.perf_counter() - t)
                times.setdefault((rows, h), []).append(best * 1e3)
    print(f"one forward's linears, ms (median of {args.rounds} rounds, each the best of 6)")
    print("| rows | " + " | ".join(hints) + " |\n|---|" + "---|" * len(hints))
    for rows in ROWS:
        cells = " | ".join(f"{statistics.median(times[rows, h]):.2f}" for h in hints)
        print(f"| {rows} | {cells} |")


if __name__ == "__main__":
    main()
