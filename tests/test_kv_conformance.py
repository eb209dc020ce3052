"""The transport contract suite against the real shm and tcp transports (pushing side in a child)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rngd_pd.kv.conformance import run_suite


@pytest.mark.parametrize("name", ["shm", "tcp"])
def test_conformance_suite_passes(name, monkeypatch):
    monkeypatch.delenv("AIRM_KV_TCP_ADDR", raising=False)  # the suite starts (and stops) its own relay
    lines: list[str] = []
    results = run_suite(name, out=lines.append)
    assert [r for r in results if r.status != "PASS"] == [], "\n".join(lines)
    assert len(results) == 15 and any("64 MiB" in r.case for r in results)


def test_cli_exit_codes():
    ok = subprocess.run([sys.executable, "-m", "rngd_pd.cli", "conformance", "shm", "--max-size", "4096"],
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "PASS roundtrip 4 KiB" in ok.stdout and "FAIL" not in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "rngd_pd.kv.conformance", "no-such-transport"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "known:" in bad.stderr


@pytest.mark.parametrize("name", ["shm", "tcp"])
def test_torch_bf16_layer_round_trip(name, tmp_path):
    """One layer's K as the engine holds it (bf16 [kv_heads, tokens, head_dim]) in and out, bit-exact."""
    import contextlib

    import torch

    from rngd_pd.kv import load_transport
    from rngd_pd.kv.relay.proc import start_relay

    with contextlib.ExitStack() as stack:
        if name == "shm":
            opts = {"root": str(tmp_path / "shm")}
        else:
            opts = {"addr": stack.enter_context(start_relay()).addr}
        t = stack.enter_context(contextlib.closing(load_transport(name, **opts)))
        src = torch.randn(3, 37, 64).to(torch.bfloat16)
        out = torch.empty_like(src)
        t.push("bf16", 0, src)
        assert t.pull("bf16", 0, out, 5.0) == src.numel() * 2
        assert torch.equal(out.view(torch.int16), src.view(torch.int16))
        t.release("bf16")
