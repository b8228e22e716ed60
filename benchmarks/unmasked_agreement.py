#!/usr/bin/env python3
"""How often the target's unconstrained greedy token is the constrained one, under a grammar.

  python benchmarks/unmasked_agreement.py --json-schema benchmarks/schemas/record.json \
      [--num-prompts 8] [--max-new-tokens 128]

A speculative round under a grammar could in principle verify without masks, queued behind
the last round like an unconstrained one, and check its tokens against the grammar afterwards,
cutting the round at the first token the grammar refuses. That pays only where the target's
unmasked argmax is, at most positions, the token the grammar's mask would let it choose. This
measures that share: each MT-bench first turn (chat template) is decoded greedily under the
constraint (plain decoding, the default target), then every prefix of the constrained output
is decoded one token without the constraint, and the two tokens compared. Prints the share
of positions where they agree and the mean run of agreeing positions between two that do not
(the tokens such a round would commit before its cut). Any backend; the cpu backend in fp32
by default, where one request's token does not depend on the batch beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from polyspec import LLM, SamplingParams
from polyspec.bench.datasets import load_dataset


def runs_between_misses(agree: list[bool]) -> list[int]:
    """Lengths of the runs of agreeing positions, split at each position that disagrees
    (the run after the last one included)."""
    out, run = [], 0
    for ok in agree:
        if ok:
            run += 1
        else:
            out.append(run)
            run = 0
    out.append(run)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--json-schema", type=Path, help="a JSON schema file")
    group.add_argument("--regex")
    ap.add_argument("--target", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    constraint = (
        {"json_schema": json.loads(args.json_schema.read_text())}
        if args.json_schema
        else {"regex": args.regex}
    )
    _, prompts = load_dataset("mt_bench", args.num_prompts)
    llm = LLM(target=args.target, backend=args.backend, dtype=args.dtype, max_batch_size=16)
    outs = llm.chat(prompts, SamplingParams(max_new_tokens=args.max_new_tokens, **constraint))
    agree_all: list[bool] = []
    runs: list[int] = []
    for prompt, out in zip(prompts, outs):
        ids = llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=True
        )
        got = list(out.token_ids)
        prefixes = [list(ids) + got[:i] for i in range(len(got))]
        free = llm.generate(
            prompt_token_ids=prefixes,
            sampling_params=SamplingParams(max_new_tokens=1, ignore_eos=True),
        )
        agree = [f.token_ids[0] == t for f, t in zip(free, got)]
        agree_all += agree
        runs += runs_between_misses(agree)
        print(f"{sum(agree)}/{len(agree)} agree  {out.text[:70]!r}", flush=True)
    share = sum(agree_all) / len(agree_all)
    print(
        f"agree {sum(agree_all)}/{len(agree_all)} = {share:.3f}; "
        f"mean run between disagreements {statistics.fmean(runs):.2f} tokens"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
