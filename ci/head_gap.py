"""Where a head's MT-bench agreement falls short of its agreement on its own kind of text.

Step-0 agreement (the head's first draft token equals the target's greedy token) on the
target's greedy answers to the 80 MT-bench first turns and on ``--num`` answers of a
``polyspec train-draft`` run (its ``OUT/answers.jsonl``, first ``--max-new-tokens`` answer
tokens; ``--skip`` leaves out the file prompts' answers), split by the target's own top-1
probability, by whether the token also occurs in the prompt, and by answer position. If the
head fell short only where the target is unsure, the gap would be the text's; at equal target
confidence it is the head's.

    python ci/head_gap.py core/heads/smollm2-135m-eagle3 --answers OUT/answers.jsonl[.xz]
"""

from __future__ import annotations

import argparse
import json
import lzma
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from head_accuracy import MT_BENCH, target_answers  # noqa: E402

from polyspec.model.loader import default_aux_layers  # noqa: E402
from polyspec.train.features import extract_features  # noqa: E402
from polyspec.train.head import Eagle3Trainable  # noqa: E402
from polyspec.train.warm_start import load_trained_head  # noqa: E402

EDGES = (0.0, 0.3, 0.5, 0.7, 0.9, 0.99, 1.01)


def step0(head, target, draft_ids, feats):
    """Per answer position: (agreement, target top-1 prob, token also in the prompt, position)."""
    cols = [[], [], [], []]
    for f in feats:
        ids, first = f.ids, f.prompt_len - 1
        nxt = torch.cat([ids[1:], ids[:1]])  # token p + 1 at position p
        with torch.no_grad():
            logits = head(f.aux[None].float(), target.embed(nxt[None]).float(), 1)[0][0]
            # the target's distribution for token p + 2 comes from its hidden state at p + 1
            p_max = torch.softmax(f.hidden[1:].float() @ target.lm_head_weight.float().T, -1)
        tok = ids[first + 2 :]
        cols[0].append(draft_ids[logits.argmax(-1)][first : len(ids) - 2] == tok)
        cols[1].append(p_max[first : len(ids) - 2].max(-1).values)
        in_prompt = set(ids[: f.prompt_len].tolist())
        # ids below 300 are bytes, digits and punctuation: shared by nearly every prompt
        cols[2].append(torch.tensor([t in in_prompt and t >= 300 for t in tok.tolist()]))
        cols[3].append(torch.arange(len(tok)))
    return [torch.cat(c) for c in cols]


def report(name, ok, p_max, copied, pos) -> None:
    ok = ok.float()
    print(f"{name}: {len(ok)} positions, step-0 agreement {ok.mean():.3f}, "
          f"target top-1 probability {p_max.mean():.3f}")  # fmt: skip
    print(f"  token also in the prompt: share {copied.float().mean():.3f}, agreement "
          f"{ok[copied].mean():.3f} (others {ok[~copied].mean():.3f})")  # fmt: skip
    for lo, hi in ((0, 16), (16, 48), (48, 10**6)):
        m = (pos >= lo) & (pos < hi)
        print(f"  answer positions {lo}..{hi - 1 if hi < 10**6 else 'end'}: agreement "
              f"{ok[m].mean():.3f}")  # fmt: skip
    for lo, hi in zip(EDGES, EDGES[1:]):
        m = (p_max >= lo) & (p_max < hi)
        print(f"  target top-1 in [{lo:.2f}, {min(hi, 1.0):.2f}{')' if hi < 1 else ']'}: "
              f"share {m.float().mean():.3f}, agreement {ok[m].mean():.3f}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("head", help="EAGLE-3 head directory")
    ap.add_argument("--answers", type=Path, required=True, help="train-draft's answers.jsonl[.xz]")
    ap.add_argument("--num", type=int, default=80)
    ap.add_argument("--skip", type=int, default=1400, help="answers to leave out first")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dataset", type=Path, default=MT_BENCH)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    for path in (args.answers, args.dataset):
        if not path.is_file():
            raise SystemExit(f"head_gap: {path} not found")
    torch.set_num_threads(args.threads)
    opener = lzma.open if args.answers.suffix == ".xz" else open
    with opener(args.answers, "rt") as fh:
        answers = [json.loads(line) for line in fh][args.skip :]
    random.seed(0)
    picked = random.sample(answers, min(args.num, len(answers)))
    own = [(a["prompt_ids"] + a["answer_ids"][: args.max_new_tokens], len(a["prompt_ids"]))
           for a in picked]  # fmt: skip
    rows = [json.loads(line) for line in args.dataset.open()]
    llm, mt = target_answers(rows, args.max_new_tokens)
    target = llm.target
    aux = default_aux_layers(target.config.num_layers)
    state, draft_ids = load_trained_head(args.head, target.config, aux)
    for name, seqs in (("MT-bench answers", mt), (f"{args.answers.name}", own)):
        feats = extract_features(target, llm.backend, seqs, aux, store_dtype=torch.float32)
        head = Eagle3Trainable(target.config, draft_ids.numel(), max(len(s) for s, _ in seqs) + 1)
        head.load_state_dict(state)
        head.eval()
        report(name, *step0(head, target, draft_ids, feats))


if __name__ == "__main__":
    main()
