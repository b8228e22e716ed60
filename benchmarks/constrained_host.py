#!/usr/bin/env python3
"""Host time a constrained round spends on the grammar, and the masks it computes.

  python benchmarks/constrained_host.py --target model.gguf --draft core/heads/smollm2-135m-eagle3 \
      --json-schema benchmarks/schemas/record.json --backend cuda --constrained-draft root \
      --batch-size 4 [--profile]

Runs one batch of MT-bench first turns under the constraint to warm up (graphs, compiled
grammar), then the next ``--batch-size`` turns, and prints the second batch's tokens/s, and
over both batches the masks a speculative round computed (the roots' not counted) and the
host milliseconds a constrained round spent on the grammar (``WorkerBase.mask_seconds``: committing
tokens, the roots', lanes' and tree's masks, the draft-vocabulary conversion; not the waits
for the device). ``--constrained-draft plain`` runs a plain engine (one mask a request a
step). ``--profile`` runs the timed batch under cProfile and prints the functions with the
most own time and the grammar's by cumulative time; the profiler's overhead is in the figures
then.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from pathlib import Path

from polyspec import LLM, SamplingParams
from polyspec.bench.datasets import MT_BENCH_PACKAGED


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", help="the draft (required unless --constrained-draft plain)")
    p.add_argument("--algorithm", default="eagle3")
    p.add_argument("--backend", default=None, help="default: the best available")
    p.add_argument("--dtype", default="bfloat16")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--json-schema", type=Path, help="a JSON schema file")
    group.add_argument("--regex")
    p.add_argument(
        "--constrained-draft", choices=["auto", "levels", "root", "plain"], default="auto"
    )
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dataset", type=Path, default=MT_BENCH_PACKAGED)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)
    plain = args.constrained_draft == "plain"
    if not plain and args.draft is None:
        p.error("--draft is required unless --constrained-draft plain")
    constraint = (
        {"json_schema": args.json_schema.read_text()}
        if args.json_schema is not None
        else {"regex": args.regex}
    )
    engine = {}
    if not plain:
        engine = dict(
            draft=args.draft, speculative={"algorithm": args.algorithm},
            constrained_speculation="on", constrained_draft=args.constrained_draft,
        )  # fmt: skip
    llm = LLM(
        target=args.target, backend=args.backend, dtype=args.dtype,
        max_batch_size=args.batch_size, **engine,
    )  # fmt: skip
    lines = args.dataset.read_text().splitlines()
    turns = [json.loads(line)["turns"][0] for line in lines if line.strip()]
    bs = args.batch_size
    if len(turns) < 2 * bs:
        p.error(f"--dataset has {len(turns)} prompts; --batch-size {bs} needs {2 * bs}")
    params = SamplingParams(max_new_tokens=args.max_new_tokens, **constraint)
    llm.generate(turns[:bs], params)  # warm-up
    worker = llm.worker
    profiler = cProfile.Profile() if args.profile else None
    start = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    outs = llm.generate(turns[bs : 2 * bs], params)
    if profiler is not None:
        profiler.disable()
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    rounds = max(1, worker.constrained_rounds)
    result = {
        "mode": "plain" if plain else ("levels" if worker.mask_lanes else "root"),
        "tokens_per_s": tokens / seconds,
        "constrained_rounds": worker.constrained_rounds,
        "masks_per_round": worker.masks_computed / rounds,
        "mask_ms_per_round": 1e3 * worker.mask_seconds / rounds,
    }
    print(
        f"{result['mode']}, batch {bs}: {tokens} tokens at {result['tokens_per_s']:.1f} "
        f"tokens/s; masks a round {result['masks_per_round']:.1f}, grammar host time a round "
        f"{result['mask_ms_per_round']:.2f} ms ({worker.constrained_rounds} constrained rounds)"
    )
    if profiler is not None:
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(25)
        grammar = r"constrain|_launch_phases|_finish|executor.py|_decode|next_masks"
        stats.sort_stats("cumulative").print_stats(grammar, 30)
    return result


if __name__ == "__main__":
    main()
