"""The tritonserver launcher and harness, against a real tritonserver running a minimal model.

The model (rngd_pd/testing/assets/echo_model.py) uses the same params / pbutils / metrics the real
models use, so these tests prove the plumbing; the real models are tested by tests/test_e2e_*.py.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from rngd_pd.serve import server as srv
from rngd_pd.testing.assets import ECHO
from rngd_pd.testing.assets.echo_model import SPEC
from rngd_pd.testing.repository import config_pbtxt, write_model
from tests.triton_harness import triton_server


def echo_repository(root: Path, parameters: dict | None = None) -> Path:
    """A repository with `echo`: config.pbtxt (delay 0) and configs/cpu.pbtxt (delay 1 ms)."""
    write_model(root, "echo", ECHO, config_pbtxt(SPEC, {"delay_ms": "0", **(parameters or {})}),
                {"cpu": config_pbtxt(SPEC, {"delay_ms": "1", **(parameters or {})})})
    return root


def group_members(pgid: int) -> list[str]:
    """Command lines of the live processes in process group `pgid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) == pgid:
                state = (entry / "stat").read_text().split(") ")[1][0]
                if state != "Z":
                    found.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, IndexError):
            continue
    return found


# ---------------------------------------------------------------- launcher pieces (no server)


def test_find_prefers_env_then_path_then_bundled(tmp_path: Path) -> None:
    bundled = srv.find_tritonserver({"PATH": str(tmp_path)})
    assert bundled.binary.name == "tritonserver" and bundled.libs is not None
    with pytest.raises(srv.TritonServerError, match="is not an executable file"):
        srv.find_tritonserver({"TRITONSERVER": str(tmp_path / "missing")})
    named = srv.find_tritonserver({"TRITONSERVER": str(bundled.binary), "PATH": ""})
    assert named == bundled
    (tmp_path / "tritonserver").symlink_to(bundled.binary)
    assert srv.find_tritonserver({"PATH": str(tmp_path)}).binary == bundled.binary.resolve()


def test_backend_directory_links_stub_for_this_python(tmp_path: Path) -> None:
    install = srv.find_tritonserver({"PATH": ""})
    root = srv.backend_directory(install, tmp_path)
    python = root / "python"
    assert (python / "libtriton_python.so").resolve() == (install.backends / "python" / "libtriton_python.so")
    assert (python / "triton_python_backend_stub").resolve() == install.stub.resolve()
    assert f"/{srv.PY_VERSION}/" in str(install.stub)
    assert srv.backend_directory(install, tmp_path) == root  # idempotent, reuses the links


def test_command_binds_localhost_and_names_config(tmp_path: Path) -> None:
    install = srv.find_tritonserver({"PATH": ""})
    cfg = srv.ServerConfig(tmp_path, "cpu", http_port=0, grpc_port=0, metrics_port=0)
    cfg.resolve_ports()
    cmd = srv.build_command(install, tmp_path / "b", cfg)
    for flag in ("--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1",
                 "--model-config-name=cpu", f"--backend-directory={tmp_path / 'b'}"):
        assert flag in cmd
    assert len({cfg.http_port, cfg.grpc_port, cfg.metrics_port}) == 3 and cfg.http_port > 0
    env = srv.server_env(install, {"AIRM_KV_TRANSPORT": "tcp"}, base={"PATH": "/usr/bin"})
    assert str(install.libs) in env["LD_LIBRARY_PATH"]
    assert str(Path(srv.__file__).resolve().parents[2]) in env["PYTHONPATH"].split(os.pathsep)
    assert env["AIRM_KV_TRANSPORT"] == "tcp" and env["PATH"].endswith("/usr/bin")
    line = srv.shell_command(cmd, env, srv.SHOWN_ENV)
    assert line.startswith("LD_LIBRARY_PATH=") and "--model-config-name=cpu" in line


# ---------------------------------------------------------------- a real server


@pytest.fixture(scope="module")
def echo_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return echo_repository(tmp_path_factory.mktemp("repo"))




@pytest.fixture(scope="module")
def server(echo_repo: Path):
    with triton_server(echo_repo, "cpu", {"AIRM_KV_TRANSPORT": "tcp"}, models=["echo"]) as s:
        yield s


def grpc_stream(server: srv.TritonServer, ids: list[int]) -> list:
    import tritonclient.grpc as grpcclient

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    inp = grpcclient.InferInput("input_ids", [len(ids)], "INT32")
    inp.set_data_from_numpy(np.array(ids, dtype=np.int32))
    client.async_stream_infer("echo", [inp], enable_empty_final_response=True)
    out = []
    while True:
        result, error = results.get(timeout=30)
        out.append(error if error is not None else result)
        if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    client.close()
    return out


@pytest.mark.e2e
def test_grpc_stream_through_pbutils(server: srv.TritonServer) -> None:
    responses = grpc_stream(server, [3, 1, 4, 1, 5])
    tokens = [int(r.as_numpy("output_ids")[0]) for r in responses[:-1]]
    assert tokens == [3, 1, 4, 1, 5]
    assert responses[-1].as_numpy("finish_reason")[0] == b"length"


@pytest.mark.e2e
def test_error_response_carries_type_and_message(server: srv.TritonServer) -> None:
    responses = grpc_stream(server, [1, -2])
    assert "ConfigError: input_ids must be a non-empty list" in str(responses[-1])


@pytest.mark.e2e
def test_http_generate_stream_and_config_variant(server: srv.TritonServer) -> None:
    body = json.dumps({"input_ids": [7, 8]}).encode()
    req = urllib.request.Request(f"{server.http_url}/v2/models/echo/generate_stream", body)
    with urllib.request.urlopen(req, timeout=30) as resp:
        lines = resp.read().decode().splitlines()
    events = [json.loads(line[5:]) for line in lines if line.startswith("data:")]
    assert [e["output_ids"] for e in events] == [7, 8, []]
    with urllib.request.urlopen(f"{server.http_url}/v2/models/echo/config", timeout=10) as resp:
        config = json.load(resp)
    assert config["parameters"]["delay_ms"]["string_value"] == "1"  # configs/cpu.pbtxt was chosen


@pytest.mark.e2e
def test_airm_metrics_after_traffic(server: srv.TritonServer) -> None:
    grpc_stream(server, [1, 2, 3, 4])
    with urllib.request.urlopen(server.metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    for needle in ('airm_ttft_p90_ms{model="echo"}', 'airm_tpot_p90_ms{model="echo"}',
                   'airm_tok_s{model="echo"}', 'airm_kv_transfer_ms{kv_transport="tcp",model="echo"} 2',
                   "# TYPE airm_ttft_seconds histogram", 'airm_tpot_seconds_bucket{model="echo",le="0.002"}'):
        assert needle in text, needle


@pytest.mark.e2e
def test_stop_leaves_no_stub_even_after_a_crash(tmp_path: Path) -> None:
    with triton_server(echo_repository(tmp_path), models=["echo"]) as s:
        pgid = s.proc.pid
        assert any("triton_python_backend_stub" in c for c in group_members(pgid))
        regions = srv.shm_regions(pgid)
        assert regions and all((Path("/dev/shm") / r).exists() for r in regions)
        os.kill(pgid, signal.SIGKILL)  # the server dies without shutting its stubs down
        s.proc.wait(10)
    deadline = time.monotonic() + 5
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert group_members(pgid) == []
    assert not any((Path("/dev/shm") / r).exists() for r in regions)  # no leaked shm region


@pytest.mark.e2e
def test_bad_parameter_fails_start_naming_it(tmp_path: Path) -> None:
    repo = echo_repository(tmp_path, {"delay_msec": "3"})
    with pytest.raises(srv.TritonServerError) as info, triton_server(repo, timeout=60):
        pass
    message = str(info.value)
    assert "exited with code" in message and "unknown parameter(s) delay_msec" in message


@pytest.mark.e2e
def test_tritonserver_by_hand_from_the_venv(tmp_path: Path) -> None:
    """The documented hand command: venv activated, LD_LIBRARY_PATH, --backend-directory; no PYTHONPATH."""
    import subprocess
    import sys

    install = srv.find_tritonserver({"PATH": ""})
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}", VIRTUAL_ENV=sys.prefix,
               LD_LIBRARY_PATH=str(install.libs))
    http = srv.free_port()
    argv = [str(install.binary), "--model-repository", str(echo_repository(tmp_path)),
            "--model-config-name", "cpu", "--backend-directory", str(srv.backend_directory(install)),
            "--http-address", "127.0.0.1", "--http-port", str(http), "--grpc-port", str(srv.free_port()),
            "--metrics-port", str(srv.free_port())]
    proc = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        body = json.dumps({"input_ids": [2, 4]}).encode()
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "tritonserver did not become ready"
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{http}/v2/models/echo/generate_stream", body)
                assert urllib.request.urlopen(req, timeout=10).read().count(b"output_ids") == 3
                break
            except urllib.error.URLError:
                time.sleep(0.3)
    finally:
        srv.stop_process_group(proc)
