"""Helpers shared by the plugin tests: install the example plugin packages, fake entry points."""

from __future__ import annotations

import importlib
import importlib.metadata
import subprocess
import sys
import textwrap
from pathlib import Path

PLUGINS_DIR = Path(__file__).resolve().parent.parent / "plugins"
PACKAGES = {
    "polyspec-example-backend": "example",
    "polyspec-broken-backend": "broken",
    "polyspec-ascend-like": "ascend-like",
}
"""Distribution name -> the backend entry-point name it declares."""


def _installed(dist: str, entry_point: str) -> bool:
    try:
        eps = importlib.metadata.distribution(dist).entry_points
    except importlib.metadata.PackageNotFoundError:
        return False
    return any(ep.group == "polyspec.backends" and ep.name == entry_point for ep in eps)


def ensure_test_plugins_installed() -> None:
    """pip-install the test plugin packages (example, broken, ascend-like) into this venv unless present.

    ``--no-deps --no-build-isolation``: offline and fast; a second run finds them installed.
    """
    missing = [d for d, ep in PACKAGES.items() if not _installed(d, ep)]
    if missing:
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation"]
        cmd += ["--quiet", *(str(PLUGINS_DIR / d) for d in missing)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"pip install failed:\n{proc.stdout}\n{proc.stderr}"
        importlib.invalidate_caches()
    for dist, ep in PACKAGES.items():
        assert _installed(dist, ep), f"{dist} is not installed after pip install"


def write_plugin_module(folder: Path, module: str, body: str) -> None:
    """Write ``folder/module.py`` with ``body`` (dedented) for a fake entry point."""
    (folder / f"{module}.py").write_text(textwrap.dedent(body))
    importlib.invalidate_caches()


def fake_entry_point(name: str, value: str) -> importlib.metadata.EntryPoint:
    """An entry point in the ``polyspec.backends`` group that no distribution declares."""
    return importlib.metadata.EntryPoint(name=name, value=value, group="polyspec.backends")


def builtin_entry_points() -> list[importlib.metadata.EntryPoint]:
    """The real entry points of polyspec's own backends (cpu, cuda, npu)."""
    return [
        ep
        for ep in importlib.metadata.entry_points(group="polyspec.backends")
        if ep.value.startswith("polyspec.backends.")
    ]
