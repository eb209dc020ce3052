"""bench/sweep.py and bench/sweep_report.py on synthetic rows: tables, ratios, targets, plot (no servers)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from bench import sweep, sweep_report


def _row(system: str, workload: str, c: int | None, tok_s: float, p99: float) -> dict[str, Any]:
    return {
        "system": system,
        "workload": workload,
        "concurrency": c,
        "output_tok_s": tok_s,
        "ttft_p50_ms": 100.0,
        "ttft_p99_ms": 300.0,
        "tpot_p50_ms": p99 / 2,
        "tpot_p99_ms": p99,
        "slo_share": 1.0,
    }


def _rows() -> list[dict[str, Any]]:
    rows = []
    for s, scale, p99 in (
        ("pd", 1.0, 40.0),
        ("colocated", 0.8, 60.0),
        ("hf", 0.2, 45.0),
        ("llamacpp", 0.3, 20.0),
    ):
        rows += [
            _row(s, "fixed", c, 30.0 * c * scale if s in ("pd", "colocated") else 25.0 * scale, p99)
            for c in (1, 4, 16)
        ]
        rows.append(_row(s, "mixed", None, 100.0 * scale, p99 * 1.5))
    return rows


def test_normalise_maps_load_gen_aliases() -> None:
    raw = {"output_tokens_per_s": 12.5, "ttft_ms_p50": 3.0, "tpot_p99_ms": 9.0, "failed": 1}
    row = sweep_report.normalise(raw, system="pd", workload="fixed", concurrency=4)
    assert row["output_tok_s"] == 12.5 and row["ttft_p50_ms"] == 3.0 and row["tpot_p99_ms"] == 9.0
    assert row["errors"] == 1 and row["slo_share"] is None and row["concurrency"] == 4


def test_ratio_table_puts_systems_side_by_side_with_pd_ratios() -> None:
    text = sweep_report.ratio_table(_rows(), "output_tok_s")
    header = text.splitlines()[1]
    for name in (
        "PD",
        "colocated",
        "HF generate",
        "llama.cpp",
        "PD/colocated",
        "PD/HF generate",
        "PD/llama.cpp",
    ):
        assert name in header
    line16 = next(ln for ln in text.splitlines() if ln.split()[:2] == ["fixed", "16"])
    cells = line16.split()
    # pd 480, colocated 384 -> ratio 1.25; pd/hf = 480 / 5 = 96
    assert "480" in cells and "1.2" in cells[-3] and cells[-2] == "96"


def test_targets_evaluate_the_three_goals() -> None:
    ts = {t["target"]: t for t in sweep_report.targets(_rows())}
    scale = ts["PD tok/s at 16 streams >= 8x single-stream"]
    assert scale["value"] == pytest.approx(16.0) and scale["met"] is True
    tpot = ts["PD TPOT p99 (mixed trace) <= colocated's"]
    assert tpot["value"] == 60.0 and tpot["goal"] == 90.0 and tpot["met"] is True
    assert ts["PD tok/s at 16 streams > HF generate"]["met"] is True
    assert "PD tok/s at 16 streams > HF cont. batching" not in ts  # not run, not listed


def test_targets_not_met_and_not_measured() -> None:
    rows = [
        _row("pd", "fixed", 1, 10.0, 50.0),
        _row("pd", "fixed", 16, 40.0, 50.0),
        _row("llamacpp", "fixed", 16, 60.0, 10.0),
    ]
    ts = sweep_report.targets(rows)
    assert ts[0]["met"] is False and ts[0]["value"] == 4.0
    assert ts[1]["met"] is None  # no mixed rows
    assert ts[2]["met"] is False
    text = sweep_report.targets_text(ts)
    assert "NOT MET" in text and "not measured" in text


def test_metrics_table_lists_failed_points_with_their_note() -> None:
    rows = [*_rows(), {"system": "hf-cb", "workload": "-", "note": "did not start: boom"}]
    text = sweep_report.metrics_table(rows)
    assert "did not start: boom" in text and "HF cont. batching" in text
    assert "PD" in sweep_report.report(rows)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    path = sweep_report.plot(_rows(), tmp_path / "out" / "sweep.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def _args(**kw: Any) -> argparse.Namespace:
    return sweep.parse_args([a for k, v in kw.items() for a in (f"--{k.replace('_', '-')}", str(v))])


def test_grid_and_quick_mode(tmp_path: Path) -> None:
    a = _args(concurrency="1,16", waves=2, trace=tmp_path / "m.csv")
    pts = sweep.grid(a)
    assert [(p.name, p.concurrency, p.requests) for p in pts] == [
        ("fixed", 1, 4),
        ("fixed", 16, 32),
        ("mixed", None, 48),
    ]
    q = sweep.parse_args(["--quick", "--trace", ""])
    assert q.trace is None and [p.concurrency for p in sweep.grid(q)] == [1, 4]
    assert sweep.grid(q)[0].prompt_tokens == 128


def test_unknown_system_is_refused() -> None:
    with pytest.raises(SystemExit):
        sweep.parse_args(["--systems", "pd,tgi"])


def test_load_gen_argv_for_fixed_and_trace_points(tmp_path: Path) -> None:
    a = _args()
    t = sweep.Target("pd", "http://127.0.0.1:9", model="m")
    fixed = sweep.load_gen_argv(t, sweep.Workload("fixed", 4, 512, 128, 8), a)
    assert fixed[1].endswith("bench/load_gen.py")
    assert fixed[fixed.index("--concurrency") + 1] == "4" and "--prompt-tokens" in fixed
    trace = sweep.load_gen_argv(t, sweep.Workload("mixed", requests=6, trace=tmp_path / "m.csv"), a)
    assert trace[trace.index("--trace") + 1] == str(tmp_path / "m.csv") and "--concurrency" not in trace


def test_summary_of_takes_the_last_row_with_a_throughput() -> None:
    out = (
        '{"request": 1, "ttft_ms": 5}\nsome table\n'
        '{"output_tok_s": 7.5, "tpot_p99_ms": 3}\n{"event": "done"}\n'
    )
    assert sweep.summary_of(out) == {"output_tok_s": 7.5, "tpot_p99_ms": 3}
    assert sweep.summary_of("nothing") is None
