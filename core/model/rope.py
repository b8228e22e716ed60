"""Rotary position embedding tables (the ``cos_sin_cache`` the rotary_embedding kernel reads)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from polyspec.errors import ModelLoadError
from polyspec.model.config import DEFAULT_ROPE_THETA


def inv_frequencies(
    head_dim: int, theta: float = DEFAULT_ROPE_THETA, scaling: Mapping[str, Any] | None = None
) -> torch.Tensor:  # [head_dim // 2] fp32
    """Inverse frequencies ``theta ** (-2i / head_dim)``, rescaled as ``scaling`` says.

    Computed exactly as transformers does (fp32 from an int64 arange), so that logits match it
    bit for bit in fp32.
    """
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv
    kind = scaling.get("rope_type")
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "freq_factors":
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)
        if factors.shape != inv.shape:
            raise ModelLoadError(
                f"rope_freqs has {factors.numel()} factors, expected head_dim/2 = {inv.numel()}"
            )
        return inv / factors
    if kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between
        # interpolated smoothly (Meta's reference implementation).
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_ctx / high) & ~(wavelen > old_ctx / low)
        return torch.where(medium, smoothed, scaled)
    raise ModelLoadError(f"unsupported rope scaling type {kind!r}; supported: linear, llama3")


def cos_sin_cache(
    head_dim: int,
    max_positions: int,
    theta: float = DEFAULT_ROPE_THETA,
    scaling: Mapping[str, Any] | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:  # [max_positions, head_dim] fp32: cos in the first half, sin in the second
    """The table the ``rotary_embedding`` kernel indexes by position."""
    inv = inv_frequencies(head_dim, theta, scaling)
    pos = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = pos[:, None] * inv[None, :]  # [max_positions, head_dim // 2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device=device)
