"""``GET /metrics``: one Prometheus registry per server (prometheus-client, text format).

Two sources:

- latencies the server measures per request (:class:`ServerMetrics`): time to first token,
  inter-token latency (the gap between two streamed events divided by the tokens the later
  one brought: a speculative round that commits 4 tokens in 40 ms counts 4 gaps of 10 ms),
  end-to-end latency, requests by finish reason, and HTTP errors by status;
- the engine's own figures, read from ``EngineLoop.stats()`` at each scrape
  (:class:`EngineCollector`): requests running / waiting, KV slots used / free, prompt and
  generation tokens, engine rounds, the acceptance-length histogram, the acceptance rate per
  draft position, and the time spent drafting and verifying.

Every name starts with ``polyspec_``; docs/serving.md lists them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                    0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class EngineCollector(Collector):
    """Reads ``stats()`` (an :class:`~polyspec.engine.loop.EngineStats`) at scrape time;
    ``stats`` returns None while the model is loading (nothing is exported then)."""

    def __init__(
        self,
        stats: Callable[[], object | None],
        num_steps: Callable[[], int],
        reserved_kv: Callable[[], int],
    ):
        self._stats = stats
        self._num_steps = num_steps
        self._reserved_kv = reserved_kv

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        if s is None:
            return
        yield _gauge("polyspec_requests_running", "Requests admitted (prefilling or decoding).",
                     s.running)  # fmt: skip
        yield _gauge("polyspec_requests_waiting", "Requests waiting for admission.", s.waiting)
        reserved = self._reserved_kv()
        yield _gauge("polyspec_kv_slots_used", "KV cache slots held by requests.",
                     s.kv_slots_used - reserved)  # fmt: skip
        yield _gauge("polyspec_kv_slots_reserved",
                     "KV cache slots the worker holds for its own scratch (the draft lanes).",
                     reserved)  # fmt: skip
        yield _gauge("polyspec_kv_slots_free", "KV cache slots free.", s.kv_slots_free)
        yield _counter("polyspec_prompt_tokens", "Prompt tokens of finished requests.",
                       s.prompt_tokens_total)  # fmt: skip
        yield _counter("polyspec_generation_tokens", "Tokens generated (handed to requests).",
                       s.generation_tokens_total)  # fmt: skip
        yield _counter("polyspec_rounds", "Engine decode rounds (one forward of the batch).",
                       s.rounds_total)  # fmt: skip
        finished = CounterMetricFamily(
            "polyspec_engine_requests_finished",
            "Requests the engine finished, by finish reason (stop, length, abort, error).",
            labels=["finish_reason"],
        )
        for reason, n in sorted(s.requests_finished_total.items()):
            finished.add_metric([reason], n)
        yield finished
        yield _acceptance_histogram(s.acceptance_length_histogram, self._num_steps())
        rounds = sum(s.acceptance_length_histogram.values())
        rate = GaugeMetricFamily(
            "polyspec_acceptance_rate_per_position",
            "Fraction of request-rounds whose draft token at this depth was accepted.",
            labels=["position"],
        )
        for i, n in enumerate(_padded(s.accepted_per_position, self._num_steps())):
            rate.add_metric([str(i + 1)], n / rounds if rounds else 0.0)
        yield rate
        rounds_total = max(s.rounds_total, 1)
        per_round = GaugeMetricFamily(
            "polyspec_phase_seconds_per_round",
            "Mean seconds per decode round spent in each worker phase (draft, verify, ...), "
            "where the phase timer is on.",
            labels=["phase"],
        )
        totals = CounterMetricFamily(
            "polyspec_phase_seconds",
            "Seconds spent in each worker phase, where the phase timer is on.",
            labels=["phase"],
        )
        for name, seconds in sorted(s.phase_time_s_total.items()):
            per_round.add_metric([name], seconds / rounds_total)
            totals.add_metric([name], seconds)
        yield per_round
        yield totals
        yield _counter("polyspec_engine_step_seconds", "Wall seconds spent in engine steps.",
                       s.step_time_s_total)  # fmt: skip


def _padded(values: list[int], n: int) -> list[int]:
    return list(values[:n]) + [0] * max(0, n - len(values))


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _acceptance_histogram(hist: dict[int, int], num_steps: int) -> HistogramMetricFamily:
    """Tokens committed per request-round (accepted draft tokens + the bonus), buckets
    1..num_steps + 1 (plain decoding: every round is 1)."""
    top = max([num_steps + 1, *hist]) if hist else num_steps + 1
    buckets, cum = [], 0
    for length in range(1, top + 1):
        cum += hist.get(length, 0)
        buckets.append((str(float(length)), cum))
    buckets.append(("+Inf", cum))
    total = sum(length * n for length, n in hist.items())
    return HistogramMetricFamily(
        "polyspec_acceptance_length",
        "Tokens committed per request per decode round (accepted draft tokens + bonus).",
        buckets=buckets,
        sum_value=total,
    )


class ServerMetrics:
    """The registry of one server: the per-request latencies it measures and the engine's
    collector."""

    def __init__(
        self,
        engine_stats: Callable[[], object | None],
        num_steps: Callable[[], int],
        reserved_kv: Callable[[], int],
    ):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram(
            "polyspec_time_to_first_token_seconds",
            "From the request's arrival to its first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "polyspec_inter_token_latency_seconds",
            "Gap between streamed events divided by the tokens the later one brought.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "polyspec_e2e_request_latency_seconds",
            "From the request's arrival to its last token.",
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "polyspec_requests",
            "Generation requests (one per choice) answered, by finish reason.",
            ["finish_reason"],
            registry=r,
        )
        self.http_errors = Counter(
            "polyspec_http_errors",
            "Requests answered with an error status, by status.",
            ["status"],
            registry=r,
        )
        r.register(EngineCollector(engine_stats, num_steps, reserved_kv))

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
