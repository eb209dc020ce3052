"""The airm_* metric families ai-rm scrapes: their names, the window and the percentile, defined once.

Two processes export them and both compute them from here, so a gateway's front end and its models
cannot disagree on what "p90 over the most recent 512 requests" means:

* the Python models, as Triton custom metric families on Triton's metrics port (:8002), through
  `rngd_pd.stubs.metrics` (all of `GAUGES` and `HISTOGRAMS`, labelled by `model`);
* the OpenAI front end on its own `/metrics` (:9000), through `rngd_pd.frontend.metrics`
  (`airm_ttft_p90_ms`, `airm_tpot_p90_ms`, `airm_tok_s`, measured at the HTTP edge).

Plain Python, no torch and no Triton: the front end may import it.
"""

from __future__ import annotations

from collections.abc import Iterable

WINDOW = 512
"""How many of the most recent requests the airm_* gauges are computed over."""

TTFT_P90 = "airm_ttft_p90_ms"
TPOT_P90 = "airm_tpot_p90_ms"
TOK_S = "airm_tok_s"
KV_TRANSFER = "airm_kv_transfer_ms"
TTFT_HIST = "airm_ttft_seconds"
TPOT_HIST = "airm_tpot_seconds"
KV_HIST = "airm_kv_transfer_seconds"

GAUGES: dict[str, str] = {
    TTFT_P90: f"p90 time to first token (ms) over the most recent {WINDOW} requests",
    TPOT_P90: f"p90 time per output token after the first (ms) over the most recent {WINDOW} requests",
    TOK_S: f"output tokens per second over the most recent {WINDOW} requests",
    KV_TRANSFER: f"median KV transfer time per request (ms), push + pull, over the most recent {WINDOW}",
}
HISTOGRAMS: dict[str, str] = {
    TTFT_HIST: "time to first token (s)",
    TPOT_HIST: "time per output token after the first (s)",
    KV_HIST: "KV transfer time per request (s)",
}


def percentile(values: Iterable[float], q: float) -> float:
    """Linear-interpolated percentile q in [0, 100] (0.0 for no values): the rule of every airm_* gauge."""
    data = sorted(values)
    if not data:
        return 0.0
    pos = (len(data) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)
