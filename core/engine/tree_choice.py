"""Choosing the draft tree for the machine at hand (``SpeculativeConfig.tree_candidates``).

Two ways, by how the rounds run. Where they run eagerly (the cpu backend), the engine times
the forwards a round is made of at batch 1 and keeps one tree for every batch size (below).
Where they replay captured graphs, it times whole rounds (of the head's recommended trees and
the candidates that accept clearly more, :func:`deeper`) at a few batch sizes and picks a tree,
or plain rounds, per batch size (:func:`time_rounds`, :func:`batch_schedule`, further down).

Eager rounds:

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


FINALISTS = 3
"""Where rounds run eagerly, the candidates of the largest predicted speed-ups whose whole
rounds are then timed (:func:`time_rounds` at batch 1, with a plain round) to choose among
them: the prediction leaves out each draft level's top-K selection and the host's work
between forwards, which a whole round includes. On a 2-core AMD EPYC it predicted 1.94x and
1.91x for S=4 K=3 N=10 and S=3 K=3 N=8, whose timed rounds gave 1.76x and 1.71x a timed plain
round, and MT-bench end to end 1.53-1.66x (docs/benchmarks.md)."""


def finalists(candidates: Sequence[TreeCandidate], costs: ForwardCosts) -> list[TreeCandidate]:
    """The :data:`FINALISTS` candidates of the largest predicted speed-ups, best first."""
    return sorted(candidates, key=costs.speedup, reverse=True)[:FINALISTS]


def choose_timed(
    candidates: Sequence[TreeCandidate], round_s: Mapping[str, float]
) -> TreeCandidate | None:
    """Of ``candidates`` whose rounds were timed (``round_s``: label -> seconds), the one of
    the most tokens per second (acceptance over its round's time; the first of equals), or
    None where none was timed."""
    timed = [c for c in candidates if c.label in round_s]
    return max(timed, key=lambda c: tokens_per_s(c, 1, round_s[c.label]), default=None)


def report(
    candidates: Sequence[TreeCandidate],
    costs: ForwardCosts,
    chosen: TreeCandidate,
    round_s: Mapping[str, float] | None = None,
):
    """A JSON-ready record of the choice: costs in ms, each candidate's prediction, and the
    finalists' timed rounds (``round_s``, label -> seconds, ``plain`` for a plain round) with
    their measured speed-up over plain rounds."""
    out = {
        "chosen": chosen.label,
        "target_ms": {str(w): round(s * 1e3, 3) for w, s in costs.target_s.items()},
        "draft_ms": {str(w): round(s * 1e3, 3) for w, s in costs.draft_s.items()},
        "predicted_speedup": {c.label: round(costs.speedup(c), 3) for c in candidates},
    }
    if round_s and "plain" in round_s:
        by_label = {c.label: c for c in candidates}
        out["round_ms"] = {label: round(t * 1e3, 3) for label, t in round_s.items()}
        plain = tokens_per_s(None, 1, round_s["plain"])
        out["measured_speedup"] = {
            label: round(tokens_per_s(by_label[label], 1, t) / plain, 3)
            for label, t in round_s.items()
            if label in by_label
        }
    return out


def tree_note(choice: Mapping) -> str:
    """One line for the user about :func:`report`'s choice (or why none was made)."""
    if "reason" in choice:
        return f"draft tree {choice['chosen']} ({choice['reason']})"
    if "by_batch_size" in choice:
        sizes = ", ".join(str(b) for b in choice["timed_batch_sizes"])
        trees = len(choice["round_ms"][str(choice["timed_batch_sizes"][0])]) - 1
        stopped = f"; timing stopped early: {choice['stopped']}" if choice["stopped"] else ""
        return (
            f"draft trees by batch size {choice['chosen']}, chosen for this machine by timing "
            f"the rounds of {trees} tree{'s' * (trees != 1)} and plain rounds at batch {sizes} "
            f"({choice['timing_s']:g} s{stopped}; set num_steps / topk / num_draft_tokens / "
            f"batch_trees to choose yourself)"
        )
    predicted = choice["predicted_speedup"]
    measured = choice.get("measured_speedup", {})
    if choice["chosen"] in measured:
        timed = len(measured)
        return (
            f"draft tree {choice['chosen']}, chosen for this machine from {len(predicted)} "
            f"candidates by timing their forwards, then the rounds of the {timed} predicted "
            f"fastest ({measured[choice['chosen']]:.2f}x plain rounds; set num_steps / topk / "
            f"num_draft_tokens to choose yourself)"
        )
    return (
        f"draft tree {choice['chosen']}, chosen for this machine from {len(predicted)} "
        f"candidates by timing their forwards (predicted {predicted[choice['chosen']]:.2f}x "
        f"plain decoding; set num_steps / topk / num_draft_tokens to choose yourself)"
    )


# -- trees by batch size, from timed rounds (rounds replayed from captured graphs) ------------
#
# Where the rounds replay captured graphs, a forward timed eagerly does not tell what it costs
# inside a graph, and what a round costs depends on the batch: the tree whose extra verify
# tokens are nearly free at batch 1 fills the device at batch 64. So the engine times whole
# rounds, each tree's and a plain round's, through the real worker (captured like any round,
# and queued behind the last where the engine overlaps rounds) at a few batch sizes, and
# predicts each one's tokens per second as acceptance x bs / round time (a plain round:
# 1 x bs / its time). Between two timed batch sizes a round's time is interpolated linearly;
# above the largest, the last timed size's choice holds. A tree must beat plain rounds by a
# margin (:data:`SPEC_MARGIN`).

ROUND_BUDGET_S = 20.0
"""Seconds the start-up timing of the head's recommended trees and plain rounds may take
(each option's round is captured before it is timed, at every batch size); batch sizes left
untimed when they are spent keep the head's trees for them."""

DEEPER_BUDGET_S = 15.0
"""Seconds the start-up timing of the :func:`deeper` candidates may take, after the
recommended trees and plain rounds have been timed at every batch size in
:data:`ROUND_BUDGET_S`: however many deeper candidates a head lists, every batch size gets
its choice timed (on an H100 one tree's capture and timing at batch 1 takes about 3 s, and
the shipped head's four deeper trees alone would take the whole 20 s)."""

PRUNE_MARGIN = 0.03
"""A tree is timed at the next batch size unless some option with no more work per round
(:func:`round_work`) was predicted faster by more than this fraction: a round's time grows with
its work as the batch grows, so a tree that loses to a lighter one keeps losing."""


SPEC_MARGIN = 0.10
"""A tree replaces plain rounds at a batch size only where its predicted tokens/s is above
plain rounds' by more than this fraction. The prediction takes the head's mean acceptance,
but a batch whose requests start together lasts as long as its slowest-accepting ones take:
on an H100 at batch 64 (MT-bench, 128 new tokens), rounds that switched to a tree below the
size where the prediction crossed plain's ran 0.81x plain (docs/benchmarks.md, "Batch
64-256"); at batch 32 the tree ran 1.18x. A thin predicted gain is not worth that risk."""


DEEPER_MARGIN = 0.05
"""Besides the head's recommended trees, the start-up timing of rounds takes the candidates
that accept more than the best of them by over this fraction (:func:`deeper`)."""


def recommended(
    candidates: Sequence[TreeCandidate], trees: Sequence[tuple[int, int, int, int]]
) -> list[TreeCandidate]:
    """The ``candidates`` among ``trees`` (``SpeculativeConfig.trees``: the head's main tree
    and ``batch_trees``', (min batch size, S, K, N), plain entries left out)."""
    shapes = {(s, k, n) for _, s, k, n in trees if s > 0}
    return [c for c in candidates if (c.num_steps, c.topk, c.num_draft_tokens) in shapes]


def deeper(
    candidates: Sequence[TreeCandidate], recommended: Sequence[TreeCandidate]
) -> list[TreeCandidate]:
    """The ``candidates`` that accept more than every ``recommended`` tree by over
    :data:`DEEPER_MARGIN`. On an accelerator at batch 1 a verify over more tokens costs little
    more than a plain step, so whether such a tree's extra draft steps pay for its tokens
    depends on what a draft step costs on the device, which only timing its rounds tells;
    at the batch sizes where it loses, :func:`still_timed` stops timing it."""
    best = max(c.acceptance for c in recommended)
    return [
        c for c in candidates
        if c not in recommended and c.acceptance > best * (1 + DEEPER_MARGIN)
    ]  # fmt: skip


def option_label(c: TreeCandidate | None) -> str:
    """A candidate's label, or ``plain`` for None (plain rounds)."""
    return "plain" if c is None else c.label


def round_work(c: TreeCandidate | None) -> int:
    """Tokens a round's forwards read per request: the verify's N, the draft's K per step
    after the first and its extend's S + 1 (a plain round: the root)."""
    if c is None:
        return 1
    return c.num_draft_tokens + (c.num_steps - 1) * c.topk + c.num_steps + 1


def tokens_per_s(c: TreeCandidate | None, bs: float, seconds: float) -> float:
    """Predicted tokens per second of rounds of ``c`` (None: plain) at batch ``bs``."""
    return (1.0 if c is None else c.acceptance) * bs / seconds


def still_timed(
    candidates: Sequence[TreeCandidate],
    seconds: Mapping[str, float],
    bs: int,
    rivals: Sequence[TreeCandidate] = (),
) -> list[TreeCandidate]:
    """The candidates worth timing at a larger batch than ``bs``, after ``seconds`` (label ->
    round seconds at ``bs``, "plain" included): those not beaten by more than
    :data:`PRUNE_MARGIN` by an option with no more work per round (plain rounds, another
    candidate or one of ``rivals``, each where ``seconds`` has its time)."""
    options = [None, *candidates, *rivals]
    timed = [o for o in options if option_label(o) in seconds]
    rate = {option_label(o): tokens_per_s(o, bs, seconds[option_label(o)]) for o in timed}
    keep = []
    for c in candidates:
        if option_label(c) not in rate:
            continue
        beaten = any(
            round_work(o) <= round_work(c)
            and rate[option_label(o)] > rate[option_label(c)] * (1 + PRUNE_MARGIN)
            for o in timed
            if o is not c
        )
        if not beaten:
            keep.append(c)
    return keep


def batch_schedule(
    candidates: Sequence[TreeCandidate],
    seconds: Mapping[int, Mapping[str, float]],
    max_batch_size: int,
) -> list[tuple[int, TreeCandidate | None]]:
    """The option of the most predicted tokens/s for every batch size from 1 to
    ``max_batch_size`` (plain rounds unless a tree beats them by more than
    :data:`SPEC_MARGIN`), as (min batch size, candidate or None for plain rounds) entries where
    it changes. ``seconds``: timed batch size -> option label -> round seconds. Between two
    timed sizes an option timed at both has its time interpolated linearly; above the largest,
    that size's times hold (scaled by nothing: its choice). Batch 1 always runs a tree."""
    sizes = sorted(seconds)
    by_label = {option_label(o): o for o in (None, *candidates)}
    out: list[tuple[int, TreeCandidate | None]] = []
    for bs in range(1, max_batch_size + 1):
        lo = max((s for s in sizes if s <= bs), default=sizes[0])
        hi = min((s for s in sizes if s >= bs), default=sizes[-1])
        times = {}
        for label, t_lo in seconds[lo].items():
            if label not in seconds[hi] or label not in by_label:
                continue
            t_hi = seconds[hi][label]
            f = 0.0 if hi == lo else (bs - lo) / (hi - lo)
            times[label] = t_lo + f * (t_hi - t_lo)
        if bs == 1:
            times.pop("plain", None)
        if not times:
            continue
        at = hi if bs > hi else bs  # above the largest timed size: its choice
        rate = {label: tokens_per_s(by_label[label], at, t) for label, t in times.items()}
        best = max(rate, key=rate.__getitem__)
        if "plain" in rate and rate[best] <= rate["plain"] * (1 + SPEC_MARGIN):
            best = "plain"  # a thin predicted gain (SPEC_MARGIN)
        if not out or option_label(out[-1][1]) != best:
            out.append((bs, by_label[best]))
    return out


OVERLAPPED_ROUNDS = 6
"""Rounds in one timed run where rounds are overlapped: the run's time over its rounds."""


def time_rounds(
    worker,
    candidates: Sequence[TreeCandidate],
    batch_sizes: Sequence[int],
    budget_s: float = ROUND_BUDGET_S,
    repeats: int = 3,
    overlap: bool = False,
    known: Mapping[int, Mapping[str, float]] | None = None,
    rivals: Sequence[TreeCandidate] = (),
) -> tuple[dict[int, dict[str, float]], str | None]:
    """Time the rounds of ``candidates`` and a plain round on ``worker`` (an EagleWorker
    built with every candidate ``runnable``, no request running, no scheduler yet) at each of
    ``batch_sizes`` (ascending), with that many requests after a :data:`PREFIX_LEN`-token
    prefix (their KV is not written: its values do not change a round's time): two rounds to
    capture and warm up, then the best of ``repeats``. ``overlap``: the engine queues each
    round behind the last (``overlap_rounds``), so a round costs what the slower of the
    device and the host spends on it, not their sum; each timing is then a run of
    :data:`OVERLAPPED_ROUNDS` rounds each queued behind the last (after a first one that is
    not), over its rounds (the prefix grows by the tokens they commit). At each size after
    the first, only the candidates :func:`still_timed` keeps; none kept ends it. ``known``:
    batch size -> label -> seconds an earlier call timed: those options (``rivals``, and
    plain rounds) are not timed again, their times join each size's (in the result too) and
    prune the candidates as the candidates' own do. -> (batch size -> label -> seconds, why
    timing stopped early or None). The requests are removed and the statistics zeroed before
    it returns; the rounds' trees are left to the caller (``use_trees``)."""
    from polyspec.runtime.sampling import RequestSampler

    start = time.perf_counter()
    out: dict[int, dict[str, float]] = {}
    timed = list(candidates)
    width = max([2, *(max(c.num_draft_tokens, c.num_steps + 1) for c in candidates)])
    # an overlapped run's growth: each of its rounds (the first, the timed ones and the one
    # queued after the last) commits at most S + 1 tokens
    depth = max([1, *(c.num_steps + 1 for c in candidates)])
    growth = (OVERLAPPED_ROUNDS + 2) * depth if overlap else 0
    prefix = max(1, min(PREFIX_LEN, worker.req_pool.max_context - width - growth - 1))
    need = worker.kv_need(prefix + growth, width)
    stopped = None
    sampler = RequestSampler.create(0.0, 0, 1.0, 0, worker.device)
    for bs in batch_sizes:
        if bs * need > worker.allocator.available:
            stopped = f"batch {bs} does not fit the KV cache"
            break
        rids = [-1 - i for i in range(bs)]
        seconds: dict[str, float] = dict((known or {}).get(bs, {}))
        todo = [c for c in (None, *timed) if option_label(c) not in seconds]
        try:
            for r in rids:
                worker.add_request(r, [1], sampler, kv_reserved=need)
            worker.prefill(rids, [1] * bs)
            for c in todo:
                if time.perf_counter() - start > budget_s:
                    stopped = f"the {budget_s:g} s budget was spent"
                    break
                shape = (0, 1, 1) if c is None else (c.num_steps, c.topk, c.num_draft_tokens)
                worker.use_trees([(1, *shape)])
                best = float("inf")
                for rep in range(2 + repeats):
                    for r in rids:  # the same prefix each run, the draft current
                        st = worker.states[r]
                        st.seq_len = st.draft_len = prefix
                    rounds = 1
                    if overlap:  # timed from the first round queued behind another
                        worker.decode(rids, lookahead=True)
                        rounds = OVERLAPPED_ROUNDS
                    t = time.perf_counter()
                    for _ in range(rounds):
                        worker.decode(rids, lookahead=overlap)
                    if rep >= 2:
                        best = min(best, (time.perf_counter() - t) / rounds)
                    if overlap:  # the round queued after the run's last: not the next's
                        worker.drop_queued()
                        worker.backend.synchronize()
                seconds[option_label(c)] = best
        finally:
            for r in rids:
                if r in worker.states:
                    worker.remove_request(r)
        if stopped is not None:
            break
        out[bs] = seconds
        timed = still_timed(timed, seconds, bs, rivals)
        if not timed:
            break
    worker.reset_stats()
    return out, stopped


def batch_report(
    candidates: Sequence[TreeCandidate],
    seconds: Mapping[int, Mapping[str, float]],
    schedule: Sequence[tuple[int, TreeCandidate | None]],
    elapsed_s: float,
    stopped: str | None,
) -> dict:
    """A JSON-ready record of the choice by batch size: the rounds' times in ms and each
    option's predicted speed-up over plain rounds at every timed size."""
    by_label = {option_label(o): o for o in (None, *candidates)}
    speedup = {}
    for bs, times in seconds.items():
        plain = times.get("plain")
        if plain is None:
            continue
        speedup[str(bs)] = {
            label: round(tokens_per_s(by_label[label], bs, t) / tokens_per_s(None, bs, plain), 3)
            for label, t in times.items()
        }
    return {
        "chosen": schedule_label(schedule),
        "by_batch_size": [[bs, option_label(c)] for bs, c in schedule],
        "timed_batch_sizes": sorted(seconds),
        "round_ms": {
            str(bs): {label: round(t * 1e3, 3) for label, t in times.items()}
            for bs, times in seconds.items()
        },
        "predicted_speedup": speedup,
        "timing_s": round(elapsed_s, 2),
        "stopped": stopped,
    }


def schedule_label(schedule: Sequence[tuple[int, TreeCandidate | None]]) -> str:
    """``S=3 K=6 N=16; from batch 8: S=3 K=3 N=8; from batch 64: plain``."""
    parts = [option_label(schedule[0][1])]
    parts += [f"from batch {bs}: {option_label(c)}" for bs, c in schedule[1:]]
    return "; ".join(parts)
