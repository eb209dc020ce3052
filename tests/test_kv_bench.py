"""bench/kv_bench.py runs end to end and prints the promised JSON rows (figures are not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "kv_bench.py"


@pytest.mark.slow
def test_quick_json_rows():
    run = subprocess.run([sys.executable, str(BENCH), "--quick", "--reps", "1", "--transports", "shm,tcp",
                          "--json"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    keys = {"transport", "bytes", "in_flight", "ms", "gbps", "limit", "limit_gbps", "ratio"}
    assert all(keys <= set(r) for r in rows)
    got = {(r["transport"], r["in_flight"]) for r in rows}
    assert {("shm", 1), ("shm", 8), ("tcp", 1), ("tcp", 8), ("limit:memcpy", 1), ("limit:socket", 1)} <= got
    shm1 = next(r for r in rows if r["transport"] == "shm" and r["in_flight"] == 1)
    assert shm1["bytes"] == 64 << 20 and shm1["limit"] == "memcpy" and shm1["ratio"] > 0
    assert shm1["ceiling"] == "two-copies" and shm1["ceiling_gbps"] > 0 and shm1["ratio_to_ceiling"] > 0
    assert "round 1/1" in run.stderr  # progress goes to stderr
