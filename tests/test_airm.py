"""The ai-rm adapter: transports by name, the workload runner's commands, and one real run."""

from __future__ import annotations

import importlib.metadata
import os
import signal
import socket
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from rngd_pd import airm
from rngd_pd.errors import ConfigError
from rngd_pd.serve.server import free_port
from tests.test_triton_serve import processes_mentioning, stop_and_reap
from tests.test_triton_server import echo_repository
from tests.triton_harness import require_tritonserver


def flag(argv: list[str], name: str) -> str:
    return argv[len(argv) - 1 - argv[::-1].index(name) + 1]  # the last occurrence wins, as in argparse


def test_transports_by_name() -> None:
    assert {"shm", "tcp", "nixl-ucx", "nixl"} <= set(airm.known_names())
    assert airm.ShmTransport.__name__ == "ShmTransport"
    with pytest.raises(KeyError, match="shm"):
        airm.load_transport("pigeon")
    with pytest.raises(AttributeError):
        _ = airm.NoSuchTransport


def test_entry_point_is_run() -> None:
    (ep,) = [e for e in importlib.metadata.entry_points(group="airm.workloads") if e.name == "rngd-pd"]
    assert ep.load() is airm.run


def test_decode_workload_command() -> None:
    wl = SimpleNamespace(kind="decode", model="/m/llama", batch_hint=4)
    argv, env = airm.run(wl, kv_transport="tcp", port=8200, seq_len=512, dry_run=True,
                         env={"AIRM_KV_TCP_ADDR": "relay:7700"}, args=["--log-verbose", "1"])
    assert argv[:4] == [sys.executable, "-m", "rngd_pd.cli", "serve"]
    assert flag(argv, "--role") == "decode" and flag(argv, "--model") == "/m/llama"
    assert (flag(argv, "--http-port"), flag(argv, "--grpc-port"), flag(argv, "--metrics-port")) == \
        ("8200", "8201", "8202")
    assert flag(argv, "--openai-port") == "-1" and "num_slots=4" in argv and "max_len=512" in argv
    assert argv[-2:] == ["--log-verbose", "1"]
    assert env == {"AIRM_KV_TRANSPORT": "tcp", "RNGD_PD_PARAM_MAX_LEN": "512",
                   "AIRM_METRICS_PORT": "8202", "AIRM_KV_TCP_ADDR": "relay:7700"}


def test_serve_workload_is_the_gateway() -> None:
    argv, env = airm.run({"kind": "serve"}, port=8000, metrics_port=9400, dry_run=True)
    assert flag(argv, "--role") == "gateway"
    assert flag(argv, "--openai-port") == "8000" and flag(argv, "--http-port") == "8001"
    assert flag(argv, "--prefill-url") == "127.0.0.1:8101" and flag(argv, "--decode-url") == "127.0.0.1:8201"
    assert env["AIRM_METRICS_PORT"] == "9400" and flag(argv, "--metrics-port") == "9400"
    assert "--model" not in argv and "num_slots" not in " ".join(argv)


def _chart_args(role: str) -> list[str]:
    """The serve arguments of a role's container in the chart's committed default rendering."""
    import yaml

    rendered = Path(__file__).resolve().parents[1] / "deploy/helm/rngd-pd/rendered/atom-decode.yaml"
    for doc in yaml.safe_load_all(rendered.read_text()):
        if doc and doc["kind"] == "Deployment" and doc["metadata"]["name"].endswith(f"-{role}"):
            return doc["spec"]["template"]["spec"]["containers"][0]["args"]
    raise AssertionError(f"no {role} Deployment in {rendered}")


@pytest.mark.parametrize("role", ["prefill", "decode", "gateway"])
def test_role_starts_the_charts_pod_layout(role: str) -> None:
    """`role` gives the same serve flags (role, host, ports) as the chart's container of that role."""
    argv, env = airm.run(None, role=role, kv_transport="shm", seq_len=512, dry_run=True,
                         prefill_url="rngd-pd-prefill:8001", decode_url="rngd-pd-decode:8001")
    chart = _chart_args(role)
    names = ["--role", "--host", "--http-port", "--grpc-port", "--metrics-port", "--openai-port",
             "--kv-transport"] + (["--prefill-url", "--decode-url"] if role == "gateway" else [])
    assert {n: flag(argv, n) for n in names} == {n: flag(chart, n) for n in names}
    assert "max_len=512" in argv and "max_len=512" in chart  # examples/atom-decode.yaml: seqLen 512
    assert env["AIRM_METRICS_PORT"] == "8002" and env["AIRM_KV_TRANSPORT"] == "shm"


def test_role_wins_over_kind_and_keeps_the_other_keys() -> None:
    wl = SimpleNamespace(kind="serve", model="/m/llama", batch_hint=16)
    argv, _ = airm.run(wl, role="decode", port=8200, metrics_port=9400, host="10.0.0.5", dry_run=True)
    assert flag(argv, "--role") == "decode" and flag(argv, "--host") == "10.0.0.5"
    assert (flag(argv, "--http-port"), flag(argv, "--grpc-port"), flag(argv, "--metrics-port"),
            flag(argv, "--openai-port")) == ("8200", "8201", "9400", "-1")
    assert flag(argv, "--model") == "/m/llama" and "num_slots=16" in argv
    argv, _ = airm.run(None, role="all", openai_port=9100, dry_run=True)
    assert flag(argv, "--openai-port") == "9100" and flag(argv, "--http-port") == "8000"
    # without role, the original's layout is unchanged (no --host: serve's 127.0.0.1)
    argv, _ = airm.run({"kind": "prefill"}, dry_run=True)
    assert "--host" not in argv and flag(argv, "--http-port") == "8000"


@pytest.mark.parametrize(("workload", "config", "needle"), [
    ({"kind": "train"}, {}, "unknown workload kind 'train'"),
    ({"kind": "prefill"}, {"seqlen": 5}, "unknown workload config key(s) seqlen"),
    ({"kind": "prefill"}, {"kv_transport": "pigeon"}, "unknown KV transport 'pigeon'; serving takes"),
    ({"kind": "prefill"}, {"kv_transport": "nixl"}, "'nixl' cannot serve: .* over NIXL with `nixl-ucx`"),
    (None, {"role": "router"}, "unknown role 'router'"),
])
def test_bad_workloads_are_rejected(workload: dict, config: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        airm.run(workload, dry_run=True, **config)


def _free_port_run(n: int, tries: int = 50) -> int:
    """A port p with p..p+n-1 all free a moment ago: a lone free port's neighbours may be another
    test's servers."""
    for _ in range(tries):
        base = free_port()
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports in {tries} tries")


@pytest.mark.e2e
def test_run_starts_serve_and_sigterm_stops_it(tmp_path: Path) -> None:
    require_tritonserver()
    repo = echo_repository(tmp_path)
    port = _free_port_run(4)  # serve takes port..port+3 (OpenAI, Triton HTTP, gRPC, metrics)
    proc = airm.run({"kind": "all"}, port=port, args=["--repository", str(repo), "--openai-port", "-1"])
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port + 1}/v2/health/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        assert proc.poll() is None, "rngd-pd serve exited early"
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(60) == 0
        deadline = time.monotonic() + 5
        while processes_mentioning(str(repo)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert processes_mentioning(str(repo)) == []
    finally:
        stop_and_reap(proc, repo)
