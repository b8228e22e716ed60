"""Throughput of batched plain generation, the way ``polyspec train-draft`` writes answers.

A random SmolLM2-135M-shaped target (no model file needed), ``--requests`` prompts of 40-200
random tokens, each with its own answer length drawn from 32..``--max-new-tokens`` (EOS
ignored), run through ``LLM.generate`` at ``--batch-size`` concurrent requests. Prints answer
tokens per second, so the settings of the data-generation step (graphs, kernel mode, batch
size) are chosen by measurement:

    python ci/probe_gen_throughput.py --backend cuda --graphs auto --batch-size 256
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_target_size import PRESETS, build_models  # noqa: E402

from polyspec.config import SamplingParams  # noqa: E402
from polyspec.engine.llm import LLM  # noqa: E402
from polyspec.plugins import create_backend  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=384)
    ap.add_argument("--graphs", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    backend = create_backend(args.backend)
    target, _ = build_models(PRESETS["smollm2-135m"], backend, getattr(torch, args.dtype))
    g = torch.Generator().manual_seed(args.seed)
    vocab = target.config.vocab_size
    lens = torch.randint(40, 201, (args.requests,), generator=g).tolist()
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]
    news = torch.randint(32, args.max_new_tokens + 1, (args.requests,), generator=g).tolist()
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in news]
    llm = LLM.from_modules(target, backend=backend, max_batch_size=args.batch_size,
                           max_context=4096, graphs=args.graphs,
                           max_graph_batch_size=args.batch_size)  # fmt: skip
    llm.generate(prompt_token_ids=prompts[:8], sampling_params=params[:8])  # warm-up
    backend.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    backend.synchronize()
    dt = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    print(f"{args.backend} graphs={args.graphs} bs={args.batch_size}: {len(outs)} answers, "
          f"{n} tokens in {dt:.1f} s = {n / dt:.0f} tok/s")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
