"""Portable Triton kernels (one source for CUDA Triton and triton-ascend).

Importing this package imports nothing from Triton: :func:`triton_kernel_overrides` does, so
listing backends or importing polyspec never needs Triton installed. Each kernel is a drop-in for
the :class:`polyspec.backend.KernelSet` field of the same name (same signature and semantics as
:mod:`polyspec.kernels.reference`). CI runs them on the CPU through Triton's interpreter
(``TRITON_INTERPRET=1``); on a device the same wrappers launch compiled kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

KERNELS: dict[str, tuple[str, ...]] = {
    "tree": ("build_tree", "verify_tree_greedy", "verify_tree_sampling"),
    "cache": (
        "assign_draft_cache_locs",
        "assign_req_to_token",
        "assign_extend_cache_locs",
        "assign_block_cache_locs",
        "assign_accept_locs",
    ),
    "norm": ("rms_norm", "fused_add_rms_norm", "draft_layer_input"),
    "rope": ("rotary_embedding",),
    "activation": ("silu_and_mul",),
    "topk": ("softmax_topk",),
    "draft": ("select_top_k", "organize_draft_results"),
    "bitmask": ("apply_token_bitmask",),
    "argmax": ("argmax",),
}
"""Kernel family module -> the KernelSet fields it provides."""


def triton_kernel_overrides() -> dict[str, Callable[..., Any]]:
    """KernelSet field name -> Triton implementation, for ``dataclasses.replace(KernelSet, ...)``.

    Imports Triton (raises ``ImportError`` naming the fix when it is not installed)."""
    import importlib

    try:
        import triton  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "the Triton kernels need the 'triton' package (pip install 'polyspec[cuda]' or "
            "triton-ascend on Ascend)"
        ) from exc
    overrides: dict[str, Callable[..., Any]] = {}
    for family, names in KERNELS.items():
        module = importlib.import_module(f"{__name__}.{family}")
        for name in names:
            overrides[name] = getattr(module, name)
    return overrides
