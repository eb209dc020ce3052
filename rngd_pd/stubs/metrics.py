"""The airm_* metrics ai-rm scrapes, exported from the Python models as Triton custom metric families.

Gauges over the most recent 512 requests (the names of the original system; names, window and
percentile are defined once in `rngd_pd.wire.airm_metrics`, which the front end's /metrics uses too):

* `airm_ttft_p90_ms`  p90 time to first token
* `airm_tpot_p90_ms`  p90 time per output token after the first
* `airm_tok_s`        output tokens per second: the window's tokens over the wall time it spans
* `airm_kv_transfer_ms{kv_transport=...}` median KV transfer time per request (push + pull)

plus histograms in seconds for dashboards (`airm_ttft_seconds`, `airm_tpot_seconds`,
`airm_kv_transfer_seconds`). Triton 2.51's Python backend has COUNTER, GAUGE and HISTOGRAM families.
Every metric carries a `model` label so two models of one server never write the same series.

For llm-d's endpoint picker, each server also exposes the load gauges it scores pods on, one series
per name and no labels (the EPP config's `engineConfigs` entry names them; deploy/helm):

* `rngd_pd_requests_waiting`      requests admitted but not started (queued)
* `rngd_pd_requests_running`      requests being served
* `rngd_pd_kv_cache_usage_ratio`  0..1: decode slots holding a request's KV over all slots (the
  static cache's allocation unit; 1.0 = the next request waits)

Prefix reuse and conditional disaggregation (issue 13), counters in tokens and requests:

* `rngd_pd_prefix_cache_queries_total` / `rngd_pd_prefix_cache_hits_total`  prompt tokens looked up
  in the prefill instances' prefix caches / served from them (vLLM's pair; hit rate = hits / queries)
* `rngd_pd_prefix_cache_hit_rate`  the same ratio since start, per model, for a glance
* `rngd_pd_prefill_requests_total{path=remote|local}`  pd's requests prefilled by the prefill model
  (the hand-off) or by the decode instance itself (short prompts, no hand-off)

Exactly one model per server publishes them, by the server's role (`RNGD_PD_ROLE`, set by
`rngd-pd serve --role`; plain tritonserver = all): decode where decode runs (all, decode), pd on a
gateway (its own queue; the KV lives on the decode servers: 0), prefill on a prefill server (its
queue; it holds no KV after a hand-off: 0). `LoadGauges` samples the model's state on one thread.

`ServingMetrics` holds the windows and computes the values in plain Python (a test drives it with a
recording sink); `TritonSink` writes them through `pb_utils.MetricFamily` inside a model.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from rngd_pd.config.env import RNGD_PD_ROLE
from rngd_pd.stubs import pbutils
from rngd_pd.wire.airm_metrics import (
    GAUGES,
    HISTOGRAMS,
    KV_HIST,
    KV_TRANSFER,
    TOK_S,
    TPOT_HIST,
    TPOT_P90,
    TTFT_HIST,
    TTFT_P90,
    WINDOW,
    percentile,
)

REQUESTS_WAITING = "rngd_pd_requests_waiting"
REQUESTS_RUNNING = "rngd_pd_requests_running"
KV_USAGE = "rngd_pd_kv_cache_usage_ratio"
LOAD_GAUGES: dict[str, str] = {
    REQUESTS_WAITING: "requests admitted and waiting to start (for the endpoint picker)",
    REQUESTS_RUNNING: "requests being served (for the endpoint picker)",
    KV_USAGE: "fraction 0..1 of decode KV slots in use (for the endpoint picker)",
}
PREFIX_QUERIES = "rngd_pd_prefix_cache_queries_total"
PREFIX_HITS = "rngd_pd_prefix_cache_hits_total"
PREFIX_HIT_RATE = "rngd_pd_prefix_cache_hit_rate"
PREFILL_PATH = "rngd_pd_prefill_requests_total"
KV_EVENTS = "rngd_pd_kv_events_batches_total"
COUNTERS: dict[str, str] = {
    KV_EVENTS: "KV event batches by outcome: queued (published) or dropped (the queue was full)",
    PREFIX_QUERIES: "prompt tokens looked up in the prefix cache",
    PREFIX_HITS: "prompt tokens whose KV came from the prefix cache (not computed)",
    PREFILL_PATH: "requests by where their prompt was prefilled: remote (hand-off) or local (decode)",
}
FEATURE_GAUGES: dict[str, str] = {PREFIX_HIT_RATE: "prefix cache hits over queries (tokens) since start"}
LOAD_PUBLISHER = {"all": "decode", "decode": "decode", "gateway": "pd", "prefill": "prefill"}
BUCKETS: dict[str, list[float]] = {
    TTFT_HIST: [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0],
    TPOT_HIST: [0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5],
    KV_HIST: [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0],
}


@dataclass(frozen=True)
class Load:
    """A model's load as the endpoint picker reads it."""

    waiting: int
    running: int
    kv_usage: float = 0.0


