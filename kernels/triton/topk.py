"""The draft's top-k (``softmax_topk``) in one launch per call.

Why: torch's ``softmax`` then ``topk`` over a draft vocabulary runs a radix select with one
thread block per row: on the H200 about 36 us for each draft step of a SmolLM2-shaped round
(three rows of 8,192), where this kernel's three calls a round took 27-28 us together in its
``loop`` form and take 13 us in its ``whole`` form (H100; docs/benchmarks.md, "The draft's top-k
on the GPU"). One program per row, in one of two forms:

- ``loop`` (any vocabulary): streams the row in ``BLOCK``-wide steps, keeping a running max and
  exp-sum (online softmax) and the ``k`` best logits so far: per step two reductions for the
  softmax and five for each of the ``k`` insertions, one step after another.
- ``whole`` (vocabularies up to ``WHOLE_MAX``, a draft vocabulary's size): the whole row in one
  block spread over more warps, so the softmax takes two reductions and each of the ``k``
  picks two (the best logit, then its lowest id). For the shipped head's 16,384-token
  vocabulary and k = 3 that is 8 reductions a row where ``loop`` runs 8 steps of 17.

Both write ``p = exp(l - max) / sum`` for the ``k`` best, best first, equal logits lower id
first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from polyspec.kernels.reference import check_index_map
from polyspec.kernels.triton._util import check, next_pow2
from polyspec.kernels.triton.pdl import launch_options, wait_for_previous

BLOCK = 2048
"""Logits per step of a row's loop (the ``loop`` form)."""

WHOLE_MAX = 16384
"""The largest vocabulary read as one block (the ``whole`` form); past it the ``loop`` form runs.
A 16,384-wide fp32 row over 16 warps is 32 values a thread, plus as many ids."""


@triton.jit
def _mapped(i, map_ptr, HAS_MAP: tl.constexpr):
    """``map[i]`` where the caller passes a map (int64), else ``i``."""
    if HAS_MAP:
        return tl.load(map_ptr + i).to(tl.int64)
    return i.to(tl.int64)


