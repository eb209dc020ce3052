"""One airm_* definition: the window and percentile shared by the models' families and the front end."""

from __future__ import annotations

import inspect

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rngd_pd.frontend.metrics import FrontendMetrics
from rngd_pd.stubs import metrics
from rngd_pd.wire import airm_metrics as airm


def test_percentile() -> None:
    assert airm.percentile([], 90) == 0.0
    assert airm.percentile([5.0], 90) == 5.0
    assert airm.percentile(range(1, 11), 90) == pytest.approx(9.1)
    assert airm.percentile([3, 1, 2], 50) == 2


def _gauges(front: FrontendMetrics) -> dict[str, tuple[str, float]]:
    """The front end's airm_* gauges as a scrape reads them: name -> (help, value)."""
    out = {}
    for family in text_string_to_metric_families(front.render().decode()):
        if family.name.startswith("airm_"):
            (sample,) = family.samples
            out[family.name] = (family.documentation, sample.value)
    return out


def test_both_processes_compute_the_same_p90_over_the_same_window() -> None:
    front = FrontendMetrics()
    models = metrics.ServingMetrics("pd")
    for i in range(10):  # ttft 10..100 ms, tpot 1..10 ms
        front.finished(4, 11, 0.01 * (i + 1), 0.001 * (i + 1), 1.0)
        models.record_request(0.01 * (i + 1), 11, 0.01 * (i + 1) + 0.01 * (i + 1), end=float(i + 1))
    gauges, snap = _gauges(front), models.snapshot()
    assert gauges[airm.TTFT_P90][1] == pytest.approx(91.0) == snap[airm.TTFT_P90]
    assert gauges[airm.TPOT_P90][1] == pytest.approx(9.1) == snap[airm.TPOT_P90]
    assert {name: doc for name, (doc, _) in gauges.items()} == {
        n: airm.GAUGES[n] for n in (airm.TTFT_P90, airm.TPOT_P90, airm.TOK_S)
    }


def test_the_front_end_keeps_the_most_recent_window() -> None:
    front = FrontendMetrics()
    for _ in range(airm.WINDOW):
        front.finished(1, 2, 9.0, 9.0, 9.0)
    for _ in range(airm.WINDOW):
        front.finished(1, 2, 0.1, 0.1, 0.1)
    assert _gauges(front)[airm.TTFT_P90][1] == pytest.approx(100.0)
    assert inspect.signature(metrics.ServingMetrics).parameters["window"].default == airm.WINDOW == 512
