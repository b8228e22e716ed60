#!/usr/bin/env python3
"""Wall time of every engine step of one batch, by the tree its decode round ran.

  python benchmarks/step_times.py --target model.gguf --draft HEAD --batch-trees 'none;58:plain'

One speculative engine per ``--batch-trees`` entry (``none``: ``--tree`` at every batch size),
``--batch-size`` requests of the first MT-bench prompts, greedy, ``--max-new-tokens`` each, two
untimed generates (graphs captured), then one timed: it prints tokens/s, the steps and their
time by tree (a step with a prefill counts under its decode round's tree), each catch-up of a
draft behind after plain rounds (requests, positions, ms with the device synchronised), the
slowest steps and the sequence of steps (requests decoding, tree, ms). The device is
synchronised only around the timed generate and the catch-ups, so a step's time is the host's
(with overlapped rounds a step returns before its queued round has run).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from collections.abc import Sequence

from polyspec import LLM, SamplingParams, SpeculativeConfig
from polyspec.bench.datasets import load_dataset


def run(args, batch_trees: str) -> None:
    s, k, n = (int(x) for x in args.tree.split("-"))
    spec = SpeculativeConfig(
        algorithm=args.algorithm, num_steps=s, topk=k, num_draft_tokens=n,
        batch_trees="" if batch_trees == "none" else batch_trees,
    )  # fmt: skip
    llm = LLM(
        target=args.target, draft=args.draft, speculative=spec, backend=args.backend,
        dtype=args.dtype, max_batch_size=args.batch_size,
    )  # fmt: skip
    _, texts = load_dataset("mt_bench", args.batch_size)
    texts = (texts * -(-args.batch_size // len(texts)))[: args.batch_size]
    prompts = [llm.tokenizer.apply_chat_template(t, tokenize=True) for t in texts]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    for _ in range(2):
        llm.generate(prompt_token_ids=prompts, sampling_params=params)
    sched, worker, backend = llm.scheduler, llm.worker, llm.backend
    steps, catch_ups = [], []
    real_step, real_catch_up = sched.step, worker._catch_up

    def step():
        decoding, before = len(sched.decoding), dict(worker.rounds_by_tree)
        t0 = time.perf_counter()
        out = real_step()
        ms = 1e3 * (time.perf_counter() - t0)
        ran = [t for t, c in worker.rounds_by_tree.items() if c != before.get(t, 0)]
        steps.append((decoding, ran[0] if ran else "-", ms))
        return out

    def catch_up(sts):
        behind = [s.seq_len - s.draft_len for s in sts if s.draft_len < s.seq_len]
        t0 = time.perf_counter()
        real_catch_up(sts)
        if behind:
            backend.synchronize()
            catch_ups.append((len(behind), max(behind), 1e3 * (time.perf_counter() - t0)))

    sched.step, worker._catch_up = step, catch_up
    backend.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    backend.synchronize()
    wall = time.perf_counter() - t0
    sched.step, worker._catch_up = real_step, real_catch_up
    tokens = sum(len(o.token_ids) for o in outs)
    by_tree: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for _, tree, ms in steps:
        by_tree[tree][0] += 1
        by_tree[tree][1] += ms
    trees = ", ".join(f"{t}: {c} steps {ms:.1f} ms" for t, (c, ms) in by_tree.items())
    print(
        f"batch_trees {batch_trees}: {tokens / wall:.0f} tok/s, wall {1e3 * wall:.1f} ms, "
        f"{len(steps)} steps ({trees}); catch-ups (requests, positions, ms): "
        f"{[(r, p, round(ms, 2)) for r, p, ms in catch_ups]}"
    )
    slowest = sorted(steps, key=lambda x: -x[2])[:8]
    print("  slowest steps (decoding, tree, ms):", [(d, t, round(ms, 1)) for d, t, ms in slowest])
    print("  steps:", [(d, t, round(ms, 1)) for d, t, ms in steps])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--algorithm", default="eagle3")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tree", default="3-3-8", help="S-K-N")
    ap.add_argument(
        "--batch-trees", default="none;58:plain",
        help="engines to time, separated by ';': each a batch_trees value, or none",
    )  # fmt: skip
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    for batch_trees in (e.strip() for e in args.batch_trees.split(";") if e.strip()):
        run(args, batch_trees)
    return 0


if __name__ == "__main__":
    sys.exit(main())
