"""Helpers for cheap backend probes: they look at the machine without importing vendor runtimes
or initialising a device (see :func:`polyspec.hookspecs.polyspec_backend_probe`)."""

from __future__ import annotations

import glob
import importlib.util
import re
import shutil
from collections.abc import Mapping

NOT_IMPLEMENTED = "not implemented in this version"
"""Phrase the probes and factories of backends planned for a later release use."""


def has_module(name: str) -> bool:
    """True when a top-level module is importable, found without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def device_nodes(pattern: str, numbered: bool = True) -> list[str]:
    """Device files matching ``pattern`` (a glob such as ``/dev/nvidia*``); with ``numbered``,
    only the per-device nodes (``/dev/nvidia0``), not control nodes (``/dev/nvidiactl``)."""
    paths = sorted(glob.glob(pattern))
    if numbered:
        paths = [p for p in paths if re.search(r"\d+$", p)]
    return paths


def which(executable: str, env: Mapping[str, str]) -> str | None:
    """Full path of ``executable`` on ``env['PATH']``, or None."""
    return shutil.which(executable, path=env.get("PATH"))


def torch_build_info() -> tuple[str | None, dict[str, str | None]]:
    """(torch version, {"cuda": torch.version.cuda, "hip": torch.version.hip}); (None, {}) when
    torch is not installed. Reading ``torch.version`` initialises no device."""
    if not has_module("torch"):
        return None, {}
    import torch  # polyspec depends on torch; importing it initialises no device

    return torch.__version__, {
        "cuda": getattr(torch.version, "cuda", None),
        "hip": getattr(torch.version, "hip", None),
    }
