"""The serving benchmark's client side (``polyspec bench-serve``): drive a server with the
``openai`` client at a given concurrency (and optionally a Poisson request rate), time each
streamed request, and summarise.

Per request: time to first token (TTFT: from sending to the first chunk with text),
end-to-end latency (to the last chunk), output tokens (the server's ``usage``) and the
request's inter-token latency, ``(e2e - TTFT) / (output tokens - 1)``: a speculative round
that commits several tokens at once spreads its gap over them, so plain and speculative
serving are compared per token. Per run: request throughput and output tokens/s over the run's
wall time, p50 / p90 / p99 of the three latencies, and the mean acceptance length from the
server's ``/metrics`` (its change over the run).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclasses.dataclass(frozen=True)
class RequestRecord:
    """One streamed request as the client saw it."""

    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    output_tokens: int = 0
    error: str | None = None

    @property
    def itl_s(self) -> float | None:
        """Mean gap between this request's tokens after the first (None with < 2 tokens)."""
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """``{"p50": .., "p90": .., "p99": ..}`` in milliseconds (None when there are no values)."""
    if not values:
        return {f"p{p}": None for p in PERCENTILES}
    arr = np.asarray(values, dtype=np.float64) * 1000.0
    return {f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}


def summarize(records: Sequence[RequestRecord], wall_s: float) -> dict[str, Any]:
    """The figures of one run (one system at one concurrency)."""
    ok = [r for r in records if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    itl = [r.itl_s for r in ok if r.itl_s is not None]
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "wall_s": wall_s,
        "output_tokens": tokens,
        "request_throughput": len(ok) / wall_s if wall_s > 0 else 0.0,
        "output_tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "ttft_ms": percentiles([r.ttft_s for r in ok]),
        "itl_ms": percentiles(itl),
        "e2e_ms": percentiles([r.e2e_s for r in ok]),
    }


