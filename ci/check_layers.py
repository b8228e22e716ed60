#!/usr/bin/env python3
"""Fail when an import runs up the layers of docs/architecture.md ("Layers").

The layers, bottom to top, and the column each belongs to (the core stack and the vendor
stack stand side by side on the shared contract; neither imports the other):

====  ==========================================================  ========
rank  modules (``polyspec.`` omitted)                              column
====  ==========================================================  ========
0     errors                                                      shared
1     backend, hookspecs (THE contract)                           shared
2     kernels (reference, _tree, quant, triton)                   vendor
3     backends (its __init__), backends.common, backends.probing  vendor
4     backends.cpu, backends.cuda, backends.npu (peers)           vendor
5     config, defaults                                            core
6     plugins                                                     core
7     parallel (tensor parallelism: groups, shards, launch)       core
8     model                                                       core
9     runtime, constrain (grammars and token masks)               core
10    spec                                                        core
11    engine                                                      core
12    serve (the HTTP server on the engine loop)                  core
13    the package root, __main__, cli, commands, bench, train     core
14    testing (the conformance suite; imports any layer)          testing
====  ==========================================================  ========

A module may import a module of its own layer (a backend only its own package), or of a
lower layer in its own column or in the shared column; ``testing`` may import anything. So:
the contract imports nothing above ``errors``; ``kernels/`` never imports a backend; no backend
imports another (shared mechanism lives in ``backends/common``); the engine reaches kernels
and backends only through the contract's objects (``backend.kernels``, plugin discovery).
Every import counts: module level or inside a function, under ``TYPE_CHECKING`` or not,
relative, and ``importlib.import_module`` / ``__import__`` of a constant string. A module of
``polyspec`` that no layer names is an error too (a new folder must be placed).

Scans ``core/`` (``polyspec``), ``backends/`` and ``kernels/`` of the repository (default:
this script's parent's parent) and prints ``file:line: what`` per violation. Exit status 1
when anything is found, 0 otherwise. Usage: ``python ci/check_layers.py [REPO_ROOT]``.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

SOURCE_ROOTS = {"polyspec": "core", "polyspec.backends": "backends", "polyspec.kernels": "kernels"}
"""Import package -> folder of the repository (setup.py's mapping)."""

LAYERS: tuple[tuple[int, str, str, tuple[str, ...]], ...] = (
    (0, "errors", "shared", ("polyspec.errors",)),
    (1, "contract", "shared", ("polyspec.backend", "polyspec.hookspecs")),
    (2, "kernels", "vendor", ("polyspec.kernels",)),
    (3, "backends.common", "vendor", ("polyspec.backends", "polyspec.backends.common",
                                      "polyspec.backends.probing")),
    (4, "backends", "vendor", ("polyspec.backends.cpu", "polyspec.backends.cuda",
                              "polyspec.backends.npu")),
    (5, "config", "core", ("polyspec.config", "polyspec.defaults")),
    (6, "plugins", "core", ("polyspec.plugins",)),
    (7, "parallel", "core", ("polyspec.parallel",)),
    (8, "model", "core", ("polyspec.model",)),
    (9, "runtime", "core", ("polyspec.runtime", "polyspec.constrain")),
    (10, "spec", "core", ("polyspec.spec",)),
    (11, "engine", "core", ("polyspec.engine",)),
    (12, "serve", "core", ("polyspec.serve",)),
    (13, "app", "core", ("polyspec", "polyspec.__main__", "polyspec.cli", "polyspec.commands",
                         "polyspec.bench", "polyspec.train")),
    (14, "testing", "testing", ("polyspec.testing",)),
)  # fmt: skip
"""(rank, layer name, column, module prefixes). A module belongs to the layer of its longest
matching prefix (``polyspec.backends.cpu.rowinv`` -> ``backends``)."""

PEER_LAYERS = frozenset({"backends"})
"""Layers whose packages are peers: a module may import only its own package there."""

IMPORT_FUNCTIONS = frozenset({"import_module", "__import__"})


def layer_of(module: str) -> tuple[int, str, str, str] | None:
    """(rank, layer, column, matched prefix) of a ``polyspec`` module, or None."""
    best = None
    for rank, name, column, prefixes in LAYERS:
        for prefix in prefixes:
            # the package root names only itself, not every module under it
            if module == prefix or (prefix != "polyspec" and module.startswith(prefix + ".")):
                if best is None or len(prefix) > len(best[3]):
                    best = (rank, name, column, prefix)
    return best


def allowed(importer: str, imported: str) -> str | None:
    """None when ``importer`` may import ``imported``, else why not."""
    src, dst = layer_of(importer), layer_of(imported)
    if src is None:
        return f"{importer} is in no layer (add it to ci/check_layers.py and the docs)"
    if dst is None:
        return f"{imported} is in no layer (add it to ci/check_layers.py and the docs)"
    (src_rank, src_name, src_col, src_prefix), (dst_rank, dst_name, dst_col, dst_prefix) = src, dst
    if src_name == "testing":
        return None
    if src_name == dst_name:
        if src_name in PEER_LAYERS and src_prefix != dst_prefix:
            return (
                f"{src_prefix} imports another backend, {dst_prefix}: share through backends.common"
            )
        return None
    if dst_rank > src_rank:
        return f"{src_name} (rank {src_rank}) imports {dst_name} (rank {dst_rank}), above it"
    if dst_col not in (src_col, "shared"):
        return (
            f"{src_name} ({src_col} stack) imports {dst_name} ({dst_col} stack); the stacks meet "
            f"only at the contract"
        )
    return None


def module_name(path: Path, root: Path) -> str | None:
    """The ``polyspec`` module a file under one of :data:`SOURCE_ROOTS` is, or None."""
    rel = path.relative_to(root)
    for package, folder in sorted(SOURCE_ROOTS.items(), key=lambda kv: -len(kv[1])):
        if rel.parts and rel.parts[0] == folder:
            parts = list(rel.with_suffix("").parts[1:])
            if parts and parts[-1] == "__init__":
                parts.pop()
            return ".".join([package, *parts])
    return None


def _resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([target] if target else []))


