"""The one linear layer call of the models: ``F.linear``, or the backend's faster form.

:meth:`polyspec.backend.Backend.linear_fn` may give a weight its own callable (a prepacked
oneDNN kernel on the cpu backend, for instance); the loaders store it on the weight as
``polyspec_linear``. Weights without one, and inputs of another dtype, use ``F.linear``.
"""

from __future__ import annotations

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
