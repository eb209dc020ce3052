"""bench/api_features.py over the scripted backend: both variants run, their tokens are counted, the
logprob variant really asks for logprobs, the JSON says the load it ran under."""

from __future__ import annotations

import argparse

from bench import api_features
from rngd_pd.frontend.app import create_app
from rngd_pd.frontend.config import FrontendConfig
from rngd_pd.frontend.served_model import load_served_model
from tests.frontend_fakes import ALL_INPUTS, FakeBackend, serve_app


def test_both_variants_measured_and_logprobs_asked_for() -> None:
    served = load_served_model(FrontendConfig())
    backend = FakeBackend(served.tokenizer, 0.001, inputs=ALL_INPUTS)
    args = argparse.Namespace(streams=3, max_tokens=5, rounds=2, triton_model="pd")
    with serve_app(create_app(FrontendConfig(), model=served, backend=backend)) as url:
        row = api_features.measure(args, url)
    assert set(row["median_tok_s"]) == {"plain", "top_logprobs=5"}
    assert all(r["tokens"] == 15 for rs in row["rounds"].values() for r in rs)
    asked = [r.params.logprobs for r in backend.requests[3:]]  # after the warm-up round
    assert asked.count(5) == 6 and asked.count(None) == 6
    assert row["slowdown"] > 0 and len(row["loadavg"]) == 3
    assert "slowdown with top_logprobs=5" in api_features.table(row)
