"""Checks on the files and folders a command will write, made before it does any work."""

from __future__ import annotations

import os
from pathlib import Path

from polyspec.errors import ConfigError


def _nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_output_file(flag: str, path: str | Path) -> None:
    """Refuse an output file ``path`` (given as ``flag``) that could not be written: a
    directory, under a file, or in a folder this process may not write."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(
            f"{flag} {path} is a directory; give a file path such as {p / 'report'}{p.suffix}"
        )
    base = _nearest_existing(p.parent)
    if not base.is_dir():
        raise ConfigError(f"{flag} {path}: {base} is a file, not a folder; choose another path")
    if not os.access(base, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        where = p if p.exists() else base
        raise ConfigError(f"{flag} {path}: {where} is not writable; choose another path")


def check_output_dir(flag: str, path: str | Path) -> None:
    """Refuse an output folder ``path`` that could not be made or replaced (it is written
    beside itself first, then renamed into place): a file, under a file, or in a folder this
    process may not write."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{flag} {path} is a file, not a folder; choose a folder path")
    base = _nearest_existing(p.parent)
    if not base.is_dir():
        raise ConfigError(f"{flag} {path}: {base} is a file, not a folder; choose another path")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: {base} is not writable; choose another path")
