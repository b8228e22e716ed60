"""Draft-head weight quantization (``SpeculativeConfig.draft_quantization``).

The backend quantizes each matrix the head owns (:meth:`DraftHead.own_matrices`) through
:meth:`polyspec.backend.Backend.quantized_linear_fn`; the callable replaces the weight's
``polyspec_linear``, which :func:`polyspec.model.linear.linear` calls. The target is never
touched, so greedy output stays the target's: only what the draft proposes changes.
"""

from __future__ import annotations

from typing import Any

from polyspec.backend import Backend
from polyspec.errors import ConfigError


def check_draft_quantization(setting: str, algorithm: str, backend: Backend) -> None:
    """Refuse, before any model is loaded, an explicit scheme that cannot apply."""
    if setting in ("auto", "none"):
        return
    if algorithm == "standalone":
        raise ConfigError(
            f"speculative.draft_quantization = {setting!r} applies to EAGLE heads; a standalone "
            "draft model runs in the model's dtype: set it to 'auto' or 'none'"
        )
    listed = backend.capabilities.weight_quantization
    if setting not in listed:
        raise ConfigError(
            f"speculative.draft_quantization = {setting!r}: backend {backend.name!r} does not "
            f"support it (its capabilities list weight_quantization = {list(listed)}); set it to "
            "'auto' or 'none'"
        )


def quantize_draft(head: Any, backend: Backend, setting: str) -> str:
    """Apply ``setting`` ("auto", "none" or a scheme) to ``head``'s own matrices and return the
    scheme applied ("none" when nothing was quantized). "auto" takes the scheme
    :meth:`Backend.auto_weight_quantization` names for the head's dtype, if the backend can
    apply it to every matrix of the head; an explicit scheme that the backend declines for
    some matrix is a ConfigError naming it."""
    own = getattr(head, "own_matrices", None)
    if own is None:
        return "none"
    if setting == "none":
        _restore(own())
        return "none"
    matrices = own()
    if setting == "auto":
        scheme = backend.auto_weight_quantization(matrices[0].dtype) if matrices else None
        if scheme is None:
            _restore(matrices)
            return "none"
    else:
        scheme = setting
    fns = [backend.quantized_linear_fn(w.data, scheme) for w in matrices]
    declined = [tuple(w.shape) for w, fn in zip(matrices, fns) if fn is None]
    if declined:
        if setting == "auto":
            _restore(matrices)
            return "none"
        dtype = str(matrices[0].dtype).removeprefix("torch.")
        raise ConfigError(
            f"speculative.draft_quantization = {scheme!r}: backend {backend.name!r} cannot quantize "
            f"this head's {dtype} weights {declined}; run in another dtype (--dtype) or set it to "
            "'auto' or 'none'"
        )
    for w, fn in zip(matrices, fns):
        if not hasattr(w, "polyspec_unquantized"):
            w.polyspec_unquantized = getattr(w, "polyspec_linear", None)
        w.polyspec_linear = fn
    return scheme


def _restore(matrices: list[Any]) -> None:
    """Undo an earlier quantization of these matrices (a head built once and given to a second
    engine, :meth:`LLM.from_modules`): back to the backend's own linear, or ``F.linear``."""
    for w in matrices:
        if hasattr(w, "polyspec_unquantized"):
            fn = w.polyspec_unquantized
            del w.polyspec_unquantized
            if fn is None:
                del w.polyspec_linear
            else:
                w.polyspec_linear = fn
