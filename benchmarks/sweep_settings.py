"""Sweep of speculative settings for the shipped head (docs/benchmarks.md).

    python benchmarks/sweep_settings.py [DTYPE] [--more | --only S-K-N,S-K-N,...] [--repeats R]
                                [--quantizations auto,none,int8] [--dynamic-depths 0,0.05,...]
                                       # MT-bench 81, 91, ..., 151; 64 new tokens

DTYPE float32 (default) or bfloat16; batch 1, 2 threads, greedy; prints a markdown table
(acceptance, tokens/s, vs plain). All systems are loaded at once and run interleaved, prompt by
prompt (alternating the order), R times over the prompts: on a shared host a sequential sweep
measured each setting in a different minute of the machine's load. ``--quantizations``: run
each setting with each ``speculative.draft_quantization`` (default: auto only).
``--dynamic-depths``: run each setting with each ``speculative.dynamic_depth`` threshold
(default: 0, every round drafts S levels).
"""

from __future__ import annotations

import sys
import time

import torch

from polyspec.bench.datasets import load_dataset
from polyspec.config import SamplingParams, SpeculativeConfig
from polyspec.defaults import shipped_head_path
from polyspec.engine.llm import LLM

SETTINGS = [(2, 1, 3), (3, 1, 4), (5, 1, 6), (3, 2, 6), (5, 2, 10), (5, 4, 16), (4, 8, 32)]
MORE_SETTINGS = [(3, 2, 4), (4, 2, 8), (3, 3, 8), (4, 3, 10), (4, 4, 12), (6, 3, 12)]
"""``--more``: moderate trees around the best of SETTINGS (bf16, where verify width is cheap)."""


def main() -> None:
    torch.set_num_threads(2)
    args = sys.argv[1:]
    settings = SETTINGS
    if "--more" in args:
        args.remove("--more")
        settings = MORE_SETTINGS
    if "--only" in args:
        i = args.index("--only")
        try:
            settings = [tuple(int(x) for x in t.split("-")) for t in args[i + 1].split(",")]
            assert all(len(t) == 3 for t in settings)
        except (IndexError, ValueError, AssertionError):
            raise SystemExit(
                "sweep_settings.py: --only takes S-K-N,S-K-N,... (e.g. 3-2-6,4-4-12)"
            ) from None
        del args[i : i + 2]
    quantizations = ["auto"]
    if "--quantizations" in args:
        i = args.index("--quantizations")
        quantizations = args[i + 1].split(",")
        del args[i : i + 2]
    depths = [0.0]
    if "--dynamic-depths" in args:
        i = args.index("--dynamic-depths")
        depths = [float(t) for t in args[i + 1].split(",")]
        del args[i : i + 2]
    rounds_of = 1
    if "--repeats" in args:
        i = args.index("--repeats")
        rounds_of = int(args[i + 1])
        del args[i : i + 2]
    dtype = args[0] if args else "float32"
    if dtype not in ("float32", "bfloat16"):
        raise SystemExit(f"sweep_settings.py: DTYPE must be float32 or bfloat16, got {dtype!r}")
    _, questions = load_dataset("mt_bench")
    prompts = questions[::10][:8]
    params = SamplingParams(max_new_tokens=64)
    systems = {"plain": LLM(dtype=dtype, max_batch_size=1)}
    for s, k, n in settings:
        for quant in quantizations:
            for depth in depths:
                spec = SpeculativeConfig(
                    algorithm="eagle3", num_steps=s, topk=k, num_draft_tokens=n,
                    draft_quantization=quant, dynamic_depth=depth,
                )  # fmt: skip
                llm = LLM(
                    draft=shipped_head_path(), speculative=spec, dtype=dtype, max_batch_size=1
                )
                label = "" if len(quantizations) == 1 else f", draft {llm.draft_quantization}"
                label += "" if len(depths) == 1 else f", dynamic depth {depth:g}"
                systems[f"S={s} K={k} N={n}{label}"] = llm
    for llm in systems.values():
        llm.chat(prompts[0], params)  # warm-up
    # Interleaved: every prompt runs on every system before the next prompt, in an order that
    # alternates, so a shared host's slow minutes fall on all systems alike.
    seconds = dict.fromkeys(systems, 0.0)
    tokens = dict.fromkeys(systems, 0)
    accepted: dict[str, list[int]] = {name: [] for name in systems}
    for rep in range(rounds_of):
        for i, q in enumerate(prompts):
            names = list(systems) if (i + rep) % 2 == 0 else list(systems)[::-1]
            for name in names:
                t = time.perf_counter()
                out = systems[name].chat(q, params)[0]
                seconds[name] += time.perf_counter() - t
                tokens[name] += len(out.token_ids)
                accepted[name] += out.stats.accepted_per_round
    base = tokens["plain"] / seconds["plain"]
    print("| setting | mean accept len | tokens/s | vs plain |\n|---|---|---|---|")
    print(f"| plain | - | {base:.1f} | 1.00x |")
    for name in list(systems)[1:]:
        tps, rounds = tokens[name] / seconds[name], accepted[name]
        print(f"| {name} | {sum(rounds) / len(rounds):.2f} | {tps:.1f} | {tps / base:.2f}x |")


if __name__ == "__main__":
    main()