def scrape_acceptance(base_url: str) -> tuple[float, float] | None:
    """(sum, count) of ``polyspec_acceptance_length`` from ``/metrics`` (None when the server
    does not export it, e.g. another server behind ``--base-url``)."""
    from prometheus_client.parser import text_string_to_metric_families

    root = base_url.removesuffix("/").removesuffix("/v1")
    try:
        with urllib.request.urlopen(root + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    for family in text_string_to_metric_families(text):
        if family.name == "polyspec_acceptance_length":
            values = {s.name: s.value for s in family.samples}
            return values.get(family.name + "_sum", 0.0), values.get(family.name + "_count", 0.0)
    return None


def mean_acceptance(before: tuple[float, float] | None, after: tuple[float, float] | None):
    """Mean tokens per request-round between two scrapes (None when unknown or no rounds)."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


@dataclasses.dataclass(frozen=True)
class Load:
    """What one run sends: each prompt once, as a chat turn (or raw text with ``chat=False``)."""

    model: str
    prompts: list[str]
    max_tokens: int
    temperature: float = 0.0
    ignore_eos: bool = False
    chat: bool = True


async def _one(client, load: Load, prompt: str) -> RequestRecord:
    extra = {"ignore_eos": True} if load.ignore_eos else None
    common = dict(
        model=load.model,
        max_tokens=load.max_tokens,
        temperature=load.temperature,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    try:
        if load.chat:
            stream = await client.chat.completions.create(
                messages=[{"role": "user", "content": prompt}], **common
            )
        else:
            stream = await client.completions.create(prompt=prompt, **common)
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                text = choice.delta.content if load.chat else choice.text
                if text:
                    now = time.perf_counter()
                    first = first or now
                    last = now
    except Exception as exc:  # a failed request is counted, the run goes on
        return RequestRecord(ok=False, error=f"{type(exc).__name__}: {exc}"[:200])
    if first is None:
        first = last = time.perf_counter()
    return RequestRecord(ok=True, ttft_s=first - t0, e2e_s=last - t0, output_tokens=tokens)


async def _drive(
    base_url: str,
    api_key: str,
    load: Load,
    concurrency: int,
    request_rate: float | None,
    seed: int,
    on_done: Callable[[], None],
) -> tuple[list[RequestRecord], float]:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=3600)
    limit = asyncio.Semaphore(concurrency)
    rng = random.Random(seed)

    async def bounded(prompt: str) -> RequestRecord:
        async with limit:
            record = await _one(client, load, prompt)
        on_done()
        return record

    t0 = time.perf_counter()
    tasks = []
    for prompt in load.prompts:
        tasks.append(asyncio.ensure_future(bounded(prompt)))
        if request_rate is not None:  # Poisson arrivals
            await asyncio.sleep(rng.expovariate(request_rate))
    records = await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    await client.close()
    return list(records), wall


def run_load(
    base_url: str,
    load: Load,
    concurrency: int,
    request_rate: float | None = None,
    api_key: str = "none",
    seed: int = 0,
    on_done: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Send every prompt of ``load`` at ``concurrency`` (and ``request_rate`` requests/s when
    given); -> :func:`summarize`'s figures plus ``mean_acceptance_length``."""
    before = scrape_acceptance(base_url)
    records, wall = asyncio.run(
        _drive(base_url, api_key, load, concurrency, request_rate, seed, on_done)
    )
    out = summarize(records, wall)
    out["mean_acceptance_length"] = mean_acceptance(before, scrape_acceptance(base_url))
    return out


def ratios(spec: dict[str, Any], plain: dict[str, Any]) -> dict[str, float | None]:
    """Speculative over plain at one concurrency: throughputs as spec / plain (higher is
    better for spec), latencies as plain / spec (higher is better for spec too)."""

    def div(a, b):
        return a / b if a and b else None

    out = {
        "request_throughput": div(spec["request_throughput"], plain["request_throughput"]),
        "output_tokens_per_s": div(spec["output_tokens_per_s"], plain["output_tokens_per_s"]),
    }
    for key in ("ttft_ms", "itl_ms", "e2e_ms"):
        for p, value in spec[key].items():
            out[f"{key}_{p}_speedup"] = div(plain[key][p], value)
    return out


def format_table(report: dict[str, Any]) -> str:
    """A plain-text table: one row per system and concurrency, then the spec / plain ratios."""
    head = (
        f"{'system':<8}{'conc':>5}{'req/s':>8}{'out tok/s':>11}{'TTFT p50/p90/p99 ms':>24}"
        f"{'ITL p50/p90/p99 ms':>24}{'e2e p50/p90/p99 ms':>26}{'acc len':>9}{'fail':>6}"
    )
    lines = [head]

    def triple(d):
        return "/".join("-" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.1f}" for v in
                        d.values())  # fmt: skip

    for system, runs in report["systems"].items():
        for conc, r in runs.items():
            acc = r.get("mean_acceptance_length")
            lines.append(
                f"{system:<8}{conc:>5}{r['request_throughput']:>8.2f}"
                f"{r['output_tokens_per_s']:>11.1f}{triple(r['ttft_ms']):>24}"
                f"{triple(r['itl_ms']):>24}{triple(r['e2e_ms']):>26}"
                f"{'-' if acc is None else f'{acc:.2f}':>9}{r['failed']:>6}"
            )
    for conc, rat in (report.get("ratios") or {}).items():
        tps = rat["output_tokens_per_s"]
        itl = rat["itl_ms_p50_speedup"]
        lines.append(
            f"spec/plain at concurrency {conc}: output tok/s x{tps:.2f}"
            if tps
            else f"spec/plain at concurrency {conc}: output tok/s -"
        )
        lines[-1] += f", median ITL {itl:.2f}x better" if itl else ""
    for system, off in (report.get("offline") or {}).items():
        lines.append(
            f"{system}: one request at a time, server {off['server_tokens_per_s']:.2f} tok/s vs "
            f"LLM.generate {off['generate_tokens_per_s']:.2f} tok/s = {off['ratio']:.3f} "
            "(interleaved prompt by prompt)"
        )
    return "\n".join(lines)


def write_plot(report: dict[str, Any], path: str) -> None:
    """Latency vs throughput, one curve per system, each point labelled with its concurrency:
    median inter-token latency vs output tokens/s, and median TTFT vs request throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_itl, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"spec": "tab:green", "plain": "tab:gray"}
    for system, runs in report["systems"].items():
        concs = list(runs)
        for ax, x_key, y_key in (
            (ax_itl, "output_tokens_per_s", "itl_ms"),
            (ax_ttft, "request_throughput", "ttft_ms"),
        ):
            xs = [runs[c][x_key] for c in concs]
            ys = [runs[c][y_key]["p50"] or 0.0 for c in concs]
            ax.plot(xs, ys, "o-", label=system, color=colors.get(system))
            for c, x, y in zip(concs, xs, ys):
                ax.annotate(str(c), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax_itl.set_xlabel("output tokens/s")
    ax_itl.set_ylabel("median inter-token latency (ms)")
    ax_ttft.set_xlabel("requests/s")
    ax_ttft.set_ylabel("median time to first token (ms)")
    for ax in (ax_itl, ax_ttft):
        ax.grid(alpha=0.3)
        ax.legend(title="labels: concurrency", fontsize=8)
    fig.suptitle(report["command"][:200], fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
