"""The front end's own Prometheus metrics (GET /metrics), in a registry of its own.

Histograms in seconds for dashboards, plus the gauges ai-rm scrapes from a gateway
(`airm_ttft_p90_ms`, `airm_tpot_p90_ms`, `airm_tok_s`) over the most recent 512 requests, as the
original gateway exported them, measured here at the HTTP edge (what a client sees). Their names,
window and percentile are those of the models' families (`rngd_pd.wire.airm_metrics`).
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rngd_pd.wire.airm_metrics import GAUGES, TOK_S, TPOT_P90, TTFT_P90, WINDOW, percentile

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_OVERHEAD_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2)

__all__ = ["CONTENT_TYPE", "FrontendMetrics"]


class FrontendMetrics:
    """Counters and timings of the requests this front end served."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        p = "rngd_pd_frontend_"
        self.requests = Counter(
            p + "requests",
            "Requests answered, by endpoint and HTTP status",
            ["endpoint", "status"],
            registry=r,
        )
        self.in_flight = Gauge(p + "requests_in_flight", "Requests being generated now", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.completion_tokens = Counter(
            p + "completion_tokens", "Generated tokens of finished requests", registry=r
        )
        self.cancelled = Counter(
            p + "cancelled_requests", "Requests whose client went away mid-generation", registry=r
        )
        self.ttft = Histogram(p + "ttft_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(
            p + "tpot_seconds",
            "Mean time per output token after the first",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            p + "request_seconds",
            "Request latency, arrival to last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.preprocess = Histogram(
            p + "preprocess_seconds",
            "Request arrival to the Triton request sent (parse, validate, tokenize)",
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        self.token_latency = Histogram(
            p + "token_latency_seconds",
            "A token's arrival from Triton to its SSE chunk being written (detokenize, stop strings, JSON)",
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        self._lock = threading.Lock()
        self._recent: deque[tuple[float, float | None, float | None, int]] = deque(maxlen=WINDOW)
        Gauge(TTFT_P90, GAUGES[TTFT_P90], registry=r).set_function(lambda: self._window_p90(1))
        Gauge(TPOT_P90, GAUGES[TPOT_P90], registry=r).set_function(lambda: self._window_p90(2))
        Gauge(TOK_S, GAUGES[TOK_S], registry=r).set_function(self._window_tok_s)

    def finished(
        self, prompt_tokens: int, completion_tokens: int, ttft: float | None, tpot: float | None, e2e: float
    ) -> None:
        """Record a request that ran to its end (not for rejected or cancelled ones)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(completion_tokens)
        if ttft is not None:
            self.ttft.observe(ttft)
        if tpot is not None:
            self.tpot.observe(tpot)
        self.e2e.observe(e2e)
        with self._lock:
            self._recent.append((time.monotonic(), ttft, tpot, completion_tokens))

    def _window_p90(self, index: int) -> float:
        with self._lock:
            values = [row[index] for row in self._recent if row[index] is not None]
        return 1000.0 * percentile(values, 90)  # type: ignore[arg-type]

    def _window_tok_s(self) -> float:
        with self._lock:
            rows = list(self._recent)
        if len(rows) < 2:
            return 0.0
        span = rows[-1][0] - rows[0][0]
        return sum(r[3] for r in rows[1:]) / span if span > 0 else 0.0

    def watch_server(self, status) -> None:
        """Export serve's restart count and readiness from its status file (a wire.status.StatusReader)."""
        self.registry.register(_ServerCollector(status))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ServerCollector:
    """`rngd_pd_server_restarts_total` and `rngd_pd_server_ready`, read from serve's status file."""

    def __init__(self, status) -> None:
        self.status = status

    def describe(self):
        return []  # collected on each scrape only: the file changes under us

    def collect(self):
        current = self.status.current()
        restarts = CounterMetricFamily(
            "rngd_pd_server_restarts",
            "Times rngd-pd serve restarted tritonserver (a model's stub died, or tritonserver exited)",
        )
        restarts.add_metric([], current.restarts)
        ready = GaugeMetricFamily(
            "rngd_pd_server_ready",
            "1 when rngd-pd serve says tritonserver answers; 0 while it starts or recovers",
        )
        ready.add_metric([], 1.0 if current.ready else 0.0)
        return [restarts, ready]
