#!/usr/bin/env python3
"""Where a batch's time goes on a CUDA device: kernel time against wall time, and the host's
waits for the device.

  python benchmarks/profile_batch.py --target model.gguf --draft core/heads/smollm2-135m-eagle3
  python benchmarks/profile_batch.py --target model.gguf --draft HEAD --syncs

One engine per system, each at ``--batch-size`` requests of the first MT-bench prompts (the set
repeated to fill the batch), greedy, ``--max-new-tokens`` each:

- ``plain``: plain decoding;
- ``spec-plain-rounds``: the speculative engine with plain rounds from batch 2 (``batch_trees
  2:plain``), i.e. what it runs at the sizes where speculation does not pay;
- ``spec``: the speculative engine on ``--tree`` (and ``--batch-trees``, e.g. ``58:plain``).

Each generates twice untimed (graphs captured), once timed, and once under ``torch.profiler``:
it prints tokens/s, the rounds, the queued rounds, and the total kernel time of the profiled
run, whose gap to the wall time is time the device spent waiting for the host; ``--out DIR``
writes each system's kernel and host-call tables. ``--syncs`` instead runs the speculative
system once under ``torch.cuda.set_sync_debug_mode("warn")`` and prints the call sites in
polyspec of every operation that made the host wait for the device (each waits for the rounds
queued behind, so a decode round should have none but its one result read, which this mode
does not count). ``--json-schema FILE`` constrains every request (structured output; the
speculative system's constrained batches speculate, their draft masked as
``--constrained-draft`` says); ``--overlap-rounds`` sets both engines' ``overlap_rounds``.
With ``--out``, the host's Python is profiled too (cProfile over one more generate, its
functions by own time in ``host_SYSTEM.txt``): where the device waits for the host, what the
host was doing. CUDA only.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import os
import pstats
import sys
import time
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from polyspec import LLM, SamplingParams, SpeculativeConfig
from polyspec.bench.datasets import load_dataset


def _engine(args, system: str) -> LLM:
    kw = {}
    if system != "plain":
        s, k, n = (int(x) for x in args.tree.split("-"))
        trees = "2:plain" if system == "spec-plain-rounds" else args.batch_trees
        kw["draft"] = args.draft
        kw["speculative"] = SpeculativeConfig(
            algorithm=args.algorithm, num_steps=s, topk=k, num_draft_tokens=n, batch_trees=trees
        )
    if args.json_schema is not None:  # structured output: the constrained batch speculates
        kw.update(constrained_speculation="on", constrained_draft=args.constrained_draft)
    return LLM(
        target=args.target, backend="cuda", dtype="bfloat16", max_batch_size=args.batch_size,
        overlap_rounds=args.overlap_rounds, **kw,
    )  # fmt: skip


def _params(args) -> SamplingParams:
    schema = None if args.json_schema is None else Path(args.json_schema).read_text()
    return SamplingParams(max_new_tokens=args.max_new_tokens, json_schema=schema)


def _prompts(llm: LLM, batch_size: int) -> list[list[int]]:
    _, texts = load_dataset("mt_bench", batch_size)
    texts = (texts * -(-batch_size // len(texts)))[:batch_size]
    return [llm.tokenizer.apply_chat_template(t, tokenize=True) for t in texts]


def profile(args, system: str) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    llm = _engine(args, system)
    prompts, params = _prompts(llm, args.batch_size), _params(args)
    for _ in range(2):
        llm.generate(prompt_token_ids=prompts, sampling_params=params)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    rounds0 = llm.scheduler.rounds
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompt_token_ids=prompts, sampling_params=params)
        torch.cuda.synchronize()
    table = prof.key_averages()
    kernel_ms = sum(e.self_device_time_total for e in table) / 1e3
    print(
        f"{system} batch {args.batch_size}: {tokens / wall:.0f} tok/s ({tokens} tokens in "
        f"{1e3 * wall:.1f} ms), {llm.scheduler.rounds - rounds0} rounds, kernel time of the "
        f"profiled run {kernel_ms:.1f} ms, rounds by tree {llm.worker.rounds_by_tree}, "
        f"queued {llm.worker.queued_rounds}"
    )
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"profile_{system}.txt"), "w") as f:
            for key in ("self_device_time_total", "self_cpu_time_total"):
                f.write(table.table(sort_by=key, row_limit=30, max_name_column_width=70) + "\n")
        host = cProfile.Profile()
        host.enable()
        llm.generate(prompt_token_ids=prompts, sampling_params=params)
        torch.cuda.synchronize()
        host.disable()
        text = io.StringIO()
        pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(40)
        with open(os.path.join(args.out, f"host_{system}.txt"), "w") as f:
            f.write(text.getvalue())


def syncs(args) -> None:
    llm = _engine(args, "spec")
    prompts, params = _prompts(llm, args.batch_size), _params(args)
    llm.generate(prompt_token_ids=prompts, sampling_params=params)
    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):  # noqa: ARG001
        frames = [
            f for f in traceback.extract_stack()[:-1] if os.sep + "polyspec" in f.filename
            or os.sep + "core" + os.sep in f.filename or os.sep + "backends" + os.sep in f.filename
        ]  # fmt: skip
        sites[
            " <- ".join(
                f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in frames[::-1][:4]
            )
        ] += 1

    rounds0 = llm.scheduler.rounds
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            llm.generate(prompt_token_ids=prompts, sampling_params=params)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    print(
        f"{llm.scheduler.rounds - rounds0} engine steps with a decode round; host waits by call site:"
    )
    for site, n in sites.most_common(30):
        print(f"{n:6d}  {site or '(outside polyspec)'}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--algorithm", default="eagle3")
    ap.add_argument("--tree", default="3-3-8", help="S-K-N of the speculative system")
    ap.add_argument("--batch-trees", default="", help="the speculative system's batch_trees")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--systems", default="plain,spec-plain-rounds,spec")
    ap.add_argument("--syncs", action="store_true", help="the host's waits instead")
    ap.add_argument("--json-schema", help="constrain every request to this JSON schema")
    ap.add_argument("--constrained-draft", default="auto", choices=["auto", "levels", "root"])
    ap.add_argument("--overlap-rounds", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--out", help="write each system's profile tables here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("CUDA only: torch.profiler's kernel times and the sync debug mode need a GPU")
    if args.syncs:
        syncs(args)
        return 0
    for system in args.systems.split(","):
        profile(args, system)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
