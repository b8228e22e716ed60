#!/usr/bin/env python3
"""Fail when the hardware-neutral core names vendor code (docs/architecture.md, "Layers").

Scans every ``*.py`` under the given folders (default: ``core/`` of this repository) and
reports, as ``file:line: what``:

- imports of ``torch_npu``, ``triton``, ``flashinfer``, ``sgl_kernel`` (``import x``,
  ``from x import y``, ``importlib.import_module("x")``, ``__import__("x")``);
- ``import torch.cuda`` / ``torch.npu``, ``from torch import cuda`` / ``npu``;
- attribute uses ``torch.cuda`` / ``torch.npu``, also through an alias (``import torch as t``).

Exit status 1 when anything is found, 0 otherwise. Usage: ``python ci/check_vendor_imports.py
[FOLDER ...]``.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

VENDOR_MODULES = frozenset({"torch_npu", "triton", "flashinfer", "sgl_kernel"})
TORCH_DEVICE_SUBMODULES = frozenset({"cuda", "npu"})
IMPORT_FUNCTIONS = frozenset({"import_module", "__import__"})


def _vendor_module(name: str) -> str | None:
    """The forbidden module ``name`` refers to, or None."""
    parts = name.split(".")
    if parts[0] in VENDOR_MODULES:
        return parts[0]
    if parts[0] == "torch" and len(parts) > 1 and parts[1] in TORCH_DEVICE_SUBMODULES:
        return f"torch.{parts[1]}"
    return None


def _torch_aliases(tree: ast.AST) -> set[str]:
    """Names bound to the torch module in this file (``torch`` plus ``import torch as t``)."""
    aliases = {"torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch" and alias.asname:
                    aliases.add(alias.asname)
    return aliases


def find_violations(source: str, filename: str) -> Iterator[tuple[int, str]]:
    """(line, message) for every vendor reference in ``source``."""
    tree = ast.parse(source, filename=filename)
    torch_names = _torch_aliases(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                hit = _vendor_module(alias.name)
                if hit:
                    yield node.lineno, f"imports {hit}"
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            hit = _vendor_module(node.module)
            if hit is None and node.module == "torch":
                names = {a.name for a in node.names} & TORCH_DEVICE_SUBMODULES
                hit = f"torch.{sorted(names)[0]}" if names else None
            if hit:
                yield node.lineno, f"imports {hit}"
        elif isinstance(node, ast.Attribute):
            if (
                node.attr in TORCH_DEVICE_SUBMODULES
                and isinstance(node.value, ast.Name)
                and node.value.id in torch_names
            ):
                yield node.lineno, f"uses torch.{node.attr}"
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            first = node.args[0]
            if (
                name in IMPORT_FUNCTIONS
                and isinstance(first, ast.Constant)
                and isinstance(first.value, str)
            ):
                hit = _vendor_module(first.value)
                if hit:
                    yield node.lineno, f"imports {hit} dynamically"


def scan(folders: list[Path]) -> list[str]:
    """``file:line: message`` lines for every violation under ``folders``, sorted."""
    found = []
    for folder in folders:
        files = [folder] if folder.is_file() else sorted(folder.rglob("*.py"))
        for path in files:
            try:
                source = path.read_text(encoding="utf-8")
                hits = list(find_violations(source, str(path)))
            except SyntaxError as exc:
                found.append(f"{path}:{exc.lineno}: cannot parse: {exc.msg}")
                continue
            found += [f"{path}:{line}: {message}" for line, message in hits]
    return found


def main(argv: list[str]) -> int:
    """Scan the folders in ``argv`` (default: core/ next to this script's parent)."""
    folders = [Path(a) for a in argv] or [Path(__file__).resolve().parent.parent / "core"]
    missing = [f for f in folders if not f.exists()]
    if missing:
        print(
            f"check_vendor_imports: no such path: {', '.join(map(str, missing))}", file=sys.stderr
        )
        return 2
    found = scan(folders)
    if found:
        print("core/ must not name vendor code (move it into backends/ or kernels/, or ask the")
        print("backend object instead):")
        for line in found:
            print(f"  {line}")
        return 1
    print(f"check_vendor_imports: ok ({', '.join(map(str, folders))})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
