#!/usr/bin/env python3
"""Structured output's ``apply_token_bitmask`` on the CPU: the torch reference against the cpu
backend's numpy version, at the shapes a constrained SmolLM2 round applies.

  python benchmarks/bench_bitmask_cpu.py [--threads N] [--reps 30]

Rows of 49,152 fp32 logits (the target's verify rows) and of 16,384 bf16 logits (the shipped
EAGLE-3 head's draft rows), 1 to 16 rows a call; every row constrained by random words (no
all-ones row for the numpy version to skip: its slowest case). Each call gets a fresh copy
of the logits (not timed). Prints the best and the median milliseconds per call of each
version (the best is the one to compare on a shared machine: the median shows what the
other jobs cost it), and checks that both give the same logits.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from polyspec.backends.cpu.bitmask import apply_token_bitmask as numpy_version
from polyspec.kernels.reference import apply_token_bitmask as reference


def _times(fn, logits: torch.Tensor, mask: torch.Tensor, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        x = logits.clone()
        t = time.perf_counter()
        fn(x, mask)
        out.append(1e3 * (time.perf_counter() - t))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    print(f"torch threads {torch.get_num_threads()}")
    print("| rows x vocab | dtype | reference best / median (ms) | numpy best / median (ms) |")
    print("|---|---|---|---|")
    for vocab, dtype in ((49152, torch.float32), (16384, torch.bfloat16)):
        for rows in (1, 3, 8, 16):
            words = rng.integers(-(2**31), 2**31, size=(rows, (vocab + 31) // 32))
            mask = torch.from_numpy(words.astype(np.int32))
            logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows))
            logits = logits.to(dtype)
            want, got = logits.clone(), logits.clone()
            reference(want, mask)
            numpy_version(got, mask)
            assert torch.equal(want, got), "the two versions differ"
            ref = _times(reference, logits, mask, args.reps)
            npy = _times(numpy_version, logits, mask, args.reps)
            print(
                f"| {rows} x {vocab} | {str(dtype).removeprefix('torch.')} "
                f"| {min(ref):.3f} / {statistics.median(ref):.3f} "
                f"| {min(npy):.3f} / {statistics.median(npy):.3f} |"
            )


if __name__ == "__main__":
    main()
