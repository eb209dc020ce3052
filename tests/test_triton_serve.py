"""`rngd-pd serve` and `rngd-pd devices` as a user runs them, on a repository with the echo model."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from rngd_pd.commands.serve import choose_config_name
from tests.test_triton_server import echo_repository
from tests.triton_harness import require_tritonserver

RNGD_PD = [sys.executable, "-m", "rngd_pd.cli"]


def processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains `text` (tritonserver and its stubs name the repository)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                state = (entry / "stat").read_text().split(") ")[1][0]
            except (OSError, IndexError):
                continue
            if text in cmdline and state != "Z":
                pids.append(int(entry.name))
    return pids


def stop_and_reap(proc: subprocess.Popen, repo: Path) -> None:
    """Stop a serve process we started; kill whatever of ours survives it (a test failing midway)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    deadline = time.monotonic() + 5
    while processes_mentioning(str(repo)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in processes_mentioning(str(repo)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_config_choice_follows_devices(tmp_path: Path) -> None:
    (tmp_path / "prefill" / "configs").mkdir(parents=True)
    (tmp_path / "prefill" / "configs" / "cpu.pbtxt").touch()
    (tmp_path / "prefill" / "configs" / "rngd.pbtxt").touch()
    assert choose_config_name(tmp_path, "all", {"cpu"})[0] == "cpu"
    assert choose_config_name(tmp_path, "all", {"cpu", "rngd"})[0] == "rngd"
    assert choose_config_name(tmp_path, "all", {"cpu", "rngd", "atom"})[0] is None
    assert choose_config_name(tmp_path, "decode", {"cpu", "atom"})[0] is None
    assert choose_config_name(tmp_path, "all", {"cpu", "cuda"})[0] == "cpu"  # no configs/cuda.pbtxt


def test_bad_arguments_exit_2_with_reason(tmp_path: Path) -> None:
    nixl = "KV transport 'nixl' cannot serve: it copies only between allocations its caller binds first"
    cases = [
        (["--role", "gateway"], {}, "--role gateway needs --prefill-url and --decode-url"),
        (["--kv-transport", "pigeon"], {}, "unknown KV transport 'pigeon'; serving takes: nixl-ucx, shm,"),
        (["--kv-transport", "nixl"], {}, nixl),
        ([], {"AIRM_KV_TRANSPORT": "nixl"}, nixl),  # the variable ai-rm sets, refused as the flag is
        (["--model", str(tmp_path / "nope.gguf")], {}, "nope.gguf does not exist"),
        (["--kv-events-config", '{"enable_kv_events": true}'], {},
         "--kv-events-config: unknown key(s) enable_kv_events; known: enable_kv_cache_events"),
    ]
    for extra, env, needle in cases:
        proc = subprocess.run([*RNGD_PD, "serve", "--repository", str(tmp_path), *extra],
                              capture_output=True, text=True, timeout=60, env={**os.environ, **env})
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
        assert "nixl-ucx" in proc.stderr or needle != nixl, proc.stderr


@pytest.mark.slow
def test_print_command_and_devices(tmp_path: Path) -> None:
    require_tritonserver()
    repo = echo_repository(tmp_path)
    argv = [*RNGD_PD, "serve", "--repository", str(repo), "--print-command", "--kv-dtype", "fp16"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True)
    assert "model config cpu (no RNGD/ATOM/CUDA device usable here)" in out.stderr
    line = out.stdout.strip()
    assert "RNGD_PD_KV_DTYPE=fp16" in line and "--model-config-name=cpu" in line
    assert "--http-address=127.0.0.1" in line and "LD_LIBRARY_PATH=" in line
    pinned = subprocess.run([*argv, "--config-name", "default"], capture_output=True, text=True, timeout=120,
                            check=True)
    assert "model config config.pbtxt (--config-name default: the production binding" in pinned.stderr
    assert "--model-config-name" not in pinned.stdout  # config.pbtxt itself, whatever this host has
    rows = subprocess.run([*RNGD_PD, "devices", "--json", "--repository", str(repo)],
                          capture_output=True, text=True, timeout=120, check=True).stdout.splitlines()
    kinds = [json.loads(r) for r in rows]
    assert kinds[0] == {"kind": "cpu", "available": True, "cards": ["cpu"], "reason": ""}
    assert kinds[-1]["config_name"] == "cpu"
    smi = next(r["furiosa_smi"] for r in kinds if "furiosa_smi" in r)  # the RNGD cards furiosa-smi sees
    assert isinstance(smi["devices"], list) and ("error" in smi)


@pytest.mark.e2e
def test_serve_runs_until_sigterm_and_leaves_nothing(tmp_path: Path) -> None:
    require_tritonserver()
    repo = echo_repository(tmp_path)
    argv = [*RNGD_PD, "serve", "--repository", str(repo), "--kv-transport", "tcp", "--openai-port", "0",
            "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--ready-timeout", "120"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(("serve: openai", "serve: stopped")) or proc.poll() is not None:
                break
        urls = re.search(r"http (\S+)\s+grpc (\S+)\s+metrics (\S+)", "".join(lines))
        openai = re.search(r"serve: openai (http://\S+)/v1", lines[-1])
        assert urls and openai, "".join(lines)
        try:  # the front end answers (503: the echo repository has no `pd` model)
            urllib.request.urlopen(f"{openai[1]}/health", timeout=10)
        except urllib.error.HTTPError as exc:
            assert exc.code == 503
        assert any("model config cpu" in ln for ln in lines)
        body = json.dumps({"input_ids": [9]}).encode()
        req = urllib.request.Request(f"{urls[1]}/v2/models/echo/generate_stream", body)
        assert b"length" in urllib.request.urlopen(req, timeout=30).read()
        metrics = urllib.request.urlopen(urls[3], timeout=10).read().decode()
        assert 'airm_kv_transfer_ms{kv_transport="tcp",model="echo"}' in metrics  # --kv-transport reached it
        assert processes_mentioning(str(repo))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert "serve: stopped" in proc.stdout.read()
        with pytest.raises(urllib.error.URLError):  # the front end stopped with it
            urllib.request.urlopen(f"{openai[1]}/health", timeout=5)
        deadline = time.monotonic() + 5
        while processes_mentioning(str(repo)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert processes_mentioning(str(repo)) == []
    finally:
        stop_and_reap(proc, repo)


@pytest.mark.e2e
def test_server_dies_with_a_killed_serve(tmp_path: Path) -> None:
    require_tritonserver()
    repo = echo_repository(tmp_path)
    argv = [*RNGD_PD, "serve", "--repository", str(repo), "--openai-port", "-1",
            "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("serve: triton http"):
                break
        assert processes_mentioning(str(repo))
        proc.kill()  # no chance to clean up: tritonserver gets SIGTERM through PR_SET_PDEATHSIG
        proc.wait(10)
        deadline = time.monotonic() + 30
        while processes_mentioning(str(repo)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert processes_mentioning(str(repo)) == []
    finally:
        stop_and_reap(proc, repo)


@pytest.mark.e2e
def test_sigterm_while_models_load_stops_at_once(tmp_path: Path) -> None:
    require_tritonserver()
    repo = echo_repository(tmp_path)
    argv = [*RNGD_PD, "serve", "--repository", str(repo), "--openai-port", "-1", "--param", "init_delay_s=60",
            "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 30
        while not any("echo/1/model.py" in c for c in _stub_cmdlines(repo)):
            assert time.monotonic() < deadline and proc.poll() is None, "the echo stub never started"
            time.sleep(0.2)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(40) == 0
        assert time.monotonic() - t0 < 40  # not the 60 s the model takes to load
        assert "serve: ready" not in proc.stdout.read()
    finally:
        stop_and_reap(proc, repo)
    assert processes_mentioning(str(repo)) == []


@pytest.mark.e2e
def test_a_tritonserver_killed_while_loading_is_started_again(tmp_path: Path) -> None:
    """Triton 2.51 sometimes aborts while it loads the models (lock_exception, heavily loaded hosts):
    serve starts it again under its restart policy instead of giving up."""
    require_tritonserver()
    repo = echo_repository(tmp_path)
    argv = [*RNGD_PD, "serve", "--repository", str(repo), "--openai-port", "-1", "--param",
            "abort_first_start=true", "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 240
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("serve: ready") or time.monotonic() > deadline:
                break
        out = "".join(seen)
        assert "tritonserver was killed by signal 6 while loading the models; restarting" in out, out[-2000:]
        assert "tritonserver ready again" in out and proc.poll() is None
    finally:
        stop_and_reap(proc, repo)


@pytest.mark.e2e
@pytest.mark.long
def test_a_tritonserver_that_hangs_while_loading_is_restarted_then_given_up(tmp_path: Path) -> None:
    """A start that never gets ready (Triton 2.51 waiting for a stub whose launch handshake failed) is
    stopped at --ready-timeout and retried under the policy; past it serve exits 1 saying why."""
    require_tritonserver()
    repo = echo_repository(tmp_path)
    argv = [*RNGD_PD, "serve", "--repository", str(repo), "--openai-port", "-1", "--param", "init_delay_s=60",
            "--ready-timeout", "8", "--max-restarts", "1", "--http-port", "0", "--grpc-port", "0",
            "--metrics-port", "0"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == 1, out[-2000:]
        assert "did not become ready in 8 s (stopped it); restarting tritonserver (restart 1)" in out
        assert "giving up" in out
    finally:
        stop_and_reap(proc, repo)


class _ServeOutput:
    """`rngd-pd serve` run with `argv`, its output read line by line on a thread, so a test can wait
    for what serve says while it acts on the server."""

    def __init__(self, argv: list[str]) -> None:
        import threading

        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.seen: list[str] = []
        threading.Thread(target=lambda: self.seen.extend(self.proc.stdout), daemon=True).start()

    def wait_for(self, text: str, timeout: float) -> str:
        """All output so far once a line starts with `text`; fails at `timeout` or if serve exits."""
        deadline = time.monotonic() + timeout
        while not any(line.startswith(text) for line in list(self.seen)):
            assert time.monotonic() < deadline and self.proc.poll() is None, "".join(self.seen)[-3000:]
            time.sleep(0.2)
        return "".join(self.seen)

    def grpc_url(self) -> str:
        """Triton's gRPC address, from the line serve prints once tritonserver is up."""
        return re.search(r"grpc (\S+)\s+metrics", self.wait_for("serve: triton http", 240))[1]


def _echo_stream(url: str, ids: list[int], timeout: float) -> list[int] | str:
    """Token ids streamed back by `echo` over gRPC, or the error text."""
    import queue

    import numpy as np
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    got: queue.SimpleQueue = queue.SimpleQueue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    final = False
    try:
        inp = grpcclient.InferInput("input_ids", [len(ids)], "INT32")
        inp.set_data_from_numpy(np.asarray(ids, dtype=np.int32))
        client.async_stream_infer("echo", [inp], enable_empty_final_response=True)
        out: list[int] = []
        while True:
            result, error = got.get(timeout=timeout)
            if error is not None:
                return str(error)
            ids_ = result.as_numpy("output_ids")
            out += [] if ids_ is None else [int(i) for i in ids_.reshape(-1)]
            if result.get_response().parameters["triton_final_response"].bool_param:
                final = True
                return out
    except Exception as exc:  # the test reads what happened
        return f"{type(exc).__name__}: {exc}"
    finally:
        with contextlib.suppress(Exception):
            client.stop_stream(cancel_requests=not final)  # see rngd_pd.testing.e2e.stream_infer
            client.close()


@pytest.mark.e2e
@pytest.mark.long
def test_a_stub_that_hangs_alive_is_found_by_its_waiting_requests_and_restarted(tmp_path: Path) -> None:
    """A stub that never returns from execute (alive and healthy to Triton, as a deadlocked one is:
    README, Known limits) leaves requests waiting; after --hang-timeout serve restarts tritonserver,
    and the model answers again."""
    require_tritonserver()
    import threading

    repo = echo_repository(tmp_path)
    serve = _ServeOutput([*RNGD_PD, "serve", "--repository", str(repo), "--openai-port", "-1", "--param",
                          "stall_first_start=true", "--hang-timeout", "6", "--http-port", "0",
                          "--grpc-port", "0", "--metrics-port", "0"])
    try:
        grpc_url = serve.grpc_url()
        stuck: list = [None] * 3  # one reaches the stalled execute, two wait in Triton's queue

        def ask(i: int) -> None:
            stuck[i] = _echo_stream(grpc_url, [1, 2], 120)

        threads = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(3)]
        for t in threads:
            t.start()
        t0 = time.monotonic()
        out = serve.wait_for("serve: tritonserver ready again", 150)
        assert "serve: stub of model echo is hung (" in out, out[-3000:]
        assert "restarting tritonserver (restart 1)" in out, out[-3000:]
        assert 6 <= time.monotonic() - t0 < 120
        for t in threads:
            t.join(30)
        assert all(isinstance(r, str) for r in stuck), stuck  # they ended with an error, not hung on
        assert _echo_stream(grpc_url, [3, 4, 5], 60) == [3, 4, 5]
        assert serve.proc.poll() is None
    finally:
        stop_and_reap(serve.proc, repo)


@pytest.mark.e2e
@pytest.mark.long
def test_a_stopped_stub_is_restarted(tmp_path: Path) -> None:
    """A SIGSTOPped stub: Triton fails its requests at once with "not healthy" and logs nothing;
    serve sees the stub stopped in /proc for 10 s and restarts tritonserver; echo answers again."""
    require_tritonserver()
    repo = echo_repository(tmp_path)
    serve = _ServeOutput([*RNGD_PD, "serve", "--repository", str(repo), "--openai-port", "-1",
                          "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"])
    try:
        grpc_url = serve.grpc_url()
        assert _echo_stream(grpc_url, [1, 2], 60) == [1, 2]
        stubs = processes_mentioning(str(repo / "echo" / "1" / "model.py"))
        assert len(stubs) == 1, stubs
        os.kill(stubs[0], signal.SIGSTOP)  # our own server's stub
        t0 = time.monotonic()
        out = serve.wait_for("serve: tritonserver ready again", 150)
        assert f"serve: stub of model echo (pid {stubs[0]}) is stopped (state T" in out, out[-3000:]
        assert 10 <= time.monotonic() - t0 < 120
        assert _echo_stream(grpc_url, [3, 4, 5], 60) == [3, 4, 5]
        assert serve.proc.poll() is None
    finally:
        stop_and_reap(serve.proc, repo)


def _stub_cmdlines(repo: Path) -> list[str]:
    out = []
    for pid in processes_mentioning(str(repo)):
        with contextlib.suppress(OSError):
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
    return out


ENSEMBLE = """name: "llm"
platform: "ensemble"
max_batch_size: 0
input [ { name: "input_ids" data_type: TYPE_INT32 dims: [-1] } ]
output [ { name: "output_ids" data_type: TYPE_INT32 dims: [-1] },
         { name: "finish_reason" data_type: TYPE_STRING dims: [1] } ]
ensemble_scheduling { step [ { model_name: "echo" model_version: -1
  input_map { key: "input_ids" value: "input_ids" }
  output_map { key: "output_ids" value: "output_ids" }
  output_map { key: "finish_reason" value: "finish_reason" } } ] }
"""


@pytest.mark.e2e
def test_gateway_role_loads_only_the_ensemble_and_its_steps(tmp_path: Path) -> None:
    require_tritonserver()
    repo = echo_repository(tmp_path)
    (repo / "llm" / "1").mkdir(parents=True)
    (repo / "llm" / "config.pbtxt").write_text(ENSEMBLE)
    shutil.copytree(repo / "echo", repo / "prefill")  # a model the gateway must not load
    (repo / "prefill" / "config.pbtxt").write_text((repo / "echo" / "config.pbtxt").read_text()
                                                   .replace('name: "echo"', 'name: "prefill"'))
    shutil.rmtree(repo / "prefill" / "configs")
    argv = [*RNGD_PD, "serve", "--repository", str(repo), "--role", "gateway", "--openai-port", "-1",
            "--prefill-url", "127.0.0.1:1", "--decode-url", "127.0.0.1:2",
            "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(("serve: triton http", "serve: stopped")):
                break
        http = re.search(r"triton http (\S+)", lines[-1])
        assert http, "".join(lines)
        req = urllib.request.Request(f"{http[1]}/v2/repository/index", b"{}")
        index = {m["name"]: m.get("state") for m in json.load(urllib.request.urlopen(req, timeout=10))}
        assert index["llm"] == "READY" and index["echo"] == "READY" and index.get("prefill") != "READY"
        body = json.dumps({"input_ids": [5, 6]}).encode()
        req = urllib.request.Request(f"{http[1]}/v2/models/llm/generate_stream", body)
        assert urllib.request.urlopen(req, timeout=30).read().count(b"output_ids") == 3
    finally:
        stop_and_reap(proc, repo)
