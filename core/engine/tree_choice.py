"""Choosing the draft tree for the machine at hand (``SpeculativeConfig.tree_candidates``).

A tree's speed is its acceptance (tokens per round, measured once per head on a reference
workload and shipped in its ``polyspec.json``) over the cost of its round, and that cost
depends on the machine: on an H200 a verify over 8 tokens costs about one decode step, on a
2-core CPU without AVX-512 it costs nearly three. So the engine times, once at start-up, the
forwards a round is made of, at every candidate's widths:

- the target over ``w`` new tokens after a chat-sized prefix (logits of every row): ``w = 1`` is
  a plain decode step, ``w = N`` a verify;
- the draft over ``w`` tokens (forward and top-k): ``w = K`` for each of the ``S - 1`` draft
  steps, ``w = S + 1`` for the draft extend.

Predicted round time = target(N) + (S - 1) draft(K) + draft(S + 1); predicted speed-up over
plain decoding = acceptance x target(1) / round time. The candidate with the largest wins.
Each width is timed a few times, interleaved, and the minimum kept: the run least disturbed by
other work on a shared host. A wider forward does strictly more work than a narrower one, so a
narrower width whose best time is still above a wider one's was disturbed in every run: it is
timed again (a few more times at most), and what stays out of order is capped at the wider
width's time. (On a noisy 2-core host one such outlier, a 2-token verify timed like a 3-token
one, made the engine pick S=2 K=1 N=3: 1.08x plain, where runs with S=1 K=1 N=2 gave
1.22-1.34x.) The prediction leaves out the tree kernels and host work between forwards (the
same order for every candidate), so it ranks trees; it is not a benchmark.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence

import torch

from polyspec.config import TreeCandidate

PREFIX_LEN = 192
"""Tokens already in the KV cache when the forwards are timed: a chat turn's context, since
attention over it is part of what an extra verify row costs (on the 2-core AVX2 CPU a 3-token
forward cost 1.18 one-token forwards after 64 tokens and 1.37 after 192)."""


@dataclasses.dataclass(frozen=True)
class ForwardCosts:
    """Seconds per forward by token width, measured on this machine."""

    target_s: Mapping[int, float]  # width -> seconds (target forward + logits of every row)
    draft_s: Mapping[int, float]  # width -> seconds (draft forward + top-k)

    def round_s(self, c: TreeCandidate) -> float:
        """The predicted time of one speculative round with tree ``c``."""
        draft = (c.num_steps - 1) * self.draft_s[c.topk] + self.draft_s[c.num_steps + 1]
        return self.target_s[c.num_draft_tokens] + draft

    def speedup(self, c: TreeCandidate) -> float:
        """Predicted tokens per second of tree ``c`` over plain decoding."""
        return c.acceptance * self.target_s[1] / self.round_s(c)


def widths(candidates: Sequence[TreeCandidate]) -> tuple[list[int], list[int]]:
    """The target widths (1 and every N) and draft widths (every K and S + 1) to time."""
    target = sorted({1} | {c.num_draft_tokens for c in candidates})
    draft = sorted({c.topk for c in candidates} | {c.num_steps + 1 for c in candidates})
    return target, draft


def monotone(best: Mapping[int, float]) -> dict[int, float]:
    """Each width's time capped at the smallest time of any wider width."""
    out, floor = {}, float("inf")
    for w in sorted(best, reverse=True):
        floor = min(floor, best[w])
        out[w] = floor
    return dict(sorted(out.items()))


def disturbed(best: Mapping[int, float]) -> list[int]:
    """The widths whose time is above that of some wider width (ascending)."""
    capped = monotone(best)
    return [w for w in capped if best[w] > capped[w]]


def measure_costs(
    worker, candidates: Sequence[TreeCandidate], repeats: int = 5, retries: int = 4
) -> ForwardCosts:
    """Time the forwards of ``candidates``' rounds on ``worker`` (an EAGLE worker with no
    requests, whose KV cache holds :data:`PREFIX_LEN` plus the widest forward for one request):
    the best of ``repeats`` interleaved runs per width, then up to ``retries`` more runs of the
    widths still timed above a wider one (:func:`disturbed`), then :func:`monotone`.
    Uses one request row, released before returning."""
    target_w, draft_w = widths(candidates)
    longest = max(target_w + draft_w)
    vocab = worker.target.config.vocab_size
    ids = [(17 * i + 3) % vocab for i in range(PREFIX_LEN + longest)]
    row = worker.kv.add_request(PREFIX_LEN + longest + worker.page_size)
    try:
        worker.kv.ensure([row], [PREFIX_LEN + longest])
        prefix = ids[:PREFIX_LEN]
        hidden, aux = worker._extend(worker.target_runner, [row], [0], [PREFIX_LEN], prefix)
        features = aux if worker.use_aux else hidden  # [PREFIX_LEN, F]

        def target(w: int) -> None:
            h, _ = worker._extend(worker.target_runner, [row], [PREFIX_LEN], [w], ids[:w])
            worker.target.compute_logits(h)

        def draft(w: int) -> None:
            lh, _ = worker._extend(
                worker.draft_runner, [row], [PREFIX_LEN], [w], ids[:w], features[:w]
            )
            worker.draft.topk(lh, worker.topk)

        def time_once(run, w: int) -> float:
            worker.backend.synchronize()
            t = time.perf_counter()
            run(w)
            worker.backend.synchronize()
            return time.perf_counter() - t

        best_t = dict.fromkeys(target_w, float("inf"))
        best_d = dict.fromkeys(draft_w, float("inf"))
        kinds = ((best_t, target), (best_d, draft))
        with torch.inference_mode():
            for rep in range(repeats + 1):  # the first pass warms up and is not kept
                for best, run in kinds:
                    for w in best:
                        t = time_once(run, w)
                        if rep > 0:
                            best[w] = min(best[w], t)
            for _ in range(retries):  # out of order: disturbed in every run so far
                again = [(best, run, disturbed(best)) for best, run in kinds]
                if not any(ws for _, _, ws in again):
                    break
                for best, run, ws in again:
                    for w in ws:
                        best[w] = min(best[w], time_once(run, w))
    finally:
        worker.kv.remove_request(row)
    return ForwardCosts(monotone(best_t), monotone(best_d))


def choose_tree(candidates: Sequence[TreeCandidate], costs: ForwardCosts) -> TreeCandidate:
    """The candidate with the largest predicted speed-up (the first of equals)."""
    return max(candidates, key=costs.speedup)


def report(candidates: Sequence[TreeCandidate], costs: ForwardCosts, chosen: TreeCandidate):
    """A JSON-ready record of the choice: costs in ms, each candidate's prediction."""
    return {
        "chosen": chosen.label,
        "target_ms": {str(w): round(s * 1e3, 3) for w, s in costs.target_s.items()},
        "draft_ms": {str(w): round(s * 1e3, 3) for w, s in costs.draft_s.items()},
        "predicted_speedup": {c.label: round(costs.speedup(c), 3) for c in candidates},
    }


def tree_note(choice: Mapping) -> str:
    """One line for the user about :func:`report`'s choice (or why none was made)."""
    if "reason" in choice:
        return f"draft tree {choice['chosen']} ({choice['reason']})"
    predicted = choice["predicted_speedup"]
    return (
        f"draft tree {choice['chosen']}, chosen for this machine from {len(predicted)} "
        f"candidates by timing their forwards (predicted {predicted[choice['chosen']]:.2f}x "
        f"plain decoding; set num_steps / topk / num_draft_tokens to choose yourself)"
    )
