"""The npu backend's KernelSet: triton-ascend kernels where they work, the reference elsewhere.

The Triton kernels of :mod:`polyspec.kernels.triton` are one source for CUDA Triton and
triton-ascend. They are imported by name when the backend is activated; a family whose module
does not import (no triton-ascend, an API the installed Triton lacks) keeps the reference
kernels. Triton compiles a kernel once per call signature (dtypes, ranks, specialised ints),
so each Triton kernel is wrapped: if the first call of a signature fails inside Triton itself
(a compilation error or missing resources on this NPU), that signature falls back to the
reference for the rest of the process, the others keep Triton, and the reason is recorded in
:attr:`NPUKernels.sources`. Errors raised for bad inputs (the kernels' own checks) propagate.

The sampling kernels (``top_k_top_p_renorm``, ``sample``, ``verify_tree_sampling``) run as torch
ops on the NPU unless Triton provides them, so sampled requests are always verified by
sampling, never greedily.
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings
from collections.abc import Callable
from typing import Any

import torch

from polyspec.backend import KernelSet
from polyspec.kernels.reference import reference_kernels

TRITON_PACKAGE = "polyspec.kernels.triton"


@dataclasses.dataclass
class NPUKernels:
    """The kernel set and, per kernel name, where it comes from ("triton", "reference", or
    "reference (why)")."""

    kernels: KernelSet
    sources: dict[str, str]


class _TritonWithFallback:
    """A Triton kernel that falls back to the reference per call signature: Triton compiles
    one binary per (dtypes, ranks, specialised scalars), so each signature's first call is its
    test; one that fails inside Triton runs the reference from then on, the others keep
    Triton."""

    def __init__(
        self,
        name: str,
        triton_fn: Callable[..., Any],
        reference_fn: Callable[..., Any],
        sources: dict[str, str],
    ) -> None:
        self.name = name
        self.triton_fn = triton_fn
        self.reference_fn = reference_fn
        self.sources = sources
        self.verified: set[tuple] = set()  # signatures whose Triton call succeeded
        self.failed: dict[tuple, str] = {}  # signature -> why Triton failed

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = signature(args, kwargs)
        if key in self.verified:
            return self.triton_fn(*args, **kwargs)
        if key in self.failed:
            return self.reference_fn(*args, **kwargs)
        try:
            out = self.triton_fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001  (filtered just below)
            if not _raised_by_triton(exc):
                raise
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            warnings.warn(
                f"npu backend: the Triton kernel {self.name} failed to compile or launch for "
                f"{_describe(key)} ({reason}); using the torch reference for that signature",
                RuntimeWarning,
                stacklevel=2,
            )
            self.failed[key] = reason
            self._record()
            return self.reference_fn(*args, **kwargs)
        self.verified.add(key)
        self._record()
        return out

    def _record(self) -> None:
        """``sources[name]``: "triton", or which signatures run the reference and why."""
        if not self.failed:
            self.sources[self.name] = "triton"
            return
        parts = "; ".join(f"{_describe(k)}: {why}" for k, why in self.failed.items())
        prefix = "triton, " if self.verified else ""
        self.sources[self.name] = f"{prefix}reference for {len(self.failed)} signature(s) ({parts})"


def signature(args: tuple, kwargs: dict[str, Any]) -> tuple:
    """What Triton compiles a kernel for: each tensor's dtype and rank, each int's
    specialisation (1, a multiple of 16, other), other values by type."""

    def one(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return ("tensor", str(x.dtype).removeprefix("torch."), x.dim())
        if isinstance(x, bool) or x is None:
            return x
        if isinstance(x, int):
            return ("int", 1 if x == 1 else 16 if x % 16 == 0 else 0)
        if isinstance(x, list | tuple):
            return tuple(one(y) for y in x)
        return type(x).__name__

    return tuple(one(a) for a in args) + tuple((k, one(v)) for k, v in sorted(kwargs.items()))


def _describe(key: tuple) -> str:
    tensors = [f"{x[1]}[{x[2]}d]" for x in key if isinstance(x, tuple) and x[:1] == ("tensor",)]
    return "(" + ", ".join(tensors) + ")" if tensors else str(key)


def _raised_by_triton(exc: BaseException) -> bool:
    """True when ``exc`` (or what it wraps) comes from the triton package: an exception class
    of triton's, or one raised inside triton's code (its driver raises plain ``RuntimeError``
    s), not a contract check of the kernel's Python wrapper."""
    seen = 0
    while exc is not None and seen < 8:
        if type(exc).__module__.split(".")[0] == "triton":
            return True
        tb, innermost = exc.__traceback__, None
        while tb is not None:
            innermost = tb
            tb = tb.tb_next
        if innermost is not None:
            module = innermost.tb_frame.f_globals.get("__name__", "")
            if module.split(".")[0] == "triton":
                return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def build_kernels(use_triton: bool = True) -> NPUKernels:
    """The npu KernelSet (module docstring); ``use_triton=False`` keeps every reference."""
    reference = reference_kernels()
    sources = {name: "reference" for name in KernelSet.names()}
    overrides: dict[str, Callable[..., Any]] = {}
    if use_triton:
        try:
            families: dict[str, tuple[str, ...]] = importlib.import_module(TRITON_PACKAGE).KERNELS
        except (ImportError, AttributeError) as exc:
            families = {}
            for name in sources:
                if sources[name] == "reference":
                    sources[name] = f"reference (no Triton kernels: {exc})"
        for family, names in families.items():
            try:
                module = importlib.import_module(f"{TRITON_PACKAGE}.{family}")
            except Exception as exc:  # noqa: BLE001  (any import failure: keep the reference)
                for name in names:
                    sources[name] = f"reference (import of {family} failed: {exc})"
                continue
            for name in names:
                if not hasattr(module, name):
                    continue
                overrides[name] = _TritonWithFallback(
                    name, getattr(module, name), getattr(reference, name), sources
                )
                sources[name] = "triton"
    return NPUKernels(dataclasses.replace(reference, **overrides), sources)
