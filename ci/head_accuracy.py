"""Teacher-forced accuracy and simulated chain acceptance of EAGLE-3 heads on MT-bench.

The target answers every MT-bench first turn greedily once (plain decoding); each head then
reads those texts through the training head (``Eagle3Trainable``, the TTT unroll), which gives
for every position the token each draft step would propose if all earlier steps were right.
From that: the per-step top-1 accuracy, the share of answer tokens outside the head's draft
vocabulary, and the mean acceptance length a chain of S draft tokens (topk 1) reaches when it
walks the text round by round, exactly as the engine's greedy verify does (on the real model
this matched the engine's own per-round acceptance, 88 of 88 rounds on one prompt, in fp32).
All 80 questions are scored in one pass, so two heads are compared on ~10k tokens, not on a few
hundred rounds.

    python ci/head_accuracy.py core/heads/smollm2-135m-eagle3 /path/to/other-head
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from polyspec.config import SamplingParams
from polyspec.engine.llm import LLM
from polyspec.model.loader import default_aux_layers
from polyspec.train.features import extract_features
from polyspec.train.head import Eagle3Trainable
from polyspec.train.warm_start import load_trained_head

MT_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval" / "mt_bench.jsonl"


def target_answers(rows: list[dict], max_new_tokens: int):
    """(the fp32 cpu LLM, [(prompt + answer ids, prompt length)]): the default target's greedy
    answers to each row's first turn."""
    llm = LLM(dtype="float32", backend="cpu", max_batch_size=16)
    outs = llm.chat([r["turns"][0] for r in rows], SamplingParams(max_new_tokens=max_new_tokens))
    return llm, [(list(o.prompt_token_ids) + list(o.token_ids), len(o.prompt_token_ids))
                 for o in outs]  # fmt: skip


def chain_acceptance(preds: list[torch.Tensor], ids: torch.Tensor, start: int, depth: int):
    """Accepted tokens per round (bonus included) of a ``depth``-token chain over ``ids``.
    ``preds[j][p]``: step j's token at position p, a guess for ``ids[p + 2]``; the first round
    drafts after the prompt's last position ``start``."""
    rounds, c, end = [], start, len(ids)
    while c + 2 < end:
        n = 0
        while n < depth and c + n + 2 < end and preds[n][c + n] == ids[c + n + 2]:
            n += 1
        rounds.append(n + 1)
        c += n + 1
    return rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("heads", nargs="+", help="EAGLE-3 head directories")
    ap.add_argument("--dataset", type=Path, default=MT_BENCH, help="MT-bench JSONL (turns)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--depths", default="3,6", help="chain lengths S to simulate")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--by-category", action="store_true", help="also print chain S per MT-bench category"
    )
    args = ap.parse_args()
    if not args.dataset.is_file():
        raise SystemExit(f"head_accuracy: {args.dataset} not found; pass --dataset FILE.jsonl")
    torch.set_num_threads(args.threads)
    depths = [int(d) for d in args.depths.split(",")]
    steps = max(depths)

    rows = [json.loads(line) for line in args.dataset.open()]
    categories = [r.get("category", "all") for r in rows]
    llm, seqs = target_answers(rows, args.max_new_tokens)
    outs_tokens = sum(len(s) - n for s, n in seqs)
    target = llm.target
    aux = default_aux_layers(target.config.num_layers)
    feats = extract_features(target, llm.backend, seqs, aux, store_dtype=torch.float32)
    print(f"{len(seqs)} answers, {outs_tokens} tokens, fp32, cpu")
    print("head\tdraft vocab\tanswer tokens outside it\taccuracy per step\t"
          + "\t".join(f"chain S={d}" for d in depths))  # fmt: skip
    for head_dir in args.heads:
        state, draft_ids = load_trained_head(head_dir, target.config, aux)
        head = Eagle3Trainable(target.config, draft_ids.numel(), max(len(s) for s, _ in seqs) + 1)
        head.load_state_dict(state)
        head.eval()
        in_vocab = torch.zeros(target.config.vocab_size, dtype=torch.bool)
        in_vocab[draft_ids] = True
        hits, seen, oov, n_answer = [0] * steps, [0] * steps, 0, 0
        rounds: dict[int, list[int]] = {d: [] for d in depths}
        by_cat: dict[str, list[int]] = {}
        for f, cat in zip(feats, categories):
            ids, first = f.ids, f.prompt_len - 1
            nxt = torch.cat([ids[1:], ids[:1]])  # token p + 1 at position p (last: unused)
            with torch.no_grad():
                logits = head(f.aux[None].float(), target.embed(nxt[None]).float(), steps)
            preds = [draft_ids[lg[0].argmax(-1)] for lg in logits]
            for j, p in enumerate(preds):  # step j first drafts at position first + j
                ok = p[first + j : len(ids) - 2] == ids[first + j + 2 :]
                hits[j] += int(ok.sum())
                seen[j] += ok.numel()
            oov += int((~in_vocab[ids[f.prompt_len :]]).sum())
            n_answer += len(ids) - f.prompt_len
            for d in depths:
                rounds[d] += chain_acceptance(preds, ids, first, d)
            by_cat.setdefault(cat, []).extend(chain_acceptance(preds, ids, first, depths[0]))
        accs = ", ".join(f"{h / max(s, 1):.3f}" for h, s in zip(hits, seen))
        chains = "\t".join(f"{sum(r) / len(r):.3f}" for r in rounds.values())
        print(
            f"{head_dir}\t{draft_ids.numel()}\t{oov / n_answer:.1%}\t{accs}\t{chains}", flush=True
        )
        if args.by_category:
            for cat, r in by_cat.items():
                print(f"  {cat}\tchain S={depths[0]} {sum(r) / len(r):.3f} over {len(r)} rounds")


if __name__ == "__main__":
    main()
