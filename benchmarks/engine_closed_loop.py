#!/usr/bin/env python3
"""The engine under a closed-loop load, without HTTP: where a serving run's time goes.

  python benchmarks/engine_closed_loop.py --concurrency 16 --num-prompts 48 \\
      --backend cuda --dtype bfloat16 --target model.gguf --algorithm eagle3 --draft HEAD

``polyspec bench-serve`` keeps ``--concurrency`` requests in flight: a new one is sent each
time one finishes, so the batch changes every few rounds. This drives the same load straight
into the engine loop (a finished request's done callback submits the next prompt, on the
loop's own thread, so nothing waits on a client) and reports, per system (speculative, then
plain with the same flags and ``--algorithm none``):

- output tokens/s over the run, and the same figure for the same prompts as one offline
  ``LLM.generate`` call at batch ``--concurrency`` (the load's upper bound);
- the engine's steps: how many prefilled (a request joined), how many decoded, their mean
  wall time each, and the time between steps;
- the queued rounds (``overlap_rounds``): how many were queued and how many were used (the
  others were dropped because the batch changed);
- the batch sizes the decode rounds ran at, and the graphs captured during the run (a
  capture on first use lands inside the timed run).

A serving run slower than this load is the server's cost (HTTP, streaming, the GIL); a load
much slower than the offline figure is the joins' cost.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import threading
import time
from collections.abc import Sequence

from polyspec.bench.datasets import load_dataset
from polyspec.commands.generate import add_engine_arguments, engine_from_args
from polyspec.config import SamplingParams


def _instrument(sched) -> dict:
    """Wrap the scheduler's prefill and decode to count and time them (this script only)."""
    rec = {"prefill": [0, 0.0], "decode": [0, 0.0], "batch": collections.Counter()}
    prefill, decode = sched._prefill, sched._decode

    def timed_prefill(finished):
        t0 = time.perf_counter()
        try:
            return prefill(finished)
        finally:
            rec["prefill"][0] += 1
            rec["prefill"][1] += time.perf_counter() - t0

    def timed_decode(batch, finished):
        t0 = time.perf_counter()
        try:
            return decode(batch, finished)
        finally:
            rec["decode"][0] += 1
            rec["decode"][1] += time.perf_counter() - t0
            rec["batch"][len(batch)] += 1

    sched._prefill, sched._decode = timed_prefill, timed_decode
    return rec


def closed_loop(llm, prompts: list[list[int]], concurrency: int, params: SamplingParams) -> dict:
    """Run ``prompts`` with ``concurrency`` in flight; -> the figures."""
    loop = llm.engine
    sched, worker = llm.scheduler, llm.worker
    rec = _instrument(sched)
    queued0 = dict(worker.queued_rounds)
    graphs0 = worker.graphs.num_captured if worker.graphs is not None else 0
    steps0 = loop.stats().steps_total
    todo = collections.deque(prompts)
    done = threading.Event()
    outputs = []

    def on_done(handle):
        outputs.append(handle.result())
        if todo:
            submit()
        elif len(outputs) == len(prompts):
            done.set()

    def submit():
        h = loop.submit(todo.popleft(), params, stream=False, start=False)
        h.add_done_callback(on_done)

    t0 = time.perf_counter()
    for _ in range(min(concurrency, len(prompts))):
        submit()
    loop.drive(done.is_set)
    wall = time.perf_counter() - t0
    sched._prefill = type(sched)._prefill.__get__(sched)
    sched._decode = type(sched)._decode.__get__(sched)
    st = loop.stats()
    tokens = sum(len(o.token_ids) for o in outputs)
    steps = st.steps_total - steps0
    busy = rec["prefill"][1] + rec["decode"][1]
    bs = rec["batch"]
    rounds = sum(bs.values())
    return {
        "wall_s": wall,
        "output_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "failed": sum(o.finish_reason == "error" for o in outputs),
        "steps": steps,
        "prefill_steps": rec["prefill"][0],
        "prefill_ms_mean": 1000 * rec["prefill"][1] / max(rec["prefill"][0], 1),
        "decode_rounds": rec["decode"][0],
        "decode_ms_mean": 1000 * rec["decode"][1] / max(rec["decode"][0], 1),
        "outside_steps_s": wall - busy,
        "queued": worker.queued_rounds["queued"] - queued0["queued"],
        "queued_used": worker.queued_rounds["used"] - queued0["used"],
        "graphs_captured": (worker.graphs.num_captured if worker.graphs is not None else 0)
        - graphs0,
        "mean_batch": sum(k * v for k, v in bs.items()) / max(rounds, 1),
        "batch_sizes": dict(sorted(bs.items())),
    }


def offline(llm, prompts: list[list[int]], params: SamplingParams) -> dict:
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    return {"wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall}


def run_system(args, plain: bool) -> dict:
    ns = argparse.Namespace(**vars(args))
    if plain:
        ns.algorithm, ns.draft = "none", None
    ns.max_batch_size = ns.max_batch_size or args.concurrency
    llm, _, _ = engine_from_args(ns)
    _, texts = load_dataset(args.dataset, args.num_prompts)
    prompts = [llm.tokenizer.apply_chat_template(t, tokenize=True) for t in texts]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    # Warm-up: captures graphs and compiles for every batch size the load forms.
    llm.generate(prompt_token_ids=prompts[: args.concurrency], sampling_params=params)
    closed_loop(llm, prompts[: args.concurrency], args.concurrency, params)
    out = {}
    for r in range(args.repeats):
        out[f"closed_loop_{r}"] = closed_loop(llm, prompts, args.concurrency, params)
        out[f"offline_{r}"] = offline(llm, prompts, params)
    llm.shutdown()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_arguments(ap)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--dataset", default="mt_bench")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--systems", default="spec,plain")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    args.max_new_tokens = args.max_new_tokens or 128
    report = {}
    for name in args.systems.split(","):
        report[name] = run_system(args, plain=name == "plain")
        for key, fig in report[name].items():
            print(name, key, json.dumps(fig), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
