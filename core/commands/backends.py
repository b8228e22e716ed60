"""``polyspec backends``: every discovered backend plugin, whether it can run here, and why not.

Listing imports no vendor runtime: it only calls the plugins' specs and cheap probes.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from polyspec.errors import PolyspecError
from polyspec.plugins import BackendReport, PluginRegistry

_CAPABILITY_FLAGS = (
    "graph_capture",
    "graph_needs_prepare",
    "tree_attention",
    "static_metadata",
    "async_execution",
    "async_host_reads",
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``polyspec backends``."""
    p = subparsers.add_parser(
        "backends",
        help="list backend plugins and whether they can run on this machine",
        description="List every backend plugin found in the 'polyspec.backends' entry-point "
        "group: availability and why, priority, distribution, capabilities.",
    )
    p.add_argument(
        "--json", action="store_true", help="print a JSON list of objects instead of a table"
    )


def capability_summary(capabilities: dict) -> str:
    """Compact one-line view of ``BackendCapabilities.to_dict()``."""
    if not capabilities:
        return "-"
    parts = [flag for flag in _CAPABILITY_FLAGS if capabilities.get(flag)]
    pages = capabilities.get("page_sizes")
    parts.append("pages=" + ("any" if pages is None else "/".join(str(p) for p in pages)))
    parts.append(f"index={capabilities.get('index_dtype')}")
    parts.append("dtypes=" + "/".join(capabilities.get("dtypes") or []))
    return " ".join(parts)


def format_table(reports: Sequence[BackendReport]) -> str:
    """Aligned table, one row per plugin, followed by one line per backend that is not
    available (``cuda: unavailable: <reason>``)."""
    header = ("NAME", "STATUS", "PRIORITY", "DISTRIBUTION", "CAPABILITIES")
    rows = [
        (
            r.name,
            r.status,
            "-" if r.priority is None else str(r.priority),
            f"{r.distribution} {r.version}",
            capability_summary(r.capabilities),
        )
        for r in reports
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths)) + "  " + row[-1]
        for row in [header, *rows]
    ]
    details = [r.summary() for r in reports if not r.available]
    if details:
        lines += ["", *details]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Print the reports; also say which backend would be selected by default."""
    registry = PluginRegistry()
    reports = registry.discover()
    if args.json:
        print(json.dumps([r.to_dict() for r in reports], indent=2))
        return 0
    if not reports:
        print("no backend plugin is installed (entry-point group 'polyspec.backends')")
        return 0
    print(format_table(reports))
    try:
        chosen = registry.select()
        print(f"\ndefault selection: {chosen.name}")
    except PolyspecError as exc:
        print(f"\ndefault selection: none: {exc}", file=sys.stderr)
    return 0
