#!/usr/bin/env python3
"""Torch operations inside one captured decode round (cpu proxy for a round's device work).

  python benchmarks/count_ops_in_replays.py --batch-size 16 --tree 3-3-8

On an accelerator a captured round's cost is its kernels; on the cpu backend the graph runner
replays by rerunning the captured function, so counting the torch operations dispatched
inside a replay counts what the graph holds. ``benchmarks/count_round_ops.py`` counts the
operations *outside* the replays. Tiny bigram models (fp32, an EAGLE-1 head,
:func:`polyspec.testing.builders.build_bigram_models`), ``graphs = "on"``, overlap off: one
warm-up generate captures the graphs, then the replays of a second one are counted. Prints,
per captured computation, its replays and the mean operations per replay; ``--shapes FILE``
also writes the first round replay's operations with their argument shapes (JSON), for
comparing two checkouts (run this script with ``PYTHONPATH`` pointing at the other one's
package).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from collections.abc import Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from polyspec import LLM, SamplingParams, SpeculativeConfig
from polyspec.plugins import create_backend
from polyspec.testing.builders import build_bigram_models


class _Count(TorchDispatchMode):
    """Counts the operations dispatched while active (and their shapes, when asked)."""

    def __init__(self, shapes: collections.Counter | None = None):
        super().__init__()
        self.n = 0
        self.shapes = shapes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        if self.shapes is not None:
            dims = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
            self.shapes[f"{func.overloadpacket.__name__} {dims}"] += 1
        return func(*args, **(kwargs or {}))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--tree", default="3-3-8", help="S-K-N (default 3-3-8)")
    ap.add_argument("--shapes", help="write the first round's operations and shapes here")
    args = ap.parse_args(argv)
    bs = args.batch_size
    num_steps, topk, num_draft_tokens = map(int, args.tree.split("-"))
    torch.set_num_threads(1)
    backend = create_backend("cpu")
    target, head = build_bigram_models(backend, layer_scale=0.1)
    spec = SpeculativeConfig("eagle", num_steps=num_steps, topk=topk,
                             num_draft_tokens=num_draft_tokens)  # fmt: skip
    llm = LLM.from_modules(
        target, head, spec, backend=backend, graphs="on", max_batch_size=bs,
        max_graph_batch_size=bs, max_context=256, overlap_rounds="off",
    )  # fmt: skip
    prompts = [[3 + (7 * i + j) % 60 for j in range(32)] for i in range(bs)]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts, sampling_params=params)  # captures the graphs
    ops, replays = collections.Counter(), collections.Counter()
    shapes = collections.Counter() if args.shapes else None
    runner = llm.worker.graphs.runner
    replay = runner.replay

    def counted(key, inputs):
        name = key[0]
        first_round = shapes is not None and name.startswith("round") and not replays[name]
        replays[name] += 1
        with _Count(shapes if first_round else None) as count:
            out = replay(key, inputs)
        ops[name] += count.n
        return out

    runner.replay = counted
    llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for name in sorted(replays):
        print(
            f"{name:32s} replays {replays[name]:4d}  ops per replay {ops[name] / replays[name]:8.1f}"
        )
    if args.shapes:
        with open(args.shapes, "w") as f:
            json.dump(dict(sorted(shapes.items())), f, indent=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
