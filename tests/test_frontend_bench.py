"""bench/load_gen.py and bench/kpi_slo.py against the front end over the scripted backend: request
counts, exact prompt lengths, trace replay timing, Poisson arrivals, error accounting, SLO verdicts.
"""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout

import pytest

from bench import kpi_slo, load_gen
from bench.traces.azure import TraceRow, write_trace
from rngd_pd.frontend.app import create_app
from rngd_pd.frontend.config import FrontendConfig
from rngd_pd.frontend.served_model import load_served_model
from tests.frontend_fakes import FakeBackend, serve_app


@pytest.fixture(scope="module")
def url():
    served = load_served_model(FrontendConfig())
    backend = FakeBackend(served.tokenizer, 0.002, inputs=("ignore_eos",))  # the sweep passes ignore_eos
    with serve_app(create_app(FrontendConfig(), model=served, backend=backend)) as base:
        yield base


def run(argv: list[str]) -> tuple[int, list[dict], dict]:
    out = io.StringIO()
    with redirect_stdout(out):
        code = load_gen.main([*argv, "--json", "--quiet"])
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    return code, [r for r in rows if r["type"] == "request"], rows[-1]


def test_closed_loop_counts_tokens_and_times(url):
    code, requests, summary = run(
        ["--url", url, "--concurrency", "3", "--requests", "6", "--prompt-tokens", "40", "--max-tokens", "8"]
    )
    assert code == 0 and len(requests) == 6
    assert (summary["requests"], summary["errors"], summary["total_output_tokens"]) == (6, 0, 48)
    assert summary["mean_prompt_tokens"] == 40  # usage from the server: the prompts are exactly 40 tokens
    assert all(r["ttft_ms"] > 0 and r["tpot_ms"] > 0 and len(r["itl_ms"]) >= 1 for r in requests)
    for name in ("ttft", "tpot", "itl", "e2e"):
        assert summary[f"{name}_p50_ms"] <= summary[f"{name}_p99_ms"]
    assert summary["output_tok_s"] > 0 and summary["slo_share"] == 1.0 and summary["slo_pass"]
    assert "TTFT" in load_gen.table(summary)


def test_trace_replay_uses_lengths_and_times(url, tmp_path):
    trace = write_trace(tmp_path / "t.csv", [TraceRow(0.0, 12, 3), TraceRow(0.3, 30, 5), TraceRow(0.6, 7, 2)])
    code, requests, summary = run(["--url", url, "--trace", str(trace)])
    assert code == 0 and summary["mode"] == "trace"
    assert [(r["prompt_tokens"], r["output_tokens"]) for r in requests] == [(12, 3), (30, 5), (7, 2)]
    assert [r["start_s"] >= t for r, t in zip(requests, (0.0, 0.3, 0.6), strict=True)] == [True] * 3
    assert summary["duration_s"] >= 0.6


def test_poisson_arrivals(url):
    code, requests, summary = run(
        [
            "--url",
            url,
            "--rate",
            "50",
            "--requests",
            "5",
            "--prompt-tokens",
            "5",
            "--max-tokens",
            "3",
            "--ignore-eos",
        ]
    )
    assert code == 0 and summary["mode"] == "poisson" and summary["requests"] == 5
    starts = [r["start_s"] for r in requests]
    assert starts == sorted(starts) and starts[-1] > 0


def test_errors_are_counted_not_hidden(url):
    code, _, summary = run(["--url", url, "--model", "nope", "--requests", "2", "--max-tokens", "2"])
    assert code == 1 and summary["errors"] == 2 and summary["requests"] == 0
    assert "HTTP 404" in summary["error_samples"][0]


def test_kpi_slo_from_load_gen_lines(url, tmp_path, capsys):
    _, requests, summary = run(
        ["--url", url, "--concurrency", "2", "--requests", "4", "--max-tokens", "6", "--prompt-tokens", "8"]
    )
    lines = [json.dumps(r) for r in [*requests, summary]]
    path = tmp_path / "run.jsonl"
    path.write_text("\n".join(lines * 2))  # two runs in one file
    assert kpi_slo.main(["--in", str(path), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 2 and rows[0]["result"] == "SLO PASS, 4/4" and rows[0]["slo_share"] == 1.0
    assert rows[0]["airm_tok_s"] == summary["output_tok_s"] and rows[0]["airm_tpot_p90_ms"] > 0
    assert kpi_slo.main(["--in", str(path), "--json", "--slo-tpot-ms", "0.0001"]) == 1
    row = json.loads(capsys.readouterr().out.splitlines()[0])
    assert row["slo_share"] == 0.0 and row["result"] == "SLO FAIL, 0/4"


def test_kpi_slo_runs_the_load_generator(url, capsys):
    code = kpi_slo.main(
        ["--", "--url", url, "--requests", "2", "--max-tokens", "3", "--prompt-tokens", "4", "--quiet"]
    )
    assert code == 0 and "SLO PASS, 2/2" in capsys.readouterr().out
