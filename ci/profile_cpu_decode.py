"""Where a plain bf16 decode step of SmolLM2 goes on the CPU: wall time per token, then the
torch ops by self time (the row-invariant C++ kernels are not torch ops: their time is the
wall time minus what the table lists).

    python ci/profile_cpu_decode.py [--tokens 48] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from polyspec.config import SamplingParams
from polyspec.engine.llm import LLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(backend="cpu", dtype="bfloat16", max_batch_size=1, max_context=512)
    prompt = ["Write a story about a dragon."]
    llm.chat(["Warm up please."], SamplingParams(max_new_tokens=8))
    sp = SamplingParams(max_new_tokens=args.tokens)
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
