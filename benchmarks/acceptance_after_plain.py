#!/usr/bin/env python3
"""Acceptance of a request's speculative rounds after plain rounds, against the same request
speculating throughout.

  python benchmarks/acceptance_after_plain.py --target model.gguf \
      --draft core/heads/smollm2-135m-eagle3 --prompts 0,3,10,20 --backend cpu

A batch whose rounds are plain (``batch_trees`` ``2:plain`` here, the engine's choice for large
batches) skips the draft: an EAGLE head is caught up when the batch shrinks and its rounds turn
speculative, from the target features kept meanwhile. This runs each MT-bench first turn
(chat template) twice in a batch of two, one copy stopping after ``--plain-tokens`` so that
the other runs plain rounds until then and speculative rounds after, and once alone,
speculating throughout; prints the tokens a speculative round committed, over the rounds
after the first ``--plain-tokens`` + 2 tokens, in both runs (greedy: the texts are equal,
checked). Equal acceptance means the catch-up left the head as drafting throughout would.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from polyspec import LLM, SamplingParams, SpeculativeConfig
from polyspec.bench.datasets import load_dataset


def mean_after(rounds: list[int], start: int) -> tuple[float, int]:
    """Mean tokens a round committed over the rounds starting at output position >= start."""
    pos, kept = 0, []
    for n in rounds:
        if pos >= start:
            kept.append(n)
        pos += n
    return (statistics.fmean(kept) if kept else 0.0), len(kept)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--algorithm", default="eagle3")
    ap.add_argument("--backend", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tree", default="3-3-8", help="S-K-N")
    ap.add_argument("--prompts", default="0,3,10,20", help="MT-bench first turns (indices)")
    ap.add_argument("--plain-tokens", type=int, default=60)
    ap.add_argument("--max-new-tokens", type=int, default=140)
    args = ap.parse_args(argv)
    s, k, n = (int(x) for x in args.tree.split("-"))

    def engine(batch_trees: str) -> LLM:
        spec = SpeculativeConfig(
            algorithm=args.algorithm, num_steps=s, topk=k, num_draft_tokens=n,
            batch_trees=batch_trees,
        )  # fmt: skip
        return LLM(
            target=args.target, draft=args.draft, speculative=spec, backend=args.backend,
            dtype=args.dtype, max_batch_size=2,
        )  # fmt: skip

    mixed, alone = engine("2:plain"), engine("")
    _, prompts = load_dataset("mt_bench")
    short = SamplingParams(max_new_tokens=args.plain_tokens, ignore_eos=True)
    long = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    start = args.plain_tokens + 2
    print(f"tokens a round committed after output position {start} (tree {args.tree})")
    print("prompt | prompt tokens | after plain rounds | speculating throughout")
    both = [], []
    for i in (int(x) for x in args.prompts.split(",")):
        ids = mixed.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompts[i]}], tokenize=True
        )
        after = mixed.generate(prompt_token_ids=[ids, ids], sampling_params=[short, long])[1]
        ref = alone.generate(prompt_token_ids=[ids], sampling_params=[long])[0]
        if after.token_ids != ref.token_ids:
            print(f"prompt {i}: the outputs differ", file=sys.stderr)
            return 1
        a, na = mean_after(after.stats.accepted_per_round, start)
        r, nr = mean_after(ref.stats.accepted_per_round, start)
        both[0].append(a)
        both[1].append(r)
        print(f"{i} | {len(ids)} | {a:.2f} ({na} rounds) | {r:.2f} ({nr} rounds)")
    print(f"mean | | {statistics.fmean(both[0]):.2f} | {statistics.fmean(both[1]):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
