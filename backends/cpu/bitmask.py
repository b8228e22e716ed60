"""Structured output's ``apply_token_bitmask`` on the cpu backend, in numpy.

The reference (``polyspec.kernels.reference``) expands every row's bits with a few torch ops
over ``[n, W, 32]`` int32 tensors. On a CPU those ops are multi-threaded, and on a small
shared machine their cost is mostly the threads' hand-offs: 28-36 ms a call for 1-16 rows on
the 2-core VM at load average 6 (``benchmarks/bench_bitmask_cpu.py``), against 0.3-4.2 ms
here; with one torch thread the two cost the same. This version is single-threaded numpy
over the logits' own memory: rows that allow every token they cover (unconstrained requests,
tree nodes no output reaches) are skipped, the other rows' clear bits are unpacked to one
byte per token and ``-inf`` is written there. Its result is the reference's, bit for bit
(the conformance suite compares them).
"""

from __future__ import annotations

import numpy as np
import torch

_SAME_SIZE_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def apply_token_bitmask(
    logits: torch.Tensor,  # [n, V] float, on the cpu, written in place
    bitmask: torch.Tensor,  # [n, W] int32: bit t % 32 of word t // 32 set = token t allowed
) -> None:
    """``-inf`` at every logit whose token the row's bitmask does not allow (and at tokens
    past ``32 * W``), in place; a row of all ones is left as it is."""
    if not (logits.dim() == 2 and bitmask.dim() == 2 and bitmask.shape[0] == logits.shape[0]):
        raise ValueError(
            f"apply_token_bitmask needs logits [n, V] and bitmask [n, W], got "
            f"{tuple(logits.shape)} and {tuple(bitmask.shape)}"
        )
    if bitmask.dtype != torch.int32:
        raise ValueError(f"the bitmask must be int32, got {bitmask.dtype}")
    n, vocab = logits.shape
    if n == 0 or vocab == 0:
        return
    as_int = _SAME_SIZE_INT[logits.element_size()]
    # -inf written as its bit pattern into an integer view of the logits: numpy has no bf16
    ninf = torch.tensor(float("-inf"), dtype=logits.dtype).view(as_int).item()
    values = logits.detach().view(as_int).numpy()  # [n, V] the logits' memory, any strides
    masks = bitmask.contiguous().numpy()
    covered = min(vocab, 32 * masks.shape[1])
    if vocab > covered:  # tokens past the bitmask are never allowed
        values[:, covered:] = ninf
    rows = np.flatnonzero((masks != -1).any(axis=1))  # rows refusing some token
    if rows.size == 0:
        return
    # the clear bits of those rows, one bool per token: True = refused
    refused = np.unpackbits(
        (~masks[rows]).view(np.uint8), axis=1, count=covered, bitorder="little"
    ).view(np.bool_)
    if rows.size == n:
        np.copyto(values[:, :covered], ninf, where=refused)
        return
    for k, row in enumerate(rows.tolist()):
        np.copyto(values[row, :covered], ninf, where=refused[k])
