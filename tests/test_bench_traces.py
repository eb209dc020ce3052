"""bench/traces/azure.py: Azure LLM inference trace CSVs written, read back, and validated."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.traces import azure


def test_write_then_read_round_trips(tmp_path: Path) -> None:
    rows = [azure.TraceRow(0.0, 512, 128), azure.TraceRow(0.25, 40, 7), azure.TraceRow(1.5, 1800, 16)]
    path = azure.write_trace(tmp_path / "t.csv", rows)
    lines = path.read_text().splitlines()
    assert lines[0] == "TIMESTAMP,ContextTokens,GeneratedTokens"
    assert lines[2] == "2023-11-16 18:00:00.2500000,40,7"  # 7 fractional digits, as the Azure files
    back = azure.read_trace(path)
    assert [(r.context_tokens, r.generated_tokens) for r in back] == [(512, 128), (40, 7), (1800, 16)]
    assert [r.t for r in back] == pytest.approx([0.0, 0.25, 1.5])


def test_read_parses_the_public_format_and_sorts_by_arrival(tmp_path: Path) -> None:
    p = tmp_path / "azure.csv"
    p.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:47.1000000,100,5\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
    )
    rows = azure.read_trace(p)
    assert rows[0] == azure.TraceRow(0.0, 374, 44)
    assert rows[1].t == pytest.approx(0.41941) and rows[1].context_tokens == 100


def test_read_limit_and_seconds_timestamps(tmp_path: Path) -> None:
    p = tmp_path / "s.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0.5,10,2\n1.5,20,3\n2.5,30,4\n")
    rows = azure.read_trace(p, limit=2)
    assert [r.t for r in rows] == [0.0, 1.0]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("a,b,c\n1,2,3\n", "missing column"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "no rows"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,1\n", "neither a date-time nor seconds"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n0,ten,1\n", "ContextTokens 'ten' is not a number"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n0,5,0\n", "GeneratedTokens must be >= 1"),
    ],
)
def test_bad_traces_raise_a_trace_error_naming_the_line(tmp_path: Path, body: str, message: str) -> None:
    p = tmp_path / "bad.csv"
    p.write_text(body)
    with pytest.raises(azure.TraceError, match=message):
        azure.read_trace(p)


def test_missing_file_says_how_to_make_one(tmp_path: Path) -> None:
    with pytest.raises(azure.TraceError, match=r"bench/traces/azure\.py"):
        azure.read_trace(tmp_path / "nope.csv")


def test_mixed_trace_is_seeded_and_mixed() -> None:
    a, b = azure.mixed_trace(200, rate=2.0, seed=3), azure.mixed_trace(200, rate=2.0, seed=3)
    assert a == b and a != azure.mixed_trace(200, rate=2.0, seed=4)
    ctx = [r.context_tokens for r in a]
    assert min(ctx) >= 32 and max(ctx) <= 1792
    assert any(c < 384 for c in ctx) and any(c >= 1024 for c in ctx)  # short and long prompts both present
    times = [r.t for r in a]
    assert times == sorted(times) and times[0] == 0.0
    assert 60 < times[-1] < 140  # 200 arrivals at ~2/s


def test_fixed_trace_and_bad_rate() -> None:
    rows = azure.fixed_trace(5, 512, 128, rate=10.0, seed=0)
    assert {(r.context_tokens, r.generated_tokens) for r in rows} == {(512, 128)}
    with pytest.raises(azure.TraceError, match="rate must be > 0"):
        azure.fixed_trace(5, 512, 128, rate=0.0)


def test_committed_mixed_trace_is_the_seeded_one() -> None:
    rows = azure.read_trace(azure.MIXED_CSV)
    expect = azure.mixed_trace(48, rate=1.0, seed=0)
    assert [(r.context_tokens, r.generated_tokens) for r in rows] == [
        (r.context_tokens, r.generated_tokens) for r in expect
    ]


def test_cli_writes_a_trace(tmp_path: Path) -> None:
    out = tmp_path / "m.csv"
    assert azure.main(["mixed", "--requests", "6", "--out", str(out)]) == 0
    assert len(azure.read_trace(out)) == 6
