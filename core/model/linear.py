"""The linear layer calls of the models: ``F.linear``, or the backend's faster form.

:meth:`polyspec.backend.Backend.linear_fn` may give a weight its own callable (a prepacked
oneDNN kernel on the cpu backend, for instance); the loaders store it on the weight as
``polyspec_linear``. Weights without one, and inputs of another dtype, use ``F.linear``.
:meth:`~polyspec.backend.Backend.norm_linear_fn` may give a decoder layer's q/k/v and gate/up
weights one that also applies the RMSNorm before them (``polyspec_norm_linear``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from polyspec.backend import KernelSet


def linear(
    x: torch.Tensor,  # [T, in]
    weight: torch.Tensor,  # [out, in]
    bias: torch.Tensor | None = None,  # [out]
) -> torch.Tensor:  # [T, out]
    """``F.linear(x, weight, bias)``, through the weight's backend kernel when it has one."""
    fn = getattr(weight, "polyspec_linear", None)
    if fn is not None and x.dtype == weight.dtype:
        return fn(x, bias)
    return F.linear(x, weight, bias)


def norm_linear(
    x: torch.Tensor,  # [T, in]
    residual: torch.Tensor | None,  # [T, in]
    norm_weight: torch.Tensor,  # [in]
    eps: float,
    weight: torch.Tensor,  # [out, in]
    kernels: KernelSet,
    bias: torch.Tensor | None = None,  # [out]
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, out], [T, in] the residual stream)
    """``linear(rms_norm(x + residual, norm_weight, eps), weight, bias)`` and the residual
    stream after it (``x + residual``, or ``x`` without a residual): one call of the weight's
    backend kernel where it has one, else the norm kernel and :func:`linear`."""
    fn = getattr(weight, "polyspec_norm_linear", None)
    if fn is not None and x.dtype == weight.dtype:
        y, total = fn(x, residual, bias)
        return y, x if total is None else total
    if residual is None:
        return linear(kernels.rms_norm(x, norm_weight, eps), weight, bias), x
    normed, total = kernels.fused_add_rms_norm(x, residual, norm_weight, eps)
    return linear(normed, weight, bias), total