@triton.jit
def _softmax_topk_kernel(
    x_ptr,  # [n, V] (row stride x_stride)
    p_ptr,  # [n, K] fp32 out
    i_ptr,  # [n, K] int64 out
    map_ptr,  # [V] int64 (read where HAS_MAP)
    V,
    x_stride,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_MAP: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    r = tl.program_id(0).to(tl.int64)
    slot = tl.arange(0, K_PAD)
    # The k best so far; padding slots hold +inf so they are never the one replaced.
    top_v = tl.where(slot < K, float("-inf"), float("inf")).to(tl.float32)
    top_i = tl.zeros((K_PAD,), tl.int64)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK):
        c = start + tl.arange(0, BLOCK).to(tl.int64)
        x = tl.load(x_ptr + r * x_stride + c, mask=c < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        alpha = tl.where(m_new > float("-inf"), tl.exp(m - m_new), 0.0)
        e = tl.where(x > float("-inf"), tl.exp(x - m_new), 0.0)
        s = s * alpha + tl.sum(e, 0)
        m = m_new
        for _ in tl.static_range(K):
            best = tl.max(x, 0)
            best_i = tl.min(tl.where(x == best, c, V), 0)  # ties: the lower id
            worst = tl.min(top_v, 0)
            # Of equal worst entries the higher id goes, so a later equal logit never displaces
            # an earlier one (ties come lower id first, as in the cpu kernel).
            worst_i = tl.max(tl.where(top_v == worst, top_i, -1), 0)
            at = tl.min(tl.where((top_v == worst) & (top_i == worst_i), slot, K_PAD), 0)
            put = slot == tl.where(best > worst, at, K_PAD)  # K_PAD: no slot
            top_v = tl.where(put, best, top_v)
            top_i = tl.where(put, best_i, top_i)
            x = tl.where(c == best_i, float("-inf"), x)
    live = slot < K
    for a in tl.static_range(K):
        v = tl.max(tl.where(live, top_v, float("-inf")), 0)
        vi = tl.min(tl.where(live & (top_v == v), top_i, V), 0)
        at = tl.min(tl.where(live & (top_v == v) & (top_i == vi), slot, K_PAD), 0)
        live = live & (slot != at)
        p = tl.where(v > float("-inf"), tl.exp(v - m) / s, 0.0)
        tl.store(p_ptr + r * K + a, p)
        tl.store(i_ptr + r * K + a, _mapped(tl.minimum(vi, V - 1), map_ptr, HAS_MAP))


@triton.jit
def _softmax_topk_whole_kernel(
    x_ptr,  # [n, V] (row stride x_stride)
    p_ptr,  # [n, K] fp32 out
    i_ptr,  # [n, K] int64 out
    map_ptr,  # [V] int64 (read where HAS_MAP)
    V,
    x_stride,
    K: tl.constexpr,
    BLOCK: tl.constexpr,  # >= V
    HAS_MAP: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    live = c < V
    x = tl.load(x_ptr + r * x_stride + c, mask=live, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    s = tl.sum(tl.where(x > float("-inf"), tl.exp(x - m), 0.0), 0)
    # An id leaves the row once picked (BLOCK: out), so a -inf logit picked for a row with
    # fewer than K finite ones is never picked twice; padding is out from the start.
    ids = tl.where(live, c, BLOCK)
    for a in tl.static_range(K):
        best = tl.max(tl.where(ids < BLOCK, x, float("-inf")), 0)
        best_i = tl.min(tl.where((x == best) & (ids < BLOCK), ids, BLOCK), 0)
        p = tl.where(best > float("-inf"), tl.exp(best - m) / s, 0.0)
        tl.store(p_ptr + r * K + a, p)
        best_i = tl.minimum(best_i, V - 1).to(tl.int64)
        tl.store(i_ptr + r * K + a, _mapped(best_i, map_ptr, HAS_MAP))
        ids = tl.where(ids == best_i, BLOCK, ids)


def softmax_topk(
    logits: torch.Tensor,  # [n, V] any float dtype
    k: int,
    index_map: torch.Tensor | None = None,  # [V] int64
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # (topk_p [n, k] fp32, topk_index [n, k] int64)
    """``polyspec.kernels.reference.softmax_topk``: per row the ``k`` largest softmax
    probabilities, best first, with their ids (equal logits: the lower id first), mapped
    through ``index_map`` in the same launch. ``pdl``: launch with programmatic dependent
    launch (:mod:`.pdl`)."""
    return softmax_topk_form(logits, k, index_map=index_map, pdl=pdl)


def whole_warps(vocab: int) -> int:
    """Warps of the ``whole`` form for a ``vocab``-wide row: 32 values a thread at most."""
    return min(16, max(4, next_pow2(vocab) // 1024))


def softmax_topk_form(
    logits: torch.Tensor,  # [n, V] any float dtype
    k: int,
    form: str = "auto",
    num_warps: int | None = None,
    index_map: torch.Tensor | None = None,  # [V] int64
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # (topk_p [n, k] fp32, topk_index [n, k] int64)
    """:func:`softmax_topk` in a given form (``"loop"``, ``"whole"``, or ``"auto"``: whole up to
    ``WHOLE_MAX``); ``num_warps`` overrides the whole form's :func:`whole_warps`. For
    benchmarks/bench_kernels.py, which times the forms against each other. ``pdl``: launch with
    programmatic dependent launch (:mod:`.pdl`)."""
    check(logits.dim() == 2, f"softmax_topk needs logits [n, V], got {tuple(logits.shape)}")
    n, vocab = logits.shape
    check(1 <= k <= vocab, f"softmax_topk needs 1 <= k <= V, got k={k}")
    check(k <= 64, f"softmax_topk: k={k} is past this kernel's 64 (the draft's topk)")
    check(form in ("auto", "loop", "whole"), f"softmax_topk: unknown form {form!r}")
    if form == "auto":
        form = "whole" if vocab <= WHOLE_MAX else "loop"
    check(
        form == "loop" or vocab <= WHOLE_MAX,
        f"softmax_topk: the whole form reads at most {WHOLE_MAX} logits a row, got {vocab}",
    )
    check_index_map(index_map, vocab)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    has_map = index_map is not None
    index_map = index_map.contiguous() if has_map else logits  # (not read without a map)
    p = torch.empty((n, k), dtype=torch.float32, device=logits.device)
    idx = torch.empty((n, k), dtype=torch.int64, device=logits.device)
    if n == 0:
        return p, idx
    if form == "whole":
        _softmax_topk_whole_kernel[(n,)](
            logits, p, idx, index_map, vocab, logits.stride(0), K=k, BLOCK=next_pow2(vocab),
            HAS_MAP=has_map, num_warps=num_warps or whole_warps(vocab), PDL=pdl,
            **launch_options(pdl),
        )  # fmt: skip
    else:
        _softmax_topk_kernel[(n,)](
            logits,
            p,
            idx,
            index_map,
            vocab,
            logits.stride(0),
            K=k,
            K_PAD=next_pow2(k),
            BLOCK=BLOCK,
            HAS_MAP=has_map,
            PDL=pdl,
            **launch_options(pdl),
        )
    return p, idx
