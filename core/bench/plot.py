"""``--plot``: a PNG with the acceptance-length histogram and the throughput / speedup bars, or
with ``--batch-sizes`` tokens/s against the batch size."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from polyspec.errors import ConfigError


def require_matplotlib() -> None:
    """Raise a :class:`ConfigError` saying how to get matplotlib when it is missing (checked
    before the benchmark runs, so that a long run is not lost at the end)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError(
            "--plot needs matplotlib, which is not installed: `pip install matplotlib`, or drop "
            "--plot (the --json report holds the same numbers)"
        ) from None


def write_plot(report: Mapping[str, Any], path: str | Path) -> None:
    """Left: rounds per acceptance length (the speculative system; empty when it did not run).
    Right: tokens/s per system, each bar labelled with its speedup over transformers (or over
    plain decoding when the baseline was skipped)."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # no display needed; must precede pyplot's import
    import matplotlib.pyplot as plt

    fig, (ax_hist, ax_tps) = plt.subplots(1, 2, figsize=(10, 4))
    spec = report["systems"].get("spec")
    if spec:
        hist = spec["acceptance_length_histogram"]
        lengths = [int(k) for k in hist]
        ax_hist.bar(lengths, [hist[str(k)] for k in lengths], color="tab:blue")
        ax_hist.set_xticks(lengths)
        ax_hist.set_title(f"acceptance length (mean {spec['mean_acceptance_length']:.2f})")
    else:
        ax_hist.text(0.5, 0.5, "speculative decoding not run", ha="center", va="center")
        ax_hist.set_title("acceptance length")
    ax_hist.set_xlabel("tokens committed per round")
    ax_hist.set_ylabel("rounds")

    systems = report["systems"]
    names = list(systems)
    tps = [systems[n]["tokens_per_s"] for n in names]
    base_name = "transformers" if "transformers" in systems else "plain"
    base = systems.get(base_name, {}).get("tokens_per_s") or 0.0
    colors = {"plain": "tab:gray", "spec": "tab:green", "transformers": "tab:orange"}
    bars = ax_tps.bar(names, tps, color=[colors.get(n, "tab:blue") for n in names])
    for bar, value in zip(bars, tps):
        label = f"{value / base:.2f}x" if base > 0 else f"{value:.1f}"
        ax_tps.annotate(label, (bar.get_x() + bar.get_width() / 2, value), ha="center",
                        va="bottom")  # fmt: skip
    ax_tps.set_ylabel("tokens/s")
    ax_tps.set_title(f"throughput (labels: speedup over {base_name})")
    ax_tps.margins(y=0.12)  # room for the labels above the tallest bar
    _save(plt, fig, report["command"], 160, path)


def write_sweep_plot(report: Mapping[str, Any], path: str | Path) -> None:
    """``--batch-sizes``: tokens/s of each system against the batch size (log scales), each
    speculative point labelled with its speedup over plain decoding."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # no display needed; must precede pyplot's import
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogFormatter

    rows = report["batch_sweep"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system, color in (("plain", "tab:gray"), ("spec", "tab:green")):
        points = [(r["batch_size"], r[f"{system}_tokens_per_s"]) for r in rows]
        points = [(b, t) for b, t in points if t is not None]
        if points:
            ax.plot(*zip(*points), marker="o", color=color, label=system)
    for r in rows:
        if r["spec_over_plain"] is not None:
            ax.annotate(f"{r['spec_over_plain']:.2f}x", (r["batch_size"], r["spec_tokens_per_s"]),
                        textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(LogFormatter())  # 20, not 2 x 10^1
    ax.yaxis.set_minor_formatter(LogFormatter())
    ax.set_xticks([r["batch_size"] for r in rows], [str(r["batch_size"]) for r in rows])
    ax.set_xlabel("batch size (requests in flight)")
    ax.set_ylabel("tokens/s")
    ax.set_title("throughput by batch size (labels: speculative over plain)")
    ax.legend()
    _save(plt, fig, report["command"], 120, path)


def _save(plt, fig, command: str, width: int, path: str | Path) -> None:
    """Title ``fig`` with the command that made it (wrapped at ``width``), write it to
    ``path`` (its folder made if needed) and close it."""
    fig.suptitle("\n".join(textwrap.wrap(command, width)), fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
