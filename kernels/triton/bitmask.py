"""Structured output's ``apply_token_bitmask`` in one launch: a program per (row, block of
the vocabulary) reads each logit's word of the bitmask and writes ``-inf`` where the bit is
clear. Why a kernel: torch's version unpacks the mask into a ``[n, 32 * W]`` tensor first,
several launches and a vocabulary-sized temporary per row, on every constrained verify."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from polyspec.kernels.triton._util import check
from polyspec.kernels.triton.pdl import launch_options, wait_for_previous

BLOCK = 1024
"""Logits per program."""


@triton.jit
def _apply_token_bitmask_kernel(
    x_ptr,  # [n, V] (row stride x_stride), written in place
    m_ptr,  # [n, W] int32 (row stride m_stride)
    V,
    W,
    x_stride,
    m_stride,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = c < V
    word = c // 32
    bits = tl.load(m_ptr + r * m_stride + word, mask=live & (word < W), other=0)
    allowed = ((bits >> (c % 32).to(tl.int32)) & 1) != 0
    x = tl.load(x_ptr + r * x_stride + c, mask=live, other=0.0)
    tl.store(x_ptr + r * x_stride + c, tl.where(allowed, x, float("-inf")), mask=live)


def apply_token_bitmask(
    logits: torch.Tensor,  # [n, V] any float dtype, written in place
    bitmask: torch.Tensor,  # [n, W] int32
    pdl: bool = False,
) -> None:
    """``polyspec.kernels.reference.apply_token_bitmask``: ``-inf`` at every logit whose token the
    row's bitmask does not allow (tokens past ``32 * W`` included), in place. ``pdl``: launch with
    programmatic dependent launch (:mod:`.pdl`)."""
    check(
        logits.dim() == 2 and bitmask.dim() == 2 and bitmask.shape[0] == logits.shape[0],
        f"apply_token_bitmask needs logits [n, V] and bitmask [n, W], got "
        f"{tuple(logits.shape)} and {tuple(bitmask.shape)}",
    )
    check(bitmask.dtype == torch.int32, f"the bitmask must be int32, got {bitmask.dtype}")
    check(logits.stride(1) == 1, "apply_token_bitmask needs rows of contiguous logits")
    n, vocab = logits.shape
    if n == 0:
        return
    mask = bitmask if bitmask.stride(1) == 1 else bitmask.contiguous()
    grid = (n, triton.cdiv(vocab, BLOCK))
    _apply_token_bitmask_kernel[grid](
        logits,
        mask,
        vocab,
        mask.shape[1],
        logits.stride(0),
        mask.stride(0),
        BLOCK=BLOCK,
        PDL=pdl,
        **launch_options(pdl),
    )
