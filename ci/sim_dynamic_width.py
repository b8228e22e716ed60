"""Would a verify width chosen per round pay on this machine? (docs/benchmarks.md)

Where an extra verify row is expensive (2-core AVX2 CPUs: a third row costs ~30 % of a decode
step), a round could verify its deeper draft tokens only when the draft is sure of them:
verify levels 1..L of a chain, L = the number of levels whose draft path probability
q1 * ... * qj is at least a threshold, and run draft step j only when level j passed. This
script measures what that would give before anyone builds it:

1. runs the shipped head as a deep chain (S=4 K=1 N=5, bf16, greedy, batch 1) over MT-bench
   first turns, recording each round's draft probabilities (q1..q4, from the head's top-1) and
   how many draft tokens the target accepted (a chain accepts a prefix, so a round that had
   verified only L levels would have accepted min(a, L));
2. times the target over 1..5 tokens and the draft over 1..5 tokens on this machine (the
   engine's own ``tree_choice.measure_costs``);
3. replays the recorded rounds under fixed widths and under thresholds, and prints tokens per
   round and the predicted speed-up over plain decoding: acceptance x target(1) / (target(L+1)
   + draft steps x draft(1) + draft(accepted + 1) + host).

    python ci/sim_dynamic_width.py [--prompts 10] [--max-new-tokens 128] [--host-ms 1.3]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from polyspec.bench.datasets import load_dataset
from polyspec.config import SamplingParams, SpeculativeConfig, TreeCandidate
from polyspec.defaults import shipped_head_path
from polyspec.engine import tree_choice
from polyspec.engine.llm import LLM
from polyspec.model.eagle import DraftHead

DEPTH = 4
THRESHOLDS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def record_rounds(llm: LLM, prompts: list[str], max_new_tokens: int) -> list[dict]:
    """Each round's draft probabilities [q1..qS] and accepted draft count (no bonus)."""
    seen: list[float] = []
    topk = DraftHead.topk

    def recording_topk(self, logit_hidden, k):
        p, i = topk(self, logit_hidden, k)
        seen.append(float(p[-1, 0]))  # batch 1: the last row is the one the tree grows from
        return p, i

    rounds = []
    DraftHead.topk = recording_topk
    try:
        for prompt in prompts:
            seen.clear()
            out = llm.chat([prompt], SamplingParams(max_new_tokens=max_new_tokens))[0]
            committed = out.stats.accepted_per_round  # accepted + bonus, per round
            # the prefill's top-k, then per round S - 1 draft steps and one draft extend
            if len(seen) != 1 + DEPTH * len(committed):
                raise RuntimeError(
                    f"expected {1 + DEPTH * len(committed)} top-k calls, saw {len(seen)}"
                )
            for r, c in enumerate(committed):
                q = [seen[r * DEPTH]] + seen[r * DEPTH + 1 : r * DEPTH + DEPTH]
                rounds.append({"q": q, "accepted": c - 1})
    finally:
        DraftHead.topk = topk
    return rounds


def replay(rounds, target_ms, draft_ms, host_ms, policy) -> tuple[float, float]:
    """(tokens per round, predicted speed-up over plain) of ``policy(path_probs) -> (L, steps)``."""
    tokens = total_ms = 0.0
    for r in rounds:
        path, p = [], 1.0
        for q in r["q"]:
            p *= q
            path.append(p)
        levels, steps = policy(path)
        got = min(r["accepted"], levels)
        tokens += got + 1
        total_ms += target_ms[levels + 1] + steps * draft_ms[1] + draft_ms[got + 1] + host_ms
    return tokens / len(rounds), tokens / total_ms * target_ms[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--host-ms", type=float, default=1.3, help="host work per round (profile)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    chain = SpeculativeConfig(
        algorithm="eagle3", num_steps=DEPTH, topk=1, num_draft_tokens=DEPTH + 1
    )
    llm = LLM(
        backend="cpu", dtype="bfloat16", max_batch_size=1, max_context=1024,
        draft=shipped_head_path(), speculative=chain,
    )  # fmt: skip
    _, prompts = load_dataset("mt_bench", args.prompts)
    rounds = record_rounds(llm, prompts, args.max_new_tokens)
    mean = statistics.mean(r["accepted"] for r in rounds) + 1
    print(f"{len(rounds)} rounds of S={DEPTH} K=1 N={DEPTH + 1}, {mean:.2f} tokens per round")

    cands = [TreeCandidate(s, 1, s + 1, 1.0) for s in range(1, DEPTH + 1)]
    costs = tree_choice.measure_costs(llm.worker, cands)
    target_ms = {w: s * 1e3 for w, s in costs.target_s.items()}
    draft_ms = {w: s * 1e3 for w, s in costs.draft_s.items()}
    print("target ms by width:", {w: round(t, 2) for w, t in target_ms.items()})
    print("draft ms by width: ", {w: round(t, 2) for w, t in draft_ms.items()})

    print("\nfirst draft's probability -> rounds, share whose first draft was accepted:")
    bins: dict[int, list[int]] = {}
    for r in rounds:
        b = bins.setdefault(min(int(r["q"][0] * 10), 9), [0, 0])
        b[0] += 1
        b[1] += r["accepted"] >= 1
    for b, (n, hit) in sorted(bins.items()):
        print(f"  [{b / 10:.1f}, {(b + 1) / 10:.1f}): {n} rounds, {hit / n:.0%} accepted")

    print("\n| policy | tokens / round | predicted vs plain |\n|---|---|---|")
    for levels in range(1, DEPTH + 1):
        acc, speed = replay(
            rounds, target_ms, draft_ms, args.host_ms, lambda _, v=levels: (v, v - 1)
        )
        print(f"| fixed: S={levels} K=1 N={levels + 1} | {acc:.2f} | {speed:.3f}x |")
    for tau in THRESHOLDS:

        def by_threshold(path, tau=tau):
            passed = sum(1 for p in path if p >= tau)
            return max(passed, 1), sum(1 for p in path[: DEPTH - 1] if p >= tau)

        acc, speed = replay(rounds, target_ms, draft_ms, args.host_ms, by_threshold)
        print(f"| path probability >= {tau:.1f} (at least 1 level) | {acc:.2f} | {speed:.3f}x |")


if __name__ == "__main__":
    main()
