"""polyspec: hardware-neutral EAGLE speculative decoding.

``from polyspec import LLM, SamplingParams, SpeculativeConfig``. Names are resolved lazily so
that ``import polyspec`` stays cheap and loads no model code or vendor runtime.
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "LLM": "polyspec.engine.llm",
    "RequestOutput": "polyspec.engine.request",
    "SamplingParams": "polyspec.config",
    "SpeculativeConfig": "polyspec.config",
    "EngineConfig": "polyspec.config",
    "BACKEND_API_VERSION": "polyspec.backend",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'polyspec' has no attribute {name!r}")
