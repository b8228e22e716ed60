#!/usr/bin/env python3
"""Acceptance of draft trees with a head: the tokens a speculative round commits, per tree.

  python benchmarks/tree_acceptance.py --trees 3-6-16,5-8-48 [--num-prompts 80] [--batch-size 8]

What a head's ``polyspec.json`` ``candidates`` record (``acceptance``) and what the engine's
start-up tree choice divides round costs by (``polyspec.engine.tree_choice``). Every MT-bench
first turn (chat template) up to ``--num-prompts``, ``--max-new-tokens`` each, greedy, once per
tree, every draft level drafted (``dynamic_depth`` 0) and the draft's weights in the model's
dtype (``draft_quantization`` none: the GPU's draft; int8 costs a little acceptance). Prints
one JSON line per tree (mean tokens a round, rounds, seconds) and checks that every tree's
texts equal the first's (greedy output does not depend on the tree). Acceptance depends on
the head, the target and the workload, not on the machine's speed or the batch size, so a
CPU measures it for a GPU (``--batch-size`` only makes it quicker).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from polyspec import LLM, SamplingParams, SpeculativeConfig
from polyspec.bench.datasets import load_dataset
from polyspec.defaults import shipped_head_path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", required=True, help="S-K-N,S-K-N,... (the first is the reference)")
    ap.add_argument("--target", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--draft", default=None, help="default: the shipped head")
    ap.add_argument("--algorithm", default="eagle3")
    ap.add_argument("--backend", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=80)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = ap.parse_args(argv)
    try:
        trees = [tuple(int(x) for x in t.split("-")) for t in args.trees.split(",")]
        if any(len(t) != 3 for t in trees):
            raise ValueError
    except ValueError:
        ap.error(f"--trees {args.trees!r}: give S-K-N,S-K-N,... (e.g. 3-6-16,5-8-48)")
    if args.threads:
        torch.set_num_threads(args.threads)
    _, prompts = load_dataset("mt_bench", args.num_prompts)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    first = None
    for s, k, n in trees:
        start = time.perf_counter()
        spec = SpeculativeConfig(
            algorithm=args.algorithm, num_steps=s, topk=k, num_draft_tokens=n,
            draft_quantization="none", dynamic_depth=0,
        )  # fmt: skip
        llm = LLM(
            target=args.target, draft=args.draft or shipped_head_path(), speculative=spec,
            backend=args.backend, dtype=args.dtype, max_batch_size=args.batch_size,
        )  # fmt: skip
        outs = llm.chat(prompts, params)
        rounds = [a for o in outs for a in o.stats.accepted_per_round]
        texts = [o.token_ids for o in outs]
        first = texts if first is None else first
        row = {
            "tree": f"{s}-{k}-{n}",
            "acceptance": round(sum(rounds) / len(rounds), 3),
            "rounds": len(rounds),
            "prompts": len(prompts),
            "seconds": round(time.perf_counter() - start, 1),
            "texts_equal_first": texts == first,
        }
        print(json.dumps(row), flush=True)
        if texts != first:
            print(
                f"tree_acceptance.py: {row['tree']}'s texts differ from the first tree's",
                file=sys.stderr,
            )
            return 1
        llm.stop_ranks()
        del llm
    return 0


if __name__ == "__main__":
    sys.exit(main())
