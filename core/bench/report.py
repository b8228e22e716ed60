"""The benchmark's results as a JSON-ready dict, a text table and a markdown section."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from polyspec.bench import metrics
from polyspec.bench.runner import SystemResult

SYSTEM_ORDER = ("plain", "spec", "transformers")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info(backend_name: str, device: str) -> dict[str, Any]:
    """Where the numbers were measured: OS, CPU, library versions, backend and device."""
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch_num_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "transformers_version": _version("transformers"),
        "polyspec_version": _version("polyspec"),
        "backend": backend_name,
        "device": device,
    }


def system_entry(result: SystemResult, num_steps: int | None = None) -> dict[str, Any]:
    """One system's JSON entry; acceptance and phase statistics when ``num_steps`` is given
    (the speculative system)."""
    entry: dict[str, Any] = {
        "tokens_per_s": result.tokens_per_s,
        "num_tokens": result.num_tokens,
        "wall_s": result.wall_s,
    }
    if len(result.wall_s_runs) > 1:  # --repeats: wall_s is their median
        entry["wall_s_runs"] = list(result.wall_s_runs)
    if result.phase_seconds:
        entry["phase_seconds"] = dict(result.phase_seconds)
    if num_steps is not None:
        rounds = metrics.all_rounds(result.accepted_per_request)
        entry.update(
            mean_acceptance_length=metrics.mean_acceptance_length(rounds),
            num_rounds=len(rounds),
            acceptance_per_position=metrics.position_acceptance(rounds, num_steps),
            acceptance_length_histogram={
                str(k): v for k, v in metrics.acceptance_histogram(rounds, num_steps + 1).items()
            },
        )
        if result.phase_seconds:
            entry["phase_fractions"] = metrics.spec_phase_fractions(result.phase_seconds)
    return entry


def count_differing(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> int:
    """Prompts whose generated token ids differ between two systems."""
    return sum(1 for x, y in zip(a, b, strict=True) if list(x) != list(y))


def build_report(
    *,
    command: str,
    settings: Mapping[str, Any],
    machine: Mapping[str, Any],
    results: Mapping[str, SystemResult],
    num_steps: int | None,
    temperature: float,
    skipped: Mapping[str, str],
    sweep: Mapping[float, SystemResult] | None = None,
    categories: Sequence[str | None] | None = None,
) -> dict[str, Any]:
    """Everything ``--json`` writes. ``categories``: one per prompt (None where unknown);
    the speculative system then also reports its mean acceptance length per category. ``outputs_identical`` compares spec and plain token ids
    per prompt; it is None (n/a) when sampling (temperature > 0) or when either is missing."""
    systems = {
        name: system_entry(results[name], num_steps if name == "spec" else None)
        for name in SYSTEM_ORDER
        if name in results
    }
    tps = {name: results[name].tokens_per_s for name in results}
    report: dict[str, Any] = {
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": dict(settings),
        "machine": dict(machine),
        "systems": systems,
        "skipped": dict(skipped),
        "speedups": {
            "spec_over_plain": metrics.speedup(tps.get("spec"), tps.get("plain")),
            "spec_over_transformers": metrics.speedup(tps.get("spec"), tps.get("transformers")),
            "plain_over_transformers": metrics.speedup(tps.get("plain"), tps.get("transformers")),
        },
    }
    if categories is not None and "spec" in results and any(c for c in categories):
        by_cat: dict[str, list[int]] = {}
        for cat, rounds in zip(categories, results["spec"].accepted_per_request, strict=True):
            if cat:
                by_cat.setdefault(cat, []).extend(rounds)
        systems["spec"]["acceptance_by_category"] = {
            cat: metrics.mean_acceptance_length(r) for cat, r in sorted(by_cat.items()) if r
        }
    greedy = temperature == 0
    if greedy and "spec" in results and "plain" in results:
        differ = count_differing(results["spec"].outputs, results["plain"].outputs)
        report["outputs_identical"] = differ == 0
        report["outputs_differing"] = differ
    else:
        report["outputs_identical"] = None
        report["outputs_differing"] = None
        report["identity_check"] = (
            "n/a: sampling (temperature > 0)" if not greedy else "n/a: spec or plain not run"
        )
    if greedy and "transformers" in results and "plain" in results:
        # Informational: kernels and dequantisation differ, so near-ties may flip.
        report["transformers_outputs_differing_from_plain"] = count_differing(
            results["transformers"].outputs, results["plain"].outputs
        )
    if sweep:
        report["temperature_sweep"] = [
            {
                "temperature": t,
                "mean_acceptance_length": metrics.mean_acceptance_length(
                    metrics.all_rounds(r.accepted_per_request)
                ),
                "tokens_per_s": r.tokens_per_s,
                "num_tokens": r.num_tokens,
            }
            for t, r in sweep.items()
        ]
    return report


def write_json(report: Mapping[str, Any], path: str | Path) -> None:
    """Write the report as indented JSON (parent folders created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


def _fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def _identity(report: Mapping[str, Any]) -> str:
    if report["outputs_identical"] is None:
        return report.get("identity_check", "n/a")
    n = report["settings"].get("num_prompts")
    if report["outputs_identical"]:
        return f"yes (all {n} prompts)"
    return f"NO: {report['outputs_differing']} of {n} prompts differ"


def _table_rows(report: Mapping[str, Any]) -> list[list[str]]:
    """Rows: system, tokens/s, speedup vs transformers, speedup vs plain, acceptance length."""
    systems = report["systems"]
    hf = systems.get("transformers", {}).get("tokens_per_s")
    plain = systems.get("plain", {}).get("tokens_per_s")
    rows = []
    for name, entry in systems.items():
        tps = entry["tokens_per_s"]
        rows.append([
            name,
            _fmt(tps, ".1f"),
            _fmt(metrics.speedup(tps, hf), ".2f", "x"),
            _fmt(metrics.speedup(tps, plain), ".2f", "x"),
            _fmt(entry.get("mean_acceptance_length")),
        ])  # fmt: skip
    return rows


_HEADER = ["system", "tokens/s", "vs transformers", "vs plain", "mean accept len"]


def _details(report: Mapping[str, Any]) -> list[str]:
    """Lines on acceptance per position, phase shares, identity and skips."""
    lines = []
    spec = report["systems"].get("spec")
    if spec:
        pos = ", ".join(f"{p:.2f}" for p in spec["acceptance_per_position"])
        lines.append(f"acceptance rate per draft position (>= d accepted, d = 1..): {pos}")
        if "phase_fractions" in spec:
            ph = ", ".join(f"{k} {v:.0%}" for k, v in spec["phase_fractions"].items())
            lines.append(f"spec round time: {ph}")
        if spec.get("acceptance_by_category"):
            cats = sorted(spec["acceptance_by_category"].items(), key=lambda kv: -kv[1])
            lines.append(
                "mean acceptance length by category: " + ", ".join(f"{c} {a:.2f}" for c, a in cats)
            )
    settings = report.get("settings", {})
    if settings.get("rounds_by_tree"):
        trees = ", ".join(f"{t}: {n}" for t, n in settings["rounds_by_tree"].items())
        lines.append(f"spec engine rounds by draft tree (warm-up and repeats included): {trees}")
    for name, q in (settings.get("queued_rounds") or {}).items():
        lines.append(
            f"{name} rounds queued behind another (overlap_rounds): {q['queued']}, "
            f"{q['used']} of them used"
        )
    lines.append(f"spec and plain outputs identical: {_identity(report)}")
    if "transformers_outputs_differing_from_plain" in report:
        lines.append(
            "transformers outputs differing from plain (informational): "
            f"{report['transformers_outputs_differing_from_plain']}"
        )
    for row in report.get("temperature_sweep", []):
        lines.append(
            f"spec at temperature {row['temperature']:g}: mean acceptance length "
            f"{row['mean_acceptance_length']:.2f}, {row['tokens_per_s']:.1f} tokens/s"
        )
    for name, why in report["skipped"].items():
        lines.append(f"skipped {name}: {why}")
    runs = {n: e["wall_s_runs"] for n, e in report["systems"].items() if "wall_s_runs" in e}
    if runs:
        spread = ", ".join(f"{n} {min(w):.2f}-{max(w):.2f} s" for n, w in runs.items())
        lines.append(f"tokens/s from the median of {len(next(iter(runs.values())))} timed runs "
                     f"(wall time ranges: {spread})")  # fmt: skip
    return lines


def format_text(report: Mapping[str, Any]) -> str:
    """A plain-text summary for the terminal."""
    rows = [_HEADER] + _table_rows(report)
    widths = [max(len(r[i]) for r in rows) for i in range(len(_HEADER))]
    out = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(out + _details(report))


def format_markdown(report: Mapping[str, Any]) -> str:
    """A section for docs/benchmarks.md: heading, command, machine, table, details."""
    m, s = report["machine"], report["settings"]
    heading = (
        f"### {Path(str(s.get('target') or 'default target')).name} on {m['backend']} "
        f"({report['date'][:10]})"
    )
    machine = (
        f"{m['platform']}, {m['processor']}, {m['cpu_count']} CPUs "
        f"({m['torch_num_threads']} torch threads), torch {m['torch_version']}, "
        f"transformers {m['transformers_version'] or 'not installed'}, device {m['device']}"
    )
    workload = (
        f"{s['num_prompts']} prompts from {s['dataset']}, {s['max_new_tokens']} new tokens, "
        f"batch {s['batch_size']}, temperature {s['temperature']:g}, dtype {s['dtype']}"
    )
    if s.get("algorithm"):
        workload += (
            f", {s['algorithm']} draft {s.get('draft')}, num_steps {s['num_steps']}, "
            f"topk {s['topk']}, num_draft_tokens {s['num_draft_tokens']}"
        )
        if s.get("draft_quantization") not in (None, "none"):
            workload += f", {s['draft_quantization']} draft weights"
        if s.get("dynamic_depth"):
            workload += f", dynamic depth {s['dynamic_depth']:g}"
        if s.get("batch_trees"):
            workload += f", batch trees {','.join(s['batch_trees'])} (MIN:S-K-N)"
    table = ["| " + " | ".join(_HEADER) + " |", "|" + "---|" * len(_HEADER)]
    table += ["| " + " | ".join(r) + " |" for r in _table_rows(report)]
    parts = [
        heading,
        "",
        "```sh",
        report["command"],
        "```",
        "",
        f"Machine: {machine}.",
        "",
        f"Workload: {workload}.",
        "",
        *table,
        "",
        *[f"- {line}" for line in _details(report)],
        "",
    ]
    return "\n".join(parts)


def append_markdown(report: Mapping[str, Any], path: str | Path) -> None:
    """Append :func:`format_markdown` to ``path`` (created when absent)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lead = "\n" if path.is_file() and path.stat().st_size > 0 else ""
    with path.open("a", encoding="utf-8") as fh:
        fh.write(lead + format_markdown(report))


_SWEEP_HEADER = [
    "batch", "prompts", "plain tok/s", "spec tok/s", "spec/plain", "accept len", "tree",
]  # fmt: skip


def build_sweep_report(
    *,
    command: str,
    settings: Mapping[str, Any],
    machine: Mapping[str, Any],
    results: Mapping[str, Mapping[int, SystemResult]],
    trees: Mapping[int, Mapping[str, Any]],
    temperature: float,
    skipped: Mapping[str, str],
    engine: Mapping[str, Mapping[int, Mapping[str, int]]] | None = None,
) -> dict[str, Any]:
    """What ``--batch-sizes --json`` writes: one row per batch size in ``batch_sweep``.
    ``results``: system ("plain", "spec") -> batch size -> its run; ``trees``: batch size ->
    ``{"tree": the tree a full batch uses, "rounds_by_tree": rounds per tree in that batch
    size's runs}`` (the speculative system's); ``engine``: system -> batch size -> its
    engine's rounds and queued rounds (queued, used) over that size's runs, warm-up included."""
    engine = engine or {}
    rows = []
    for b in settings["batch_sizes"]:
        plain = results.get("plain", {}).get(b)
        spec = results.get("spec", {}).get(b)
        any_run = plain or spec
        identical = None
        if temperature == 0 and plain and spec:
            identical = count_differing(spec.outputs, plain.outputs) == 0
        rows.append({
            "batch_size": b,
            "num_prompts": len(any_run.outputs) if any_run else 0,
            "plain_tokens_per_s": plain.tokens_per_s if plain else None,
            "spec_tokens_per_s": spec.tokens_per_s if spec else None,
            "spec_over_plain": metrics.speedup(
                spec.tokens_per_s if spec else None, plain.tokens_per_s if plain else None
            ),
            "mean_acceptance_length": metrics.mean_acceptance_length(
                metrics.all_rounds(spec.accepted_per_request)
            ) if spec else None,
            "tree": trees.get(b, {}).get("tree"),
            "rounds_by_tree": trees.get(b, {}).get("rounds_by_tree"),
            "engine": {system: dict(by_size[b]) for system, by_size in engine.items() if b in by_size},
            "outputs_identical": identical,
            "wall_s_runs": {  # --repeats: each timed run's seconds (the median is taken)
                name: list(r.wall_s_runs)
                for name, r in (("plain", plain), ("spec", spec)) if r and len(r.wall_s_runs) > 1
            },
        })  # fmt: skip
    return {
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": dict(settings),
        "machine": dict(machine),
        "skipped": dict(skipped),
        "batch_sweep": rows,
    }


def format_sweep_text(report: Mapping[str, Any]) -> str:
    """The batch-size sweep as a plain-text table, then what was skipped and where outputs
    differ."""
    rows = [_SWEEP_HEADER]
    for r in report["batch_sweep"]:
        rows.append([
            str(r["batch_size"]),
            str(r["num_prompts"]),
            _fmt(r["plain_tokens_per_s"], ".1f"),
            _fmt(r["spec_tokens_per_s"], ".1f"),
            _fmt(r["spec_over_plain"], ".2f", "x"),
            _fmt(r["mean_acceptance_length"]),
            r["tree"] or "-",
        ])  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(_SWEEP_HEADER))]
    out = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    differ = [
        str(r["batch_size"]) for r in report["batch_sweep"] if r["outputs_identical"] is False
    ]
    if differ:
        out.append(f"spec and plain outputs differ at batch {', '.join(differ)}")
    for system in ("plain", "spec"):  # constrained plain rounds' forwards (overlap_rounds)
        used = [
            f"{r['batch_size']}: {e['queued_forwards_used']} of {e['queued_forwards']}"
            for r in report["batch_sweep"]
            if (e := r.get("engine", {}).get(system, {})).get("queued_forwards")
        ]
        if used:
            out.append(
                f"{system} constrained plain rounds' forwards queued, used: {', '.join(used)}"
            )
    for name, mem in (report["settings"].get("graph_memory") or {}).items():
        if mem.get("bytes") is not None:
            out.append(f"{name} graphs: {mem['graphs']}, {mem['bytes'] / 2**20:.0f} MiB")
        if mem.get("eager_from") is not None:
            out.append(f"{name}: batches of {mem['eager_from']} and more ran eagerly (memory)")
    out += [f"skipped {name}: {why}" for name, why in report["skipped"].items()]
    return "\n".join(out)
