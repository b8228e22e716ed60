#!/usr/bin/env python3
"""How long a full garbage collection takes with an engine loaded, and after ``gc.freeze()``.

  python benchmarks/gc_pause.py --target model.gguf [--draft HEAD] [--backend cpu]

Builds one engine (speculative when ``--draft`` is given), then prints the objects the
collector tracks, the time of ``gc.collect()`` (``--repeats`` runs) and the time of one after
``gc.freeze()``, which ``polyspec serve`` calls once ready and ``polyspec bench`` around each
timed run: a collection of the oldest generation in the middle of serving stalls every
request in flight for the first figure.
"""

from __future__ import annotations

import argparse
import gc
import time

from polyspec import LLM


def collect_ms() -> float:
    """One full collection, in milliseconds."""
    start = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - start) * 1e3


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", help="an EAGLE head: a speculative engine (default: plain)")
    p.add_argument("--algorithm", default="eagle3")
    p.add_argument("--backend", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    spec = {"algorithm": args.algorithm} if args.draft else None
    llm = LLM(
        target=args.target, draft=args.draft, speculative=spec, backend=args.backend,
        dtype=args.dtype, max_batch_size=args.max_batch_size,
    )  # fmt: skip
    tracked = len(gc.get_objects())
    runs = [collect_ms() for _ in range(args.repeats)]
    gc.freeze()
    try:
        frozen = collect_ms()
    finally:
        gc.unfreeze()
    print(f"tracked objects: {tracked}")
    print(f"full collection: {', '.join(f'{ms:.1f}' for ms in runs)} ms")
    print(f"after gc.freeze(): {frozen:.3f} ms")
    del llm
    return {"tracked": tracked, "collect_ms": runs, "frozen_ms": frozen}


if __name__ == "__main__":
    main()
