"""bench/structured_bench.py's served mode against the front end over the scripted backend: both runs
counted from the usage the server reports, the summary and its results file written."""

from __future__ import annotations

import json

from bench import structured_bench
from rngd_pd.frontend.app import create_app
from rngd_pd.frontend.config import FrontendConfig
from rngd_pd.frontend.served_model import load_served_model
from tests.frontend_fakes import FakeBackend, serve_app


def test_served_mode_writes_its_summary(tmp_path, capsys):
    served = load_served_model(FrontendConfig())
    backend = FakeBackend(served.tokenizer, 0.001, inputs=("ignore_eos", "structured"))
    with serve_app(create_app(FrontendConfig(), model=served, backend=backend)) as url:
        assert structured_bench.main(["--url", url, "--streams", "2", "--rounds", "1", "--max-tokens", "4",
                                      "--out", str(tmp_path), "--host-note", "test"]) == 0
    summary = json.loads((tmp_path / "structured.json").read_text())
    assert summary["mode"] == "served" and summary["host_note"] == "test"
    assert [(r["schema"], r["tokens"]) for r in summary["rows"]] == [(False, 8), (True, 8)]
    assert "slower (bar 1.2x)" in capsys.readouterr().out
