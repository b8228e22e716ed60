"""Where a bf16 decode step of SmolLM2 goes on the CPU.

Plain decoding: wall time per token, then the torch ops by self time (the row-invariant C++
kernels are not torch ops: their time is the wall time minus what the table lists).
``--spec``: speculative decoding with the shipped head and the tree the engine picks from its
``polyspec.json`` candidates on this machine: wall time per round, then a cProfile of the
rounds by cumulative time (the round's draft / verify / draft extend, the model forward, the
C++ kernels); ``--sort
tottime`` lists them by self time instead (where the Python between the kernels goes).

    python ci/profile_cpu_decode.py [--tokens 48] [--threads 2] [--spec [--sort tottime]]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from polyspec.config import SamplingParams, SpeculativeConfig
from polyspec.engine.defaults import shipped_head_path, shipped_head_settings
from polyspec.engine.llm import LLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--spec", action="store_true", help="profile speculative rounds instead")
    ap.add_argument("--sort", default="cumtime", choices=["cumtime", "tottime"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = {}
    if args.spec:
        settings = shipped_head_settings()
        # the tree the engine would pick here by default: the head's candidates, timed
        settings["tree_candidates"] = settings.pop("candidates", ())
        spec = dict(
            draft=shipped_head_path(),
            speculative=SpeculativeConfig(algorithm="eagle3", **settings),
        )
    llm = LLM(backend="cpu", dtype="bfloat16", max_batch_size=1, max_context=512, **spec)
    prompt = ["Write a story about a dragon."]
    llm.chat(["Warm up please."], SamplingParams(max_new_tokens=8))
    sp = SamplingParams(max_new_tokens=args.tokens)
    if args.spec:
        start = time.perf_counter()
        out = llm.chat(prompt, sp)[0]
        wall = time.perf_counter() - start
        rounds = len(out.stats.accepted_per_round)
        print(
            f"{len(out.token_ids)} tokens in {rounds} rounds, {1000 * wall / rounds:.2f} ms/round"
        )
        prof = cProfile.Profile()
        prof.enable()
        llm.chat(prompt, sp)
        prof.disable()
        stats = pstats.Stats(prof).sort_stats(args.sort)
        stats.print_stats(40)
        stats.print_stats("verify_tree_greedy|build_tree")  # the tree kernels, wherever they rank
        return
    start = time.perf_counter()
    n = len(llm.chat(prompt, sp)[0].token_ids)
    wall = time.perf_counter() - start
    print(f"{n} tokens, {1000 * wall / n:.2f} ms per token (prefill included)")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        n = len(llm.chat(prompt, sp)[0].token_ids)
    ops = prof.key_averages()
    total_ms = sum(e.self_cpu_time_total for e in ops) / 1000
    print(f"torch ops: {total_ms / n:.2f} ms per token (self time, all ops)")
    print(ops.table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
