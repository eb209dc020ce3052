"""airm_* values over the most recent requests, as the sink (Triton's metric families) receives them."""

from __future__ import annotations

import pytest

from rngd_pd.stubs import metrics
from rngd_pd.wire import airm_metrics as airm


class RecordingSink:
    def __init__(self) -> None:
        self.gauges: dict[tuple, float] = {}
        self.observed: list[tuple] = []
        self.counters: dict[tuple, float] = {}

    def set_gauge(self, name: str, labels: dict, value: float) -> None:
        self.gauges[(name, tuple(sorted(labels.items())))] = value

    def observe(self, name: str, labels: dict, value: float) -> None:
        self.observed.append((name, labels.get("kv_transport"), value))

    def increment(self, name: str, labels: dict, value: float) -> None:
        key = (name, tuple(sorted(labels.items())))
        self.counters[key] = self.counters.get(key, 0) + value


def test_request_gauges_and_histograms() -> None:
    sink = RecordingSink()
    m = metrics.ServingMetrics("pd", sink)
    for i in range(10):  # ttft 10..100 ms, 11 tokens in 0.1 s + ttft, back to back
        ttft = 0.01 * (i + 1)
        m.record_request(ttft, 11, ttft + 0.1, end=float(i + 1))
    snap = m.snapshot()
    assert snap[airm.TTFT_P90] == pytest.approx(91.0)
    assert snap[airm.TPOT_P90] == pytest.approx(10.0)
    # 110 tokens between the first start (1 - 0.11) and the last end (10)
    assert snap[airm.TOK_S] == pytest.approx(110 / (10 - 0.89))
    assert sink.gauges[(airm.TTFT_P90, (("model", "pd"),))] == pytest.approx(91.0)
    assert sum(1 for o in sink.observed if o[0] == airm.TTFT_HIST) == 10


def test_window_keeps_most_recent_requests() -> None:
    m = metrics.ServingMetrics("pd", window=4)
    for ttft in (9.0, 9.0, 9.0, 9.0, 0.1, 0.1, 0.1, 0.1):
        m.record_request(ttft, 1, ttft)
    snap = m.snapshot()
    assert snap["requests"] == 4 and snap[airm.TTFT_P90] == pytest.approx(100.0)
    assert snap[airm.TPOT_P90] == 0.0  # single-token requests have no TPOT


def test_kv_transfer_median_per_transport() -> None:
    sink = RecordingSink()
    m = metrics.ServingMetrics("decode", sink)
    for s in (0.001, 0.003, 0.002):
        m.record_kv_transfer(s, "shm")
    m.record_kv_transfer(0.5, "tcp")
    key = (airm.KV_TRANSFER, (("kv_transport", "shm"), ("model", "decode")))
    assert sink.gauges[key] == pytest.approx(2.0)
    assert m.snapshot()[airm.KV_TRANSFER] == {"shm": pytest.approx(2.0), "tcp": pytest.approx(500.0)}


@pytest.mark.parametrize(("role", "publisher"), [(None, "decode"), ("all", "decode"), ("decode", "decode"),
                                                 ("gateway", "pd"), ("prefill", "prefill")])
def test_one_model_per_server_publishes_the_load_gauges(role, publisher) -> None:
    env = {} if role is None else {"RNGD_PD_ROLE": role}
    models = ("pd", "decode", "prefill", "colocated")
    assert [m for m in models if metrics.publishes_load(m, env)] == [publisher]


def test_load_gauges_are_one_unlabelled_series_each_and_clamped() -> None:
    sink = RecordingSink()
    current = [metrics.Load(3, 8, 1.25)]
    gauges = metrics.LoadGauges(lambda: current[0], sink, every_s=3600)
    gauges.close()
    gauges.publish()
    assert sink.gauges == {(metrics.REQUESTS_WAITING, ()): 3, (metrics.REQUESTS_RUNNING, ()): 8,
                           (metrics.KV_USAGE, ()): 1.0}
    current[0] = metrics.Load(0, 1, 0.125)
    gauges.publish()
    assert sink.gauges[(metrics.KV_USAGE, ())] == 0.125 and len(sink.gauges) == 3
    assert metrics.load_gauges("pd", lambda: metrics.Load(0, 0), sink, {"RNGD_PD_ROLE": "all"}) is None


def test_prefix_and_prefill_path_counters() -> None:
    sink = RecordingSink()
    m = metrics.ServingMetrics("prefill", sink)
    m.record_prefix(100, 0)
    m.record_prefix(100, 96)
    labels = (("model", "prefill"),)
    assert sink.counters[(metrics.PREFIX_QUERIES, labels)] == 200
    assert sink.counters[(metrics.PREFIX_HITS, labels)] == 96
    assert sink.gauges[(metrics.PREFIX_HIT_RATE, labels)] == pytest.approx(0.48)
    assert m.snapshot()[metrics.PREFIX_HIT_RATE] == pytest.approx(0.48)
    m.record_prefill_path(local=True)
    m.record_prefill_path(local=False)
    m.record_prefill_path(local=True)
    assert sink.counters[(metrics.PREFILL_PATH, (("model", "prefill"), ("path", "local")))] == 2
    assert sink.counters[(metrics.PREFILL_PATH, (("model", "prefill"), ("path", "remote")))] == 1