def imports_of(source: str, filename: str, module: str, is_package: bool,
               known: set[str]) -> Iterator[tuple[int, str]]:  # fmt: skip
    """(line, imported ``polyspec`` module) for every import in ``source``."""
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                target = _resolve_relative(module, is_package, node.level, node.module)
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                yield node.lineno, sub if sub in known else target
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            first = node.args[0]
            if (
                name in IMPORT_FUNCTIONS
                and isinstance(first, ast.Constant)
                and isinstance(first.value, str)
            ):
                yield node.lineno, first.value


def scan(root: Path) -> list[str]:
    """``file:line: message`` for every import under ``root`` that runs up the layers."""
    files: dict[str, Path] = {}
    for folder in SOURCE_ROOTS.values():
        for path in sorted((root / folder).rglob("*.py")):
            name = module_name(path, root)
            if name is not None:
                files[name] = path
    known = set(files)
    found = []
    for name, path in files.items():
        rel = path.relative_to(root)
        if layer_of(name) is None:
            found.append(
                f"{rel}:1: {name} is in no layer (add it to ci/check_layers.py and the docs)"
            )
            continue
        try:
            hits = list(
                imports_of(path.read_text(encoding="utf-8"), str(path), name,
                           path.name == "__init__.py", known)
            )  # fmt: skip
        except SyntaxError as exc:
            found.append(f"{rel}:{exc.lineno}: cannot parse: {exc.msg}")
            continue
        for line, imported in hits:
            if imported != "polyspec" and not imported.startswith("polyspec."):
                continue
            problem = allowed(name, imported)
            if problem is not None:
                found.append(f"{rel}:{line}: {problem}")
    return sorted(set(found))


def main(argv: list[str]) -> int:
    """Scan the repository in ``argv[0]`` (default: this script's repository)."""
    root = Path(argv[0]) if argv else Path(__file__).resolve().parent.parent
    missing = [f for f in SOURCE_ROOTS.values() if not (root / f).is_dir()]
    if missing:
        print(f"check_layers: {root} has no {', '.join(missing)} folder", file=sys.stderr)
        return 2
    found = scan(root)
    if found:
        print("imports must not run up the layers (docs/architecture.md, 'Layers'):")
        for line in found:
            print(f"  {line}")
        return 1
    print(f"check_layers: ok ({root})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
