"""bench/device_check.sh, the GPU check of issue 27 item 6, run here with `cpu`: the same script, the
same steps (device conformance against the CPU fp32 reference, one greedy request served by a real
tritonserver through the `llm` ensemble, its tokens equal to the in-process fp32 greedy tokens), on
the tiny random Llama the GPU machine would use. Nothing else depends on the script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.triton_harness import require_tritonserver

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(900)
def test_device_check_script_runs_its_steps_on_cpu(tmp_path):
    require_tritonserver()
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out)}
    proc = subprocess.run(["bash", "bench/device_check.sh", "cpu", "--model", "tiny"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=840)
    summary = json.loads((out / "summary.json").read_text())
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:] + json.dumps(summary)[-3000:]
    assert "load average" in (out / "uptime.txt").read_text()
    assert summary["model"]["why"].startswith("a tiny random Llama") and summary["facts"]["torch"]
    assert summary["conformance"]["ok"] and summary["conformance"]["checks"] >= 7
    assert (out / "conformance.jsonl").read_text().count('"ok": true') == summary["conformance"]["checks"]
    served = summary["served"]
    assert served["ok"] is True and len(served["tokens"]) == 16 and served["tokens"] == served["reference"]
    assert "conformance  ok" in proc.stdout and "served       ok" in proc.stdout
