"""The one linear layer call of the models: ``F.linear``, or the backend's faster form.

:meth:`polyspec.backend.Backend.linear_fn` may give a weight its own callable (a prepacked
oneDNN kernel on the cpu backend, for instance); the loaders store it on the weight as
``polyspec_linear``. Weights without one, and inputs of another dtype, use ``F.linear``.
A down projection may also carry the backend's gated form (:func:`gated_linear`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


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


def gated_linear(
    x: torch.Tensor,  # [T, 2 * in]: gate, up
    weight: torch.Tensor,  # [out, in]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor],  # the backend's kernel
) -> torch.Tensor:  # [T, out]
    """``linear(silu_and_mul(x), weight)``: in one kernel where the backend gave the weight a
    gated form (:meth:`polyspec.backend.Backend.gated_linear_fn`) and the weight's linear is
    still the one it was paired with (a quantized draft matrix has another)."""
    pair = getattr(weight, "polyspec_gated_linear", None)
    if (
        pair is not None
        and getattr(weight, "polyspec_linear", None) is pair[0]
        and x.dtype == weight.dtype
    ):
        return pair[1](x, None)
    return linear(silu_and_mul(x), weight)
