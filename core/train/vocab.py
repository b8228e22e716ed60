"""The draft vocabulary: the target's most frequent output tokens (EAGLE-3's d2t / t2d)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch


def choose_draft_vocab(
    answers: Iterable[list[int]], vocab_size: int, draft_vocab_size: int
) -> tuple[torch.Tensor, float]:
    """(sorted target ids of the draft vocabulary [draft_vocab_size], fraction of answer tokens
    it covers). Ties and unseen ids are filled in id order so the size is exact."""
    counts: Counter[int] = Counter()
    for ids in answers:
        counts.update(ids)
    n = min(draft_vocab_size, vocab_size)
    chosen = [t for t, _ in counts.most_common(n)]
    if len(chosen) < n:
        seen = set(chosen)
        chosen += [t for t in range(vocab_size) if t not in seen][: n - len(chosen)]
    total = sum(counts.values()) or 1
    covered = sum(counts[t] for t in chosen) / total
    return torch.tensor(sorted(chosen), dtype=torch.int64), covered


def grow_draft_vocab(
    answers: Iterable[list[int]], kept_ids: torch.Tensor, vocab_size: int, draft_vocab_size: int
) -> tuple[torch.Tensor, float]:
    """(sorted target ids [draft_vocab_size], fraction of answer tokens covered): every id of
    ``kept_ids`` (a trained head's draft vocabulary) plus the answers' most frequent other ids,
    then unseen ids in id order, up to ``draft_vocab_size``."""
    counts: Counter[int] = Counter()
    for ids in answers:
        counts.update(ids)
    kept = set(kept_ids.tolist())
    n = min(draft_vocab_size, vocab_size)
    chosen = sorted(kept)
    chosen += [t for t, _ in counts.most_common() if t not in kept][: max(n - len(chosen), 0)]
    if len(chosen) < n:
        seen = set(chosen)
        chosen += [t for t in range(vocab_size) if t not in seen][: n - len(chosen)]
    total = sum(counts.values()) or 1
    covered = sum(counts[t] for t in chosen) / total
    return torch.tensor(sorted(chosen), dtype=torch.int64), covered


def d2t_t2d(draft_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SpecForge's maps: ``d2t[i] = draft_ids[i] - i`` (target id = i + d2t[i]) and the bool
    mask ``t2d`` [vocab_size] of target ids in the draft vocabulary."""
    d2t = draft_ids - torch.arange(draft_ids.numel())
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return d2t, t2d


def vocab_coverage(answers: Iterable[list[int]], draft_ids: torch.Tensor) -> float:
    """Fraction of answer tokens that ``draft_ids`` (a given draft vocabulary) covers."""
    chosen = set(draft_ids.tolist())
    total = covered = 0
    for ids in answers:
        total += len(ids)
        covered += sum(t in chosen for t in ids)
    return covered / (total or 1)
