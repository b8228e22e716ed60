"""``polyspec`` command line: ``polyspec generate | bench | serve | bench-serve | backends | build-kernels |
train-draft``.

Each subcommand lives in its own module under :mod:`polyspec.commands` (see there for the
protocol). A :class:`~polyspec.errors.PolyspecError` is printed as ``polyspec: error: <message>``
on stderr with exit status 2 and no traceback; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import sys
from collections.abc import Sequence
from types import ModuleType

from polyspec.errors import PolyspecError

COMMAND_MODULES = (
    "generate",
    "bench",
    "serve",
    "bench_serve",
    "backends",
    "build_kernels",
    "train_draft",
)
"""Modules of :mod:`polyspec.commands`, in help order; ones not present yet are skipped."""

EXIT_USER_ERROR = 2


def _version() -> str:
    try:
        return importlib.metadata.version("polyspec")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def command_modules() -> list[ModuleType]:
    """The importable command modules; a module that does not exist is skipped, but an import
    error inside an existing module propagates (it is a bug, not a missing command)."""
    modules = []
    for name in COMMAND_MODULES:
        qualified = f"polyspec.commands.{name}"
        try:
            modules.append(importlib.import_module(qualified))
        except ModuleNotFoundError as exc:
            if exc.name != qualified:
                raise
    return modules


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one sub-parser per available command."""
    parser = argparse.ArgumentParser(
        prog="polyspec",
        description="Hardware-neutral EAGLE speculative decoding for PyTorch.",
    )
    parser.add_argument("--version", action="version", version=f"polyspec {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in command_modules():
        before = set(subparsers.choices)
        module.add_parser(subparsers)
        for name in set(subparsers.choices) - before:
            subparsers.choices[name].set_defaults(_run=module.run)
    return parser


def _one_line_warnings() -> None:
    """Print polyspec's configuration warnings as ``polyspec: warning: <message>``."""
    import warnings

    from polyspec.config import ConfigWarning

    plain = warnings.formatwarning

    def fmt(message, category, filename, lineno, line=None):
        if issubclass(category, ConfigWarning):
            return f"polyspec: warning: {message}\n"
        return plain(message, category, filename, lineno, line)

    warnings.formatwarning = fmt


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    _one_line_warnings()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version and usage errors
        return exc.code if isinstance(exc.code, int) else EXIT_USER_ERROR
    try:
        return int(args._run(args) or 0)
    except PolyspecError as exc:
        print(f"polyspec: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("polyspec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left early (`polyspec backends | head -3`)
        # Python flushes stdout at exit: point it at /dev/null so that flush cannot fail too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13  # as a shell reports SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
