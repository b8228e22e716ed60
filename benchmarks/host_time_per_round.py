#!/usr/bin/env python3
"""Host time per captured decode round outside the graph replays.

  python benchmarks/host_time_per_round.py                       # cpu, batch 1, S=3 K=6 N=16
  python benchmarks/host_time_per_round.py --topk 3 --num-draft-tokens 8 --plain

A round that replays captured graphs spends the rest of its wall time on the host: scheduling,
the round's upload and download, committing tokens (time the round's device work does not cover). This
times one generate on a tiny bigram model (:func:`polyspec.testing.builders.build_bigram_models`,
whose drafts are mostly accepted) with ``graphs = "on"``, subtracting the time spent inside
``GraphRunner.replay`` (on an asynchronous device a replay returns at once: there the figure is
the host's time, waits for the device included). One thread, after a warm-up generate that
captures the graphs; the prompts' prefill (32 tokens each) is in the wall time, spread over
the rounds.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import torch

from polyspec import LLM, SamplingParams, SpeculativeConfig
from polyspec.plugins import create_backend
from polyspec.testing.builders import build_bigram_models


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--num-steps", type=int, default=3)
    ap.add_argument("--topk", type=int, default=6)
    ap.add_argument("--num-draft-tokens", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=300)
    ap.add_argument("--plain", action="store_true", help="plain decoding instead")
    ap.add_argument("--overlap-rounds", action="store_true", help="EngineConfig.overlap_rounds")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    backend = create_backend(args.backend)
    target, head = build_bigram_models(backend, layer_scale=0.1)
    spec = None
    if not args.plain:
        spec = SpeculativeConfig(
            "eagle", num_steps=args.num_steps, topk=args.topk,
            num_draft_tokens=args.num_draft_tokens,
        )  # fmt: skip
    llm = LLM.from_modules(
        target, None if args.plain else head, spec, backend=backend, graphs="on",
        max_batch_size=args.batch_size, max_graph_batch_size=args.batch_size,
        max_context=args.max_new_tokens + 64, overlap_rounds="on" if args.overlap_rounds else "off",
    )  # fmt: skip
    prompts = [[3 + (7 * i + j) % 60 for j in range(32)] for i in range(args.batch_size)]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts, sampling_params=params)  # captures the graphs
    runner = llm.worker.graphs.runner
    replay, inside = runner.replay, [0.0]

    def timed_replay(key, inputs):
        t0 = time.perf_counter()
        try:
            return replay(key, inputs)
        finally:
            inside[0] += time.perf_counter() - t0

    runner.replay = timed_replay
    backend.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    backend.synchronize()
    wall = time.perf_counter() - t0
    rounds = max(o.stats.num_rounds for o in outs)
    accept = sum(o.stats.mean_acceptance_length for o in outs) / len(outs)
    print(
        f"{'plain' if args.plain else f'S={args.num_steps} K={args.topk} N={args.num_draft_tokens}'}"
        f" batch {args.batch_size} on {args.backend}: {rounds} rounds, {accept:.2f} tokens a "
        f"round, wall {1e3 * wall / rounds:.3f} ms a round, in replays "
        f"{1e3 * inside[0] / rounds:.3f} ms, outside {1e3 * (wall - inside[0]) / rounds:.3f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
