"""``polyspec build-kernels``: compile the backends' just-in-time kernels now, ahead of a first run.

A backend that compiles kernels on first use (the cpu backend's ``rowinv.cpp``) implements the
plugin hook ``polyspec_build_kernels``; this command calls it for every available backend, or for
the one named by ``--backend``, so that a container image or a CI job pays the compile once. Exit
status 0 when every build succeeded, 1 when one could not build (the message says why).
"""

from __future__ import annotations

import argparse
import sys

EXIT_BUILD_FAILED = 1


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``polyspec build-kernels``."""
    p = subparsers.add_parser(
        "build-kernels",
        help="compile the backends' kernels for this machine now, ahead of a first run",
        description="Compile the kernels that backends otherwise build on first use (the cpu "
        "backend's row-invariant bf16 kernels), and say where they live. Exit status 1 when one "
        "cannot be built.",
    )
    p.add_argument(
        "--backend",
        metavar="NAME",
        default=None,
        help="only this backend (default: every available backend that has kernels to build)",
    )


def run(args: argparse.Namespace) -> int:
    """Build, then print one line per backend: where its kernels live, or why they could not be
    built (on stderr)."""
    from polyspec.plugins import PluginRegistry

    results = PluginRegistry().build_kernels(args.backend)
    if not results:
        which = f"backend '{args.backend}'" if args.backend else "no available backend"
        print(f"{which} has no kernels to build ahead of time")
        return 0
    status = 0
    for name, result in results:
        if result.built:
            print(f"{name}: kernels built ({result.detail}): {result.location}")
        else:
            print(
                f"polyspec: error: {name}: cannot build its kernels: {result.detail}",
                file=sys.stderr,
            )
            status = EXIT_BUILD_FAILED
    return status
