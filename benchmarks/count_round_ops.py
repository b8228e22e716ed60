#!/usr/bin/env python3
"""Torch operations per speculative round outside the captured forwards, by phase (cpu proxy).

  python benchmarks/count_round_ops.py                      # batch 1 and 16, S3 K2 N6
  python benchmarks/count_round_ops.py --batch-sizes 1,4 --topk 1 --num-draft-tokens 4 --json out.json

On an accelerator with graphs, what a round spends outside its model forwards is mostly host
work per operation dispatched between the graph replays (~5-10 us each on an H200).
This counts those operations on the cpu backend with ``graphs = "on"``, whose eager graph
runner replays by rerunning the captured functions: counting pauses inside them
(:class:`polyspec.testing.op_count.RoundOpCounter`). Op counts do not depend on the CPU's load,
so unlike timings they are evidence on a shared machine.

Two tiny models (fp32), each for every batch size:

- ``random``: a random Llama target with a random EAGLE-3 head (``bench_target_size``'s
  builder): the head's guesses almost never match, so a round emits one token, as in
  ``bench_target_size``'s runs;
- ``accepting``: a target made close to a bigram model with an EAGLE-1 head that computes
  that bigram (:func:`polyspec.testing.builders.build_bigram_models`), so rounds accept 1 to
  S+1 tokens and the accepted paths of topk > 1 trees get compacted.

Each run does one warm-up generate (captures its graphs), then a counted one; only rounds with
the whole batch decoding are averaged. Prints one table per model and batch size: mean ops /
kernels / uploads / host reads / replays per round in each phase.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_target_size import Preset, build_models  # noqa: E402

from polyspec.config import SamplingParams, SpeculativeConfig  # noqa: E402
from polyspec.engine.llm import LLM  # noqa: E402
from polyspec.model.config import ModelConfig  # noqa: E402
from polyspec.plugins import create_backend  # noqa: E402
from polyspec.testing.builders import build_bigram_models  # noqa: E402
from polyspec.testing.op_count import FIELDS, RoundOpCounter  # noqa: E402

PHASES = ("draft", "verify", "accept", "draft_extend", "other", "total")

TINY = Preset(
    ModelConfig(
        architecture="llama",
        vocab_size=48,
        hidden_size=64,
        intermediate_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=1024,
        eos_token_ids=(2,),
    ).validate(),
    draft_vocab_size=32,
)


def count(
    model: str,
    batch_size: int,
    spec: SpeculativeConfig,
    prompt_len: int = 32,
    max_new_tokens: int = 24,
    page_size: int = 1,
    seed: int = 0,
) -> dict:
    """Counts per round for one model ("random" / "accepting") and batch size:
    {"per_round": {phase: {field: mean}}, "rounds", "accepted_per_round"} (the mean tokens a
    request gets per round)."""
    backend = create_backend("cpu")
    torch.manual_seed(seed)
    if model == "random":
        target, head = build_models(TINY, backend, torch.float32, seed)
    else:
        target, head = build_bigram_models(backend, TINY.target, seed)
        spec = dataclasses.replace(spec, algorithm="eagle")
    llm = LLM.from_modules(
        target, head, spec, backend=backend, graphs="on", max_batch_size=batch_size,
        max_graph_batch_size=batch_size, max_context=256, page_size=page_size,
    )  # fmt: skip
    g = torch.Generator().manual_seed(seed + 100)
    vocab = TINY.target.vocab_size
    prompts = torch.randint(3, vocab, (batch_size, prompt_len), generator=g).tolist()
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts, sampling_params=params)  # warm-up: captures
    with RoundOpCounter(llm) as counter:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    full = [r for bs, r in counter.rounds if bs == batch_size]
    accepted = [a for o in outs for a in o.stats.accepted_per_round]
    return {
        "model": model,
        "batch_size": batch_size,
        "rounds": len(full),
        "accepted_per_round": sum(accepted) / max(len(accepted), 1),
        "per_round": counter.per_round(batch_size),
    }


def table(result: dict) -> str:
    per = result["per_round"]
    lines = [
        f"{result['model']} model, batch {result['batch_size']}: {result['rounds']} full rounds, "
        f"{result['accepted_per_round']:.2f} tokens per request-round",
        f"{'phase':<13}" + "".join(f"{f:>9}" for f in FIELDS),
    ]
    for phase in PHASES:
        if phase in per:
            lines.append(f"{phase:<13}" + "".join(f"{per[phase][f]:>9.1f}" for f in FIELDS))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="1,16", help="comma-separated (default 1,16)")
    ap.add_argument("--num-steps", type=int, default=3)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--num-draft-tokens", type=int, default=6)
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--models", default="random,accepting", help="random and/or accepting")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    spec = SpeculativeConfig(
        algorithm="eagle3",
        num_steps=args.num_steps,
        topk=args.topk,
        num_draft_tokens=args.num_draft_tokens,
    )
    print(
        f"ops per decode round outside graph replays (cpu backend, graphs on): "
        f"S{spec.num_steps} K{spec.topk} N{spec.num_draft_tokens}, page size {args.page_size}"
    )
    results = []
    for model in args.models.split(","):
        for bs in (int(b) for b in args.batch_sizes.split(",")):
            r = count(model, bs, spec, max_new_tokens=args.max_new_tokens, page_size=args.page_size)
            results.append(r)
            print()
            print(table(r))
    if args.json is not None:
        settings = dataclasses.asdict(spec) | {"page_size": args.page_size}
        args.json.write_text(json.dumps({"settings": settings, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
