"""Weight-only int8 quantization: the reference of :meth:`polyspec.backend.Backend.quantized_linear_fn`.

Scheme ``"int8"``: symmetric, one fp32 scale per output row. ``scale[n] = max_k |w[n, k]| / 127``
(1 for an all-zero row), ``q[n, k] = round(w[n, k] / scale[n])`` in [-127, 127] (round half to
even), and ``y = (x @ q.T) * scale + bias`` computed in fp32, then cast to ``x``'s dtype. A
backend's kernel may sum in any order; the conformance suite bounds its difference from
:func:`linear_int8`.

It is meant for draft heads: their weights are read at every draft step and, on a CPU, evicted
from the caches by the target's forward in between, so halving their bytes shortens each step.
The draft only proposes tokens, so its quantization changes acceptance, never the output.
"""

from __future__ import annotations

import torch

SCHEMES = ("int8",)
"""Weight-quantization schemes a backend may list in ``BackendCapabilities.weight_quantization``."""


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` (any float dtype) -> ``(q [N, K] int8 contiguous, scale [N] fp32)``."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(
            f"quantize_int8 takes a 2-D floating-point weight [N, K], got {weight.dtype} "
            f"{tuple(weight.shape)}"
        )
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    if not torch.isfinite(amax).all():
        raise ValueError("quantize_int8: the weight holds inf or nan; it cannot be quantized")
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def linear_int8(
    x: torch.Tensor,  # [T, K]
    q: torch.Tensor,  # [N, K] int8
    scale: torch.Tensor,  # [N] fp32
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [T, N] in x's dtype
    """The scheme's product in fp32 (dequantizes the whole weight: a reference, not a kernel)."""
    y = (x.float() @ q.float().T) * scale.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
