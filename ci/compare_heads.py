"""Mean acceptance length of one or more draft heads on the same four prompt sets.

The sets: ten MT-bench first turns (every 8th question), ten AlpacaEval instructions the
shipped heads trained on (every 80th of the first 805 training prompts), ten GSM8K questions
they did not see (training prompts 5000-5009), and ten prompts the target writes itself with a
seed the training run did not use. Greedy, batch 1, on the backend and dtype given.

    python ci/compare_heads.py core/heads/smollm2-135m-eagle3 /path/to/other-head \
        --num-steps 3 --topk 1 --num-draft-tokens 4
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from polyspec.config import SamplingParams, SpeculativeConfig
from polyspec.engine.llm import LLM
from polyspec.train.self_prompts import generate_self_prompts

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def prompt_sets(base: LLM, data: Path, self_prompt_seed: int) -> dict[str, list[str]]:
    """The four prompt sets, ten prompts each."""
    mt_file = data / "eval" / "mt_bench.jsonl"
    train_file = data / "prompts" / "train.jsonl"
    for f in (mt_file, train_file):
        if not f.is_file():
            raise SystemExit(f"compare_heads: {f} not found; pass --data DIR (../shared/data)")
    mt = [json.loads(line)["turns"][0] for line in mt_file.open()][::8][:10]
    train = [json.loads(line)["prompt"] for line in train_file.open()]
    with tempfile.TemporaryDirectory() as tmp:
        written = generate_self_prompts(
            base, 14, Path(tmp) / "self_prompts.jsonl", 14, seed=self_prompt_seed
        )
    return {
        "mt_bench": mt,
        "alpaca_eval(trained on)": train[:805][::80][:10],
        "gsm8k(held out)": train[5000:5010],
        f"target-written seed {self_prompt_seed}(held out)": written[:10],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("heads", nargs="+", help="draft head directories")
    ap.add_argument("--num-steps", type=int, default=3)
    ap.add_argument("--topk", type=int, default=1)
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--self-prompt-seed", type=int, default=99)
    ap.add_argument("--data", type=Path, default=SHARED)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    base = LLM(dtype=args.dtype, backend=args.backend, max_batch_size=1)
    sets = prompt_sets(base, args.data, args.self_prompt_seed)
    del base
    spec = SpeculativeConfig(
        algorithm="eagle3",
        num_steps=args.num_steps,
        topk=args.topk,
        num_draft_tokens=args.num_draft_tokens,
    )
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    print("head\tprompts\tmean_acceptance_length\trounds")
    for head in args.heads:
        llm = LLM(
            draft=head, speculative=spec, dtype=args.dtype, backend=args.backend, max_batch_size=1
        )
        for name, prompts in sets.items():
            accepted: list[int] = []
            for prompt in prompts:
                accepted += llm.chat(prompt, params)[0].stats.accepted_per_round
            mean = sum(accepted) / len(accepted)
            print(f"{head}\t{name}\t{mean:.2f}\t{len(accepted)}", flush=True)


if __name__ == "__main__":
    main()
