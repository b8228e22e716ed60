#!/usr/bin/env python3
"""Where a decode round's host time goes, measured without a profiler.

  python benchmarks/round_host_time.py --target model.gguf --draft core/heads/smollm2-135m-eagle3 \
      --json-schema benchmarks/schemas/record.json --constrained-draft root --batch-size 1
  python benchmarks/round_host_time.py --target model.gguf --plain --json-schema FILE

A profiler changes what it measures here: under ``torch.profiler`` (CUPTI) an H100's graph
launches took 150-250 us of host time each, where without it a constrained round's graph runs
took about 60 us each, their inputs' copies included (docs/benchmarks.md). This script wraps
the parts of a round in wall-clock timers instead (``time.perf_counter`` around each call; a
part's time includes the parts it calls), runs the same ``--batch-size`` MT-bench first
turns three times (the first two capture graphs and compile the grammar), and prints, for
the third, milliseconds per decode round of each part: the scheduler's step and decode, the
worker's decode, a constrained round's phases, the grammar's work (``RoundMasks``,
``Matcher``), the executor's launches, each graph run (``CapturedForwards.run``: the inputs
copied in, then the replay), and every wait for the device (``HostRead.wait``). What the
host does in a round beyond those waits is time the device may idle, unless the round is
queued behind the last (``overlap_rounds``).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from polyspec import LLM, SamplingParams
from polyspec.backend import HostRead
from polyspec.bench.datasets import MT_BENCH_PACKAGED
from polyspec.constrain import masks as round_masks
from polyspec.constrain import matcher as matchers
from polyspec.engine import scheduler as scheduler_module
from polyspec.runtime import executor as executor_module
from polyspec.runtime.graphs import CapturedForwards
from polyspec.spec import base, eagle_worker, plain_worker


class Timers:
    """Wall-clock seconds and calls by part, over the calls made since :meth:`reset`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: Counter = Counter()

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def wrap(self, owner: Any, name: str, label: str) -> Callable[[], None]:
        """Time ``owner.name`` as ``label`` -> a function that puts the original back."""
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - t0
                self.calls[label] += 1

        setattr(owner, name, timed)
        return lambda: setattr(owner, name, original)


PARTS = [
    (scheduler_module.Scheduler, "step", "scheduler step"),
    (scheduler_module.Scheduler, "_prefill", "scheduler prefill"),
    (scheduler_module.Scheduler, "_decode", "scheduler decode"),
    (base.WorkerBase, "decode", "worker decode"),
    (base.WorkerBase, "_launch_phases", "constrained round's phases (speculative)"),
    (base.WorkerBase, "_plain_phases", "constrained round's phases (plain)"),
    (base.WorkerBase, "_finish", "worker finish (the result's wait included)"),
    (base.WorkerBase, "_round_inputs", "round inputs"),
    (eagle_worker.EagleWorker, "prefill", "worker prefill"),
    (plain_worker.PlainWorker, "prefill", "worker prefill"),
    (round_masks.RoundMasks, "greedy_walk", "greedy walk (its waits included)"),
    (round_masks.RoundMasks, "next_roots", "next roots' masks"),
    (round_masks.RoundMasks, "root", "roots' masks upload"),
    (round_masks.RoundMasks, "draft_levels", "draft levels' masks"),
    (round_masks.RoundMasks, "start_tree", "tree read started"),
    (scheduler_module, "next_masks", "scheduler next masks"),
    (matchers.Matcher, "advance", "matcher advance"),
    (executor_module.RoundExecutor, "launch", "executor launch"),
    (executor_module.RoundExecutor, "queue", "executor queue"),
    (CapturedForwards, "run", "graph run (copy_inputs and replay)"),
    (HostRead, "wait", "waits for the device (HostRead.wait)"),
]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", help="the draft (omit with --plain)")
    p.add_argument("--algorithm", default="eagle3")
    p.add_argument("--plain", action="store_true", help="a plain engine")
    p.add_argument("--backend", default=None, help="default: the best available")
    p.add_argument("--dtype", default="bfloat16")
    constrain = p.add_mutually_exclusive_group()
    constrain.add_argument("--json-schema", type=Path, help="constrain every request to it")
    constrain.add_argument("--regex", help="constrain every request to this regex")
    p.add_argument("--constrained-speculation", default="on", choices=["on", "off", "auto"])
    p.add_argument("--constrained-draft", default="auto", choices=["auto", "levels", "root"])
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dataset", type=Path, default=MT_BENCH_PACKAGED)
    args = p.parse_args(argv)
    if not args.plain and args.draft is None:
        p.error("--draft is required unless --plain")
    engine: dict[str, Any] = {}
    if not args.plain:
        engine = dict(
            draft=args.draft, speculative={"algorithm": args.algorithm},
            constrained_speculation=args.constrained_speculation,
            constrained_draft=args.constrained_draft,
        )  # fmt: skip
    llm = LLM(
        target=args.target, backend=args.backend, dtype=args.dtype,
        max_batch_size=args.batch_size, **engine,
    )  # fmt: skip
    turns = [json.loads(line)["turns"][0] for line in args.dataset.read_text().splitlines() if line]
    prompts = turns[: args.batch_size]
    constraint: dict[str, str] = {}
    if args.json_schema is not None:
        constraint["json_schema"] = args.json_schema.read_text()
    elif args.regex is not None:
        constraint["regex"] = args.regex
    params = SamplingParams(max_new_tokens=args.max_new_tokens, **constraint)
    timers = Timers()
    restore = [timers.wrap(*part) for part in PARTS]
    try:
        for _ in range(2):  # graphs captured, grammar compiled
            llm.generate(prompts, params)
        timers.reset()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
    finally:
        for undo in reversed(restore):
            undo()
    rounds = max(timers.calls["worker decode"], 1)
    tokens = sum(len(o.token_ids) for o in outs)
    print(
        f"batch {args.batch_size}: {tokens} tokens in {wall * 1e3:.1f} ms "
        f"({tokens / wall:.0f} tokens/s), {rounds} decode rounds, "
        f"{wall / rounds * 1e3:.3f} ms a round (the prefill included)"
    )
    per_round = {label: s / rounds * 1e3 for label, s in timers.seconds.items()}
    for label, ms in sorted(per_round.items(), key=lambda kv: -kv[1]):
        print(f"  {label:45s} {ms:8.3f} ms a round ({timers.calls[label]} calls)")
    return {
        "tokens": tokens, "seconds": wall, "rounds": rounds, "ms_per_round": per_round,
        "calls": dict(timers.calls),
    }  # fmt: skip


if __name__ == "__main__":
    main()
