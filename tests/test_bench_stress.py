"""bench/pd_stress.py: arguments, the relay transports' environment, per-run and total summaries, the
--runs loop (with the server part replaced: no tritonserver here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import pd_stress as S


def test_defaults_are_the_issue_workload() -> None:
    a = S.parse_args([])
    assert (a.rounds, a.concurrency, a.transport, a.runs) == (15, 24, "shm", 1)


@pytest.mark.parametrize("transport", S.TRANSPORTS)
def test_every_transport_is_accepted(transport: str) -> None:
    assert S.parse_args(["--transport", transport, "--runs", "20"]).runs == 20


@pytest.mark.parametrize("argv", [["--transport", "nixl"], ["--runs", "0"], ["--rounds", "0"],
                                  ["--concurrency", "0"], ["--timeout", "0"]])
def test_bad_arguments_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        S.parse_args(argv)


def test_shm_needs_no_relay() -> None:
    env = S.transport_env("shm", "/dev/shm/x", None, base={})
    assert env == {"AIRM_KV_TRANSPORT": "shm", "PD_SHM_ROOT": "/dev/shm/x"}


@pytest.mark.parametrize("transport", S.RELAY_TRANSPORTS)
def test_relay_transports_get_the_relay_address_and_host_settings(transport: str) -> None:
    env = S.transport_env(transport, "/dev/shm/x", "127.0.0.1:4242", base={"UCX_MODULES": "^ib,^rdmacm"})
    assert env["AIRM_KV_TRANSPORT"] == transport and env["AIRM_KV_TCP_ADDR"] == "127.0.0.1:4242"
    assert env["UCX_MODULES"] == "^ib,^rdmacm"  # the caller's own setting wins
    assert env["AIRM_KV_UCX_POOL_MB"] == S.TRANSPORT_DEFAULTS["AIRM_KV_UCX_POOL_MB"]


def test_a_relay_transport_without_a_relay_is_an_error() -> None:
    with pytest.raises(ValueError, match="tcp"):
        S.transport_env("tcp", "/dev/shm/x", None, base={})


def _row(failed: int = 0, streams: int = 24) -> dict:
    return {"round": 0, "wall_s": 1.0, "streams": streams, "failed": failed, "slowest_s": 1.0,
            "first_error": ""}


def test_run_summary_fails_on_a_failed_stream_a_crash_sign_or_an_error() -> None:
    assert S.run_summary(0, [_row(), _row()], "all fine")["ok"]
    bad = S.run_summary(1, [_row(), _row(failed=3)], "")
    assert not bad["ok"] and (bad["streams"], bad["failed"], bad["failure_rate"]) == (48, 3, 0.0625)
    crashed = S.run_summary(2, [_row()], "x\nfree(): double free detected\nSignal (6) received")
    assert not crashed["ok"] and crashed["crash_signs"] == ["Signal (6)", "double free"]
    assert not S.run_summary(3, [], "", error="TritonServerError: not ready")["ok"]


def test_total_counts_failed_runs_streams_and_crash_signs() -> None:
    runs = [S.run_summary(0, [_row()], ""), S.run_summary(1, [_row(failed=1)], "Segmentation fault"),
            S.run_summary(2, [], "", error="boom")]
    t = S.total_summary(runs)
    assert (t["runs"], t["runs_failed"], t["streams"], t["failed"]) == (3, 2, 48, 1)
    assert t["runs_with_crash_signs"] == 1 and t["crash_signs"] == ["Segmentation fault"]
    line = S.format_total(t, "tcp")
    assert "3 runs, 2 failed" in line and "48 streams, 1 failed" in line and "Segmentation fault" in line


def test_log_paths_are_one_per_run() -> None:
    assert S.log_path(None, 0, 5) is None
    assert S.log_path(Path("/tmp/t.log"), 0, 1) == Path("/tmp/t.log")
    assert S.log_path(Path("/tmp/t.log"), 3, 5) == Path("/tmp/t.run3.log")


def test_runs_loop_prints_a_line_per_run_and_a_total(monkeypatch, tmp_path: Path, capsys) -> None:
    from rngd_pd.testing import e2e as E

    monkeypatch.setattr(E, "prompt_ids", lambda text: [1, 2, 3])  # no model load
    outcomes = iter([([_row()], "ok", ""), ([_row(failed=2)], "Reference count error", ""),
                     ([], "", "TritonServerError: exited")])
    seen = []

    def fake_run(args, run, prompts, ids):
        seen.append(run)
        return next(outcomes)

    monkeypatch.setattr(S, "_run", fake_run)
    assert S.main(["--runs", "3", "--transport", "tcp", "--log", str(tmp_path / "t.log")]) == 1
    out = capsys.readouterr().out
    assert seen == [0, 1, 2]
    assert "run 1/3: 1 rounds, 24 streams, 0 failed; server log: no crash signs" in out
    assert "run 2/3: 1 rounds, 24 streams, 2 failed; server log: Reference count error" in out
    assert "run 3/3: 0 rounds" in out and "TritonServerError: exited" in out
    assert "total (tcp): 3 runs, 2 failed; 48 streams, 2 failed; crash signs in 1 runs" in out
    assert (tmp_path / "t.run1.log").read_text() == "Reference count error"


def test_runs_loop_json_has_a_summary_per_run_and_a_total(monkeypatch, capsys) -> None:
    from rngd_pd.testing import e2e as E

    monkeypatch.setattr(E, "prompt_ids", lambda text: [1])
    monkeypatch.setattr(S, "_run", lambda args, run, prompts, ids: ([_row()], "", ""))
    assert S.main(["--runs", "2", "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x.get("run") for x in lines[:2]] == [0, 1] and all(x["ok"] for x in lines[:2])
    assert lines[2]["total"] and lines[2]["runs_failed"] == 0 and lines[2]["streams"] == 48
