#!/usr/bin/env python3
"""What a grammar's token masks cost on this host: one at a time, and in one parallel call.

  python benchmarks/mask_cost.py --target model.gguf --json-schema benchmarks/schemas/record.json
  python benchmarks/mask_cost.py --target model.gguf --regex '[a-z]{1,24}' --threads 1,2,4

A constrained speculative round computes a mask for every draft lane and tree node of each
constrained request, on the host, between its device phases (docs/structured-output.md,
"Execution"); a constrained plain step computes one per request. This script generates one
constrained output with a plain engine, then at each of its positions copies the request's
grammar state there and advances it by the next ``--path`` tokens (a tree node's path below
a round's root: ``Matcher.fork``), and times the copies, the masks of all those states
computed one after another, and the same masks computed in one call on llguidance's
executor with each thread count of ``--threads`` (the engine uses 80 % of the CPUs, at most
32). Each timing computes masks of fresh copies, so that no state reuses a mask it computed
before. It also times the grammar's verdict on one token (``Matcher.allows``, which a greedy
round's walk asks instead of a mask) at each position, for the output's next token and for
the token after it in the vocabulary, and the tokens the grammar forces there
(``Matcher.forced_tokens``, llguidance's ``compute_ff_tokens``, which a draft masked at its
root only asks once a round).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

from polyspec import LLM, SamplingParams
from polyspec.constrain.matcher import fill_masks, mask_width


def _threads(text: str) -> list[int]:
    return sorted({int(t) for t in text.split(",") if t.strip()})


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--backend", default=None, help="default: the best available")
    p.add_argument("--dtype", default="auto")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--json-schema", type=Path, help="a JSON schema file")
    group.add_argument("--regex")
    p.add_argument("--prompt", default="Describe a book you like as a record.")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--path", type=int, default=2, help="tokens each copy is advanced by")
    default = ",".join(str(t) for t in (1, 2, 4, 8, 16, 32) if t <= (os.cpu_count() or 1))
    p.add_argument("--threads", type=_threads, default=_threads(default))
    p.add_argument("--repeats", type=int, default=3, help="timings per measure (the best kept)")
    args = p.parse_args(argv)
    if args.json_schema is not None:
        constraint = ("json_schema", args.json_schema.read_text())
    else:
        constraint = ("regex", args.regex)
    llm = LLM(target=args.target, backend=args.backend, dtype=args.dtype, max_batch_size=1)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, **{constraint[0]: constraint[1]})
    tokens = llm.generate([args.prompt], params)[0].token_ids
    grammars = llm.scheduler.grammars
    # The committed state at each position that leaves ``--path`` tokens below it.
    bases = []
    for pos in range(len(tokens) - args.path):
        m = grammars.matcher(constraint)
        m.advance(tokens[:pos])
        bases.append((m, tokens[pos : pos + args.path]))
    if not bases:
        raise SystemExit(f"the output has {len(tokens)} tokens: too few for --path {args.path}")
    width = mask_width(bases[0][0].vocab_size)

    def forks() -> tuple[list, float]:
        start = time.perf_counter()
        states = [m.fork(path) for m, path in bases]
        seconds = time.perf_counter() - start
        return [(s, row) for row, s in enumerate(states) if s is not None], seconds

    def best(executor) -> float:
        times = []
        for _ in range(args.repeats):
            states, _ = forks()
            out = np.zeros((len(bases), width), dtype=np.int32)
            start = time.perf_counter()
            fill_masks(executor, states, out)
            times.append(time.perf_counter() - start)
        return min(times) / len(states)

    import llguidance

    fork_us = min(forks()[1] for _ in range(args.repeats)) / len(bases) * 1e6

    def verdicts() -> float:
        start = time.perf_counter()
        for m, path in bases:
            m.allows(path[0])
            m.allows((path[0] + 1) % m.vocab_size)
        return time.perf_counter() - start

    allows_us = min(verdicts() for _ in range(args.repeats)) / (2 * len(bases)) * 1e6

    def forced() -> float:  # llguidance's own call: the matcher keeps its answer per commit
        start = time.perf_counter()
        for m, _ in bases:
            m._m.compute_ff_tokens()
        return time.perf_counter() - start

    forced_us = min(forced() for _ in range(args.repeats)) / len(bases) * 1e6
    result = {
        "tokens": len(tokens),
        "states": len(bases),
        "fork_us": fork_us,
        "allows_us": allows_us,
        "forced_tokens_us": forced_us,
        "one_at_a_time_us": best(None) * 1e6,
        "executor_us": {},
    }
    for n in args.threads:
        result["executor_us"][n] = best(llguidance.LLExecutor(num_threads=n)) * 1e6
    print(
        f"{result['states']} grammar states along a {len(tokens)}-token output, {os.cpu_count()} CPUs"
    )
    print(f"copy and advance by {args.path} tokens: {fork_us:.1f} us a state")
    print(f"the grammar's verdict on one token (Matcher.allows): {allows_us:.2f} us")
    print(f"the tokens the grammar forces (Matcher.forced_tokens): {forced_us:.2f} us")
    print(f"masks one at a time: {result['one_at_a_time_us']:.1f} us a mask")
    for n, us in result["executor_us"].items():
        print(f"masks in one call, {n} threads: {us:.1f} us a mask")
    return result


if __name__ == "__main__":
    main()
