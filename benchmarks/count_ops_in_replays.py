#!/usr/bin/env python3
"""Torch operations inside one captured decode round (cpu proxy for a round's device work).

  python benchmarks/count_ops_in_replays.py --batch-size 16 --tree 3-3-8

On an accelerator a captured round's cost is its kernels; on the cpu backend the graph runner
replays by rerunning the captured function, so counting the torch operations dispatched
inside a replay counts what the graph holds. ``benchmarks/count_round_ops.py`` counts the
operations *outside* the replays. Tiny bigram models (fp32, an EAGLE-1 head,
:func:`polyspec.testing.builders.build_bigram_models`), or with ``--algorithm eagle3`` the
shipped head's kind of round (bench_target_size.py's tiny preset, random weights, an EAGLE-3
head reading the target's aux features), ``graphs = "on"``, overlap off: one
warm-up generate captures the graphs, then the replays of a second one are counted. Prints,
per captured computation, its replays and the mean operations per replay; ``--shapes FILE``
also writes the first round replay's operations with their argument shapes (JSON), for
comparing two checkouts (run this script with ``PYTHONPATH`` pointing at the other one's
package).

``--sites N`` instead answers what a round on a Triton backend launches besides its Triton
kernels: the KernelSet is swapped for the Triton kernels (run in Triton's interpreter), and
each operation that would launch a device kernel (not a view, an allocation or a no-op
conversion) is charged to its innermost call site in polyspec's ``core/`` or ``kernels/`` (a
Triton wrapper's own torch operations included), where every backend runs it as a torch
launch; the N busiest sites of the first round replay are printed. Operations charged to
``backends/`` (the cpu backend's own linear, attention and KV store, which the cuda backend
runs as Triton kernels) and the interpreter's own are left out. The models are fp32, so a
bf16 model's conversions are not among them. With programmatic dependent launch hiding the
Triton kernels' launch gaps (docs/backends/cuda.md), these are the launches that keep theirs.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
import traceback
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


ALLOCATIONS = {"empty", "empty_strided", "new_empty", "new_empty_strided", "set_"}


class _Sites(TorchDispatchMode):
    """Counts the operations that launch a device kernel, by their innermost call site in
    ``core/`` or ``kernels/`` (module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in ALLOCATIONS or _aliases_an_input(name, out, args):
            return out
        for frame in reversed(traceback.extract_stack()[:-1]):
            path = frame.filename.replace(os.sep, "/")
            if "/triton/runtime/" in path or "/backends/" in path:
                return out  # the interpreter running a kernel, or the backend's own kernels
            for root in ("/core/", "/kernels/"):
                if root in path and "/core/testing/" not in path:
                    where = root.strip("/") + "/" + path.rsplit(root, 1)[1]
                    self.sites[f"{where}:{frame.lineno} {frame.name}: {name}"] += 1
                    return out
        return out


def _aliases_an_input(name: str, out, args) -> bool:
    """No kernel: a result that is no tensor, or a view or a no-op conversion, sharing the
    storage of an input (in-place operations, whose names end in ``_``, launch a kernel and
    return their input)."""
    if isinstance(out, (tuple, list)):
        out = next((o for o in out if isinstance(o, torch.Tensor)), None)
    if out is None or not isinstance(out, torch.Tensor):
        return True  # no tensor comes out (a dtype, a shape): no kernel
    if name.endswith("_") or out.is_mkldnn:
        return False
    ptr = out.untyped_storage().data_ptr()
    inputs = (a for a in args if isinstance(a, torch.Tensor) and not a.is_mkldnn)
    return any(a.untyped_storage().data_ptr() == ptr for a in inputs)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--tree", default="3-3-8", help="S-K-N (default 3-3-8)")
    ap.add_argument(
        "--algorithm",
        choices=("eagle", "eagle3"),
        default="eagle",
        help="eagle: the bigram models (default); eagle3: bench_target_size.py's tiny preset "
        "(random weights, an EAGLE-3 head with aux features: the shipped head's round)",
    )
    ap.add_argument("--shapes", help="write the first round's operations and shapes here")
    ap.add_argument(
        "--sites",
        type=int,
        default=0,
        metavar="N",
        help="with the Triton kernels (interpreted): the N call sites in core/ and kernels/ that "
        "launch the most torch kernels in the first round replay (module doc)",
    )
    args = ap.parse_args(argv)
    bs = args.batch_size
    num_steps, topk, num_draft_tokens = map(int, args.tree.split("-"))
    torch.set_num_threads(1)
    backend = create_backend("cpu")
    if args.sites:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' modules are imported
        from polyspec.kernels.triton import triton_kernel_overrides

        backend.kernels = dataclasses.replace(backend.kernels, **triton_kernel_overrides())
    if args.algorithm == "eagle":
        target, head = build_bigram_models(backend, layer_scale=0.1)
    else:
        from bench_target_size import PRESETS, build_models  # this script's directory

        target, head = build_models(PRESETS["tiny"], backend, torch.float32)
    spec = SpeculativeConfig(args.algorithm, num_steps=num_steps, topk=topk,
                             num_draft_tokens=num_draft_tokens)  # fmt: skip
    llm = LLM.from_modules(
        target, head, spec, backend=backend, graphs="on", max_batch_size=bs,
        max_graph_batch_size=bs, max_context=256, overlap_rounds="off",
    )  # fmt: skip
    prompts = [[3 + (7 * i + j) % 60 for j in range(32)] for i in range(bs)]
    # The interpreter runs each Triton program in Python: fewer tokens with --sites.
    params = SamplingParams(max_new_tokens=8 if args.sites else 40, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts, sampling_params=params)  # captures the graphs
    ops, replays = collections.Counter(), collections.Counter()
    shapes = collections.Counter() if args.shapes else None
    runner = llm.worker.graphs.runner
    replay = runner.replay
    sites: dict[str, collections.Counter] = {}

    def counted(key, inputs):
        name = key[0]
        first_round = name.startswith("round") and not replays[name]
        replays[name] += 1
        with _Count(shapes if first_round and shapes is not None else None) as count:
            if first_round and args.sites:
                with _Sites() as where:
                    out = replay(key, inputs)
                sites[name] = where.sites
            else:
                out = replay(key, inputs)
        ops[name] += count.n
        return out

    runner.replay = counted
    llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for name in sorted(replays):
        print(
            f"{name:32s} replays {replays[name]:4d}  ops per replay {ops[name] / replays[name]:8.1f}"
        )
    for name, counter in sites.items():
        print(f"\n{name}: {sum(counter.values())} torch launches in one replay")
        for site, n in counter.most_common(args.sites):
            print(f"{n:4d}  {site}")
    if args.shapes:
        with open(args.shapes, "w") as f:
            json.dump(dict(sorted(shapes.items())), f, indent=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