def publishes_load(model: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether `model` publishes this server's load gauges (one model per server; module docstring)."""
    return LOAD_PUBLISHER.get(RNGD_PD_ROLE.get(env)) == model


class LoadGauges:
    """Writes `sample()` to the three load gauges every `every_s` seconds, on one thread."""

    def __init__(self, sample: Callable[[], Load], sink: Sink, every_s: float = 0.5) -> None:
        self.sample, self.sink, self.every_s = sample, sink, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-gauges", daemon=True)
        self._thread.start()

    def publish(self) -> Load:
        load = self.sample()
        self.sink.set_gauge(REQUESTS_WAITING, {}, load.waiting)
        self.sink.set_gauge(REQUESTS_RUNNING, {}, load.running)
        self.sink.set_gauge(KV_USAGE, {}, min(1.0, max(0.0, load.kv_usage)))
        return load

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.publish()
            except Exception:  # a sample must never take the model down; the next one may work
                pass
            self._stop.wait(self.every_s)

    def close(self) -> None:
        """Stop sampling (call before the sink's metrics are dropped)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)


def load_gauges(model: str, sample: Callable[[], Load], sink: Sink,
                env: Mapping[str, str] | None = None) -> LoadGauges | None:
    """The load gauges when `model` is this server's publisher, else None."""
    return LoadGauges(sample, sink) if publishes_load(model, env) else None


class Sink(Protocol):
    """Where metric values go. Called with the ServingMetrics lock held; must not block long."""

    def set_gauge(self, name: str, labels: dict[str, str], value: float) -> None: ...
    def observe(self, name: str, labels: dict[str, str], value: float) -> None: ...
    def increment(self, name: str, labels: dict[str, str], value: float) -> None: ...


@dataclass(frozen=True)
class _Request:
    start: float
    end: float
    tokens: int


class ServingMetrics:
    """Windows of the most recent requests and the airm_* values computed from them; thread-safe."""

    def __init__(self, model: str, sink: Sink | None = None, window: int = WINDOW) -> None:
        self.labels = {"model": model}
        self.sink = sink
        self._lock = threading.Lock()
        self._ttft: deque[float] = deque(maxlen=window)
        self._tpot: deque[float] = deque(maxlen=window)
        self._requests: deque[_Request] = deque(maxlen=window)
        self._kv: dict[str, deque[float]] = {}
        self._window = window
        self._prefix = [0, 0]  # tokens queried, hit

    def record_request(self, ttft_s: float, output_tokens: int, total_s: float,
                       end: float | None = None) -> None:
        """One finished request: time to first token, tokens produced, total time (seconds)."""
        end = time.monotonic() if end is None else end
        tpot = (total_s - ttft_s) / (output_tokens - 1) if output_tokens > 1 else None
        with self._lock:
            self._ttft.append(ttft_s)
            self._requests.append(_Request(end - total_s, end, output_tokens))
            if tpot is not None:
                self._tpot.append(tpot)
            self._publish_requests(ttft_s, tpot)

    def record_kv_transfer(self, seconds: float, transport: str) -> None:
        """One request's KV transfer time (push + pull, or the side this process sees)."""
        with self._lock:
            window = self._kv.setdefault(transport, deque(maxlen=self._window))
            window.append(seconds)
            if self.sink is not None:
                labels = {**self.labels, "kv_transport": transport}
                self.sink.set_gauge(KV_TRANSFER, labels, percentile(window, 50) * 1e3)
                self.sink.observe(KV_HIST, labels, seconds)

    def record_prefix(self, queried_tokens: int, hit_tokens: int) -> None:
        """One prefill's prefix cache lookup (prompt tokens, tokens reused)."""
        with self._lock:
            self._prefix[0] += queried_tokens
            self._prefix[1] += hit_tokens
            if self.sink is not None:
                self.sink.increment(PREFIX_QUERIES, self.labels, queried_tokens)
                self.sink.increment(PREFIX_HITS, self.labels, hit_tokens)
                self.sink.set_gauge(PREFIX_HIT_RATE, self.labels, self._prefix[1] / max(1, self._prefix[0]))

    def record_kv_events(self, published: int, dropped: int) -> None:
        """KV event batches queued and dropped since the last call (docs/kv-events.md)."""
        with self._lock:
            if self.sink is not None:
                for outcome, n in (("published", published), ("dropped", dropped)):
                    if n:
                        self.sink.increment(KV_EVENTS, {**self.labels, "outcome": outcome}, n)

    def record_prefill_path(self, local: bool) -> None:
        """Where one request's prompt was prefilled (conditional disaggregation)."""
        with self._lock:
            if self.sink is not None:
                self.sink.increment(PREFILL_PATH, {**self.labels, "path": "local" if local else "remote"}, 1)

    def close(self) -> None:
        """Drop the sink's Triton metric objects; call from the model's `finalize` (the stub crashes
        when they are freed at interpreter exit, after its shared memory is gone)."""
        with self._lock:
            close = getattr(self.sink, "close", None)
            if close is not None:
                close()

    def snapshot(self) -> dict[str, Any]:
        """The current gauge values (ms, tokens/s) and window sizes."""
        with self._lock:
            return {
                TTFT_P90: percentile(self._ttft, 90) * 1e3,
                TPOT_P90: percentile(self._tpot, 90) * 1e3,
                TOK_S: self._tok_s(),
                KV_TRANSFER: {name: percentile(w, 50) * 1e3 for name, w in self._kv.items()},
                "requests": len(self._requests),
                PREFIX_HIT_RATE: self._prefix[1] / max(1, self._prefix[0]),
            }

    def _tok_s(self) -> float:
        if not self._requests:
            return 0.0
        span = max(r.end for r in self._requests) - min(r.start for r in self._requests)
        tokens = sum(r.tokens for r in self._requests)
        return tokens / span if span > 0 else 0.0

    def _publish_requests(self, ttft_s: float, tpot: float | None) -> None:
        if self.sink is None:
            return
        self.sink.set_gauge(TTFT_P90, self.labels, percentile(self._ttft, 90) * 1e3)
        self.sink.set_gauge(TPOT_P90, self.labels, percentile(self._tpot, 90) * 1e3)
        self.sink.set_gauge(TOK_S, self.labels, self._tok_s())
        self.sink.observe(TTFT_HIST, self.labels, ttft_s)
        if tpot is not None:
            self.sink.observe(TPOT_HIST, self.labels, tpot)


class TritonSink:
    """Writes through `pb_utils.MetricFamily` (create families once per process, metrics per label set).

    Call `close()` from the model's `finalize` (metrics must be dropped before their families).
    """

    def __init__(self) -> None:
        self._families: dict[str, Any] = {}
        self._metrics: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}

    def _metric(self, name: str, labels: dict[str, str]) -> Any:
        key = (name, tuple(sorted(labels.items())))
        metric = self._metrics.get(key)
        if metric is None:
            family = self._families.get(name)
            if family is None:
                kind = "HISTOGRAM" if name in HISTOGRAMS else "COUNTER" if name in COUNTERS else "GAUGE"
                described = {**GAUGES, **LOAD_GAUGES, **FEATURE_GAUGES, **HISTOGRAMS, **COUNTERS}
                family = pbutils.metric_family(name, described[name], kind)
                self._families[name] = family
            extra = {"buckets": BUCKETS[name]} if name in HISTOGRAMS else {}
            metric = self._metrics[key] = family.Metric(labels=labels, **extra)
        return metric

    def set_gauge(self, name: str, labels: dict[str, str], value: float) -> None:
        self._metric(name, labels).set(float(value))

    def observe(self, name: str, labels: dict[str, str], value: float) -> None:
        self._metric(name, labels).observe(float(value))

    def increment(self, name: str, labels: dict[str, str], value: float) -> None:
        if value:
            self._metric(name, labels).increment(float(value))

    def close(self) -> None:
        self._metrics.clear()
        self._families.clear()


def triton_metrics(model: str) -> ServingMetrics:
    """ServingMetrics for a model running inside Triton, exporting on Triton's metrics port."""
    return ServingMetrics(model, TritonSink())
