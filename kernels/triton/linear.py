"""Row-invariant linear: ``y = x @ W.T + b`` whose row ``m`` does not depend on the other rows.

cuBLAS picks a kernel (tile shape, split-K) by the row count, so a verify forward over N rows
rounds a token's logits differently from a one-row decode step, and bf16 greedy speculative
output then parts from plain greedy output after a near-tie (docs/benchmarks.md, "bf16 and
identity"). Here one compiled configuration per weight serves every row count: the tile is
always ``BLOCK_M x BLOCK_N``, the reduction always walks K in ``BLOCK_K`` chunks in order, with fp32
accumulation and no split-K. A row's result therefore depends only on its own input, its
column block and K, never on how many rows came with it or where in the batch it sits (the
zero rows padding a tile never mix into it: a matrix-multiply unit sums each output element
over k alone).

The input is loaded as it is. Work done on it inside the K loop (the RMSNorm before a
projection, the MLP's activation before the down projection) made a decode step slower on an
H100, at SmolLM2's shape and at Llama-3-8B's, than the launch it saved: the norms and the
activation stay kernels of their own.

``M`` is never specialised (``do_not_specialize``): Triton would otherwise compile a separate
variant for ``M == 1``. The grid runs row blocks fastest, so the programs that share a column
block of ``W`` run together and ``W`` streams from memory once per call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from polyspec.kernels.triton._util import check, interpreted
from polyspec.kernels.triton.pdl import launch_options, wait_for_previous

BLOCK_M = 16


def tile_config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for a weight [n, k]: a function of the weight
    alone, never of the row count, so every call on that weight sums each output element in one
    order (``num_stages``, the loads kept in flight, changes the speed, not the sums).

    Chosen from ``benchmarks/bench_rowinv_cuda.py`` inside CUDA graphs, 1-16 rows weighing most
    (a decode step, a verify).

    - SmolLM2 shapes (k < 2048; H200): narrow 32-column tiles with 128-deep K steps for the
      layer weights (down [576, 1536]: 4.5 us against 6.5 us for 64x64, cuBLAS 4.4-4.8 us),
      64x64 for a vocabulary head (lm_head [49152, 576]: 15.9 us, cuBLAS 16.1 us; 32x128 takes
      20.4 us there).
    - Llama-3-8B shapes (k >= 2048; H100, ``--shapes llama3-8b --grid``, each weight read from
      memory): a layer's weight streams at one row in 32x128 tiles with 5 loads in flight (o
      [4096, 4096]: 13.8 us against 17.4 us with 3, cuBLAS 16.0; down [4096, 14336]: 42.3
      against 55.2, cuBLAS 42.7), a wide one (gate_up [28672, 4096], lm_head [128256, 4096])
      in 64x256 tiles (77.5 and 332.2 us, cuBLAS 77.2 and 358.8)."""
    if k >= 2048:
        return (64, 256, 4, 3) if n >= 16384 else (32, 128, 4, 5)
    if n >= 16384:
        return 64, 64, 4, 3
    return 32, 128, 4, 3


@triton.jit(do_not_specialize=["M"])
def _row_invariant_linear_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    b_ptr,  # [N] (read only when HAS_BIAS)
    y_ptr,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    row_ok = rm < M
    col_ok = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_ok = k < K
        x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            # The interpreter: numpy's BLAS may round a row differently by its place in the
            # tile (OpenBLAS's Haswell kernels do), so each product is summed over K in order.
            x = x.to(tl.float32)
            w = w.to(tl.float32)
            acc += tl.sum(x[:, :, None] * w[None, :, :], axis=1)
        elif IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def row_invariant_linear(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    config: tuple[int, int, int, int] | None = None,
    pdl: bool = False,
) -> torch.Tensor:  # [..., N] in x's dtype
    """``F.linear(x, weight, bias)`` with fp32 accumulation in a fixed order (module doc), for
    fp32 (exact fp32 products, no TF32), bf16 and fp16 inputs of the weight's dtype.
    ``config`` overrides :func:`tile_config` (benchmarks only: a weight must keep one);
    ``pdl``: launch with programmatic dependent launch (:mod:`.pdl`)."""
    check(weight.dim() == 2, f"linear: weight must be [N, K], got {list(weight.shape)}")
    n, k = weight.shape
    check(
        x.shape[-1] == k,
        f"linear: x has {x.shape[-1]} features but the weight [{n}, {k}] expects {k}",
    )
    check(
        x.dtype == weight.dtype and x.dtype in (torch.float32, torch.bfloat16, torch.float16),
        f"linear: x and weight must share one of float32 / bfloat16 / float16, got "
        f"{x.dtype} and {weight.dtype}",
    )
    check(
        bias is None or tuple(bias.shape) == (n,),
        f"linear: bias must be [{n}], got {None if bias is None else list(bias.shape)}",
    )
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*lead, n)
    upcast = interpreted()  # numpy has no bf16 (see interpreted())
    block_n, block_k, num_warps, num_stages = config or tile_config(n, k)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, block_n))
    _row_invariant_linear_kernel[grid](
        x2, w, bias if bias is not None else w, y,
        m, n, k, x2.stride(0), w.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32 or upcast,
        UPCAST=upcast,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
        num_stages=num_stages, PDL=pdl, **launch_options(pdl),
    )  # fmt: skip
    return y.reshape(*lead, n)
