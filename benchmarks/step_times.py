#!/usr/bin/env python3
"""Wall time of every engine step of one batch, by the tree its decode round ran.

  python benchmarks/step_times.py --target model.gguf --draft HEAD --batch-trees 'plain;auto;58:plain'

One engine per ``--batch-trees`` entry: ``plain`` (no draft), ``auto`` (the head's trees, chosen
at start-up), ``none`` (``--tree`` at every batch size) or a ``batch_trees`` value. Each engine
runs every size of ``--batch-sizes``: that many requests of the MT-bench prompts, greedy,
``--max-new-tokens`` each, two untimed generates (graphs captured), then one timed. It prints
tokens/s, the steps and their time by kind (``prefill+TREE``: a step with a prefill chunk,
under its decode round's tree; ``TREE``: a decode round alone), each catch-up of a draft
behind after plain rounds (requests, positions, ms with the device synchronised), the time
outside steps (before the first, between them, after the last) with the garbage collector's
pauses, the slowest steps and the sequence of steps (requests decoding, kind, ms). The device
is synchronised only around the timed generate and the catch-ups, so a step's time is the
host's (with overlapped rounds a step returns before its queued round has run).
"""

from __future__ import annotations

import argparse
import collections
import gc
import sys
import time
from collections.abc import Sequence

from polyspec import LLM, SamplingParams, SpeculativeConfig
from polyspec.bench.datasets import load_dataset


def build(args, batch_trees: str) -> LLM:
    """The engine of one ``--batch-trees`` entry (module doc)."""
    kw = dict(backend=args.backend, dtype=args.dtype, max_batch_size=max(args.batch_sizes))
    if batch_trees == "plain":
        return LLM(target=args.target, **kw)
    if batch_trees == "auto":  # a dict: the engine's config fills it from the head
        spec = {"algorithm": args.algorithm}
    else:
        s, k, n = (int(x) for x in args.tree.split("-"))
        spec = SpeculativeConfig(
            algorithm=args.algorithm, num_steps=s, topk=k, num_draft_tokens=n,
            batch_trees="" if batch_trees == "none" else batch_trees,
        )  # fmt: skip
    return LLM(target=args.target, draft=args.draft, speculative=spec, **kw)


def run(args, llm: LLM, batch_trees: str, batch_size: int) -> None:
    _, texts = load_dataset("mt_bench", batch_size)
    texts = (texts * -(-batch_size // len(texts)))[:batch_size]
    prompts = [llm.tokenizer.apply_chat_template(t, tokenize=True) for t in texts]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    for _ in range(2):
        llm.generate(prompt_token_ids=prompts, sampling_params=params)
    sched, worker, backend = llm.scheduler, llm.worker, llm.backend
    steps, catch_ups, spans = [], [], []
    real_step, real_catch_up = sched.step, getattr(worker, "_catch_up", None)

    def step():
        decoding, before = len(sched.decoding), dict(worker.rounds_by_tree)
        prefill = bool(sched.prefilling or sched.waiting)
        t0 = time.perf_counter()
        out = real_step()
        t1 = time.perf_counter()
        ms = 1e3 * (t1 - t0)
        spans.append((t0, t1))
        ran = [t for t, c in worker.rounds_by_tree.items() if c != before.get(t, 0)]
        kind = ran[0] if ran else "-"
        steps.append((decoding, f"prefill+{kind}" if prefill else kind, ms))
        return out

    def catch_up(sts):  # an engine without a draft never calls it
        behind = [s.seq_len - s.draft_len for s in sts if s.draft_len < s.seq_len]
        t0 = time.perf_counter()
        real_catch_up(sts)
        if behind:
            backend.synchronize()
            catch_ups.append((len(behind), max(behind), 1e3 * (time.perf_counter() - t0)))

    sched.step = step
    if hasattr(worker, "_catch_up"):
        worker._catch_up = catch_up
    backend.synchronize()

    def gc_pause(phase: str, info: dict) -> None:
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            gcs.append((info["generation"], 1e3 * (time.perf_counter() - gc_start[0])))

    gc_start, gcs = [0.0], []
    gc.callbacks.append(gc_pause)
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    backend.synchronize()
    t_end = time.perf_counter()
    wall = t_end - t0
    gc.callbacks.remove(gc_pause)
    sched.step = real_step
    if hasattr(worker, "_catch_up"):
        worker._catch_up = real_catch_up
    tokens = sum(len(o.token_ids) for o in outs)
    by_tree: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for _, tree, ms in steps:
        by_tree[tree][0] += 1
        by_tree[tree][1] += ms
    trees = ", ".join(f"{t}: {c} steps {ms:.1f} ms" for t, (c, ms) in by_tree.items())
    print(
        f"batch {batch_size}, {batch_trees}: {tokens / wall:.0f} tok/s, wall {1e3 * wall:.1f} ms, "
        f"{len(steps)} steps ({trees}); catch-ups (requests, positions, ms): "
        f"{[(r, p, round(ms, 2)) for r, p, ms in catch_ups]}"
    )
    slowest = sorted(steps, key=lambda x: -x[2])[:8]
    between = sum(b[0] - a[1] for a, b in zip(spans, spans[1:]))
    print(
        f"  outside steps: before the first {1e3 * (spans[0][0] - t0):.1f} ms, between steps "
        f"{1e3 * between:.1f} ms, after the last {1e3 * (t_end - spans[-1][1]):.1f} ms; "
        f"garbage collections (generation, ms): {[(g, round(ms, 1)) for g, ms in gcs]}"
    )
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
        "--batch-trees", default="plain;auto",
        help="engines to time, separated by ';': plain, auto, none or a batch_trees value",
    )  # fmt: skip
    ap.add_argument("--batch-sizes", default="64", help="e.g. 64,256")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    for batch_trees in (e.strip() for e in args.batch_trees.split(";") if e.strip()):
        llm = build(args, batch_trees)
        if llm.tree_choice is not None:
            choice = llm.tree_choice
            print(f"{batch_trees}: {choice['chosen']}; round ms {choice.get('round_ms')}")
        for batch_size in args.batch_sizes:
            run(args, llm, batch_trees, batch_size)
        llm.shutdown()
        del llm
    return 0


if __name__ == "__main__":
    sys.exit(main())
