"""Device conformance checks against an outside reference (transformers), not against this project.

`python -m rngd_pd.devices.conformance cpu` must pass on the model as loaded and fail when one weight
is broken in this project's loader: every copy of the model the project would load is then broken
alike, so a check of the project against itself (what conformance did before) would still pass;
transformers reads the GGUF with its own loader and sees the difference.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rngd_pd.devices import conformance
from rngd_pd.model import weights

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["cpu", "--chunks", "16", "--decode", "3x48", "--steps", "3"]
BROKEN = "model.layers.7.self_attn.v_proj.weight"


def test_module_entry_point_runs_the_cpu_checks_against_transformers() -> None:
    """The issue's command line, in a process of its own (as a user runs it)."""
    out = subprocess.run([sys.executable, "-m", "rngd_pd.devices.conformance", *SMALL], capture_output=True,
                         text=True, timeout=600, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "cpu conforms" in out.stdout
    for shape in ("chunk 16, prompt 16", "chunk 16, prompt 24", "width 3, bucket 48",
                  "width 3, bucket 48, 1 rows"):
        assert shape in out.stdout, out.stdout
    assert "rows 1 of 3 in slots [2]" in out.stdout, out.stdout


def test_cpu_conformance_fails_when_one_weight_of_our_loader_is_perturbed(hf_smollm, monkeypatch,
                                                                         capsys) -> None:
    """One tensor (layer 7's v_proj) scaled by 1.01 as our loader reads it: prefill and decode fail
    (fp32 compute and KV, the tightest tolerances: 1e-3 on the logits)."""
    real = weights.assemble

    def perturbed(model, tensors):
        return real(model, ((name, t * 1.01 if name == BROKEN else t) for name, t in tensors))

    monkeypatch.setattr(weights, "assemble", perturbed)
    assert conformance.main([*SMALL, "--kv-dtype", "fp32"]) == 1
    table = capsys.readouterr().out
    failed = [line.split()[0] for line in table.splitlines() if " FAIL " in line]
    assert failed.count("prefill") == 2 and failed.count("decode") == 2, table
    assert "kv" not in failed, table  # the byte round trip does not involve the weights


def test_tolerances_hold_a_near_tie_but_not_a_different_token() -> None:
    import torch

    ref = torch.tensor([[1.0, 3.0, 2.95], [5.0, 0.0, 0.0]])
    near = torch.tensor([[1.0, 2.9, 2.96], [5.0, 0.0, 0.0]])  # token 2 instead of 1: margin 0.05
    assert conformance.compare_tokens(near, ref) == (1, [pytest.approx(0.05)])
    ok, detail = conformance._verdict(near, ref, conformance.TOLERANCES["fp32, 16-bit KV"])
    assert ok and "1 differ" in detail
    far = torch.tensor([[1.0, 3.0, 2.95], [0.0, 0.0, 5.0]])  # a wrong token with a margin of 5
    ok, detail = conformance._verdict(far, ref, conformance.Tolerance(logits=10, kv=0, tie=1.0))
    assert not ok, detail


def test_scattered_slots_leave_rows_fewer_than_the_width_apart() -> None:
    assert conformance.scattered_slots(3, 8) == [7, 5, 2]
    assert conformance.scattered_slots(1, 4) == [3]
    assert conformance.fewer_rows(8) == 3 and conformance.fewer_rows(2) == 1
