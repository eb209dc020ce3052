"""e2e: a model stub SIGKILLed under load is noticed and recovered by `rngd-pd serve` by itself.

One `rngd-pd serve --dtype fp32` (cpu config, shm transport, OpenAI front end; the repository without
`colocated`) serves the whole module. For each of decode, prefill and pd in turn, while 8 streams run
(3 gRPC to `pd`, 3 gRPC to `llm`, 2 through the front end with the openai SDK), that model's
`triton_python_backend_stub` is SIGKILLed:

* the front end's /health turns 503 naming the dead stub within seconds, and new requests get an
  OpenAI-shaped 503 (`server_recovering`);
* every in-flight request ends with an error within 30 s naming what failed (pd names a dead decode or
  prefill stub itself; for a dead pd, serve's status does, through the front end);
* without anyone touching the server, /health is 200 again within 120 s (or 1.5 x the server's first
  start, where a loaded host made that longer) and greedy tokens equal the
  ones served before the kill; `rngd_pd_server_restarts_total` counted the restart, and serve's log
  says what it did;
* the KV the killed server left in PD_SHM_ROOT is reclaimed: keys published but never pulled are gone
  after the TTL (set to KV_TTL_S here), the slot pools of the dead stubs' writers once a live one
  sweeps, and nothing is left under `keys/` once the server is idle.

Each case's timings (kill -> /health 503, in-flight requests ended, /health 200, KV reclaimed) are
printed; with RNGD_PD_FAULT_TIMINGS=FILE they are also written there as JSON, with the host, the
commit and the load average (bench/results/faults-2026-12-07/ holds one such run).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import openai
import pytest

from rngd_pd.config.env import RNGD_PD_FAULT_TIMINGS
from rngd_pd.host.stubs import stub_processes
from rngd_pd.serve.server import free_port
from rngd_pd.testing import e2e as E
from tests.test_triton_serve import stop_and_reap
from tests.triton_harness import require_tritonserver

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.long]

MODEL = "SmolLM2-135M-Instruct"
PROMPT = E.PROMPTS[0]
LONG = 1024  # tokens a loaded stream asks for (ignore_eos): still running when the stub is killed
ERROR_WITHIN_S = 30.0
RECOVER_WITHIN_S = 120.0  # or, where this server's first start took longer, 1.5 x that (Serve.recover_s)
START_TIMEOUT_S = float(os.environ.get("RNGD_PD_TEST_READY_TIMEOUT", "300"))
KV_TTL_S = 30.0  # AIRM_KV_SHM_TTL_S of the served models: how long an unpulled key may stay
RECLAIM_WITHIN_S = KV_TTL_S + 30.0  # after the restart: the TTL, plus sweeps (every <= 5 s) and load


@dataclass
class Serve:
    proc: subprocess.Popen
    repo: Path
    log: Path
    shm_root: Path
    grpc_url: str = ""
    openai_url: str = ""
    kills: dict[str, int] = field(default_factory=dict)
    timings: list[dict] = field(default_factory=list)
    start_s: float = 0.0  # serve's own "ready in" of the first start

    @property
    def recover_s(self) -> float:
        """How long a restart may take: RECOVER_WITHIN_S, or 1.5 x the first start where that took
        longer (a restart reloads every model: on a loaded 2-core host the first start alone took
        117 s, seen 2026-12-07 at a load average of 8-13)."""
        return max(RECOVER_WITHIN_S, 1.5 * self.start_s)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def tritonserver_pid(self) -> int:
        """The current tritonserver child of serve (it changes with every restart)."""
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    stat = (entry / "stat").read_text()
                    argv0 = (entry / "cmdline").read_bytes().split(b"\0")[0]
                    if int(stat[stat.rfind(")") + 2:].split()[1]) == self.proc.pid and \
                            argv0.endswith(b"tritonserver"):
                        return int(entry.name)
        raise AssertionError(f"serve {self.proc.pid} has no tritonserver child\n{self.log_text()[-3000:]}")


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except (urllib.error.URLError, OSError) as exc:
        return 0, str(exc)


def _wait_healthy(serve: Serve, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        assert serve.proc.poll() is None, f"serve exited\n{serve.log_text()[-4000:]}"
        if _get(serve.openai_url + "/health")[0] == 200:
            return time.monotonic() - t0
        time.sleep(0.25)
    raise AssertionError(f"/health not 200 within {timeout:.0f} s\n{serve.log_text()[-4000:]}")


@pytest.fixture(scope="module")
def serve() -> Iterator[Serve]:
    require_tritonserver()
    work = Path(tempfile.mkdtemp(prefix="rngd-pd-faults-"))
    shm_root = tempfile.mkdtemp(prefix="rngd-pd-faults-shm-",
                                dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    repo = E.subset_repository(["llm", "preprocess", "postprocess", "pd", "prefill", "decode"])
    ports = [free_port() for _ in range(4)]
    argv = [sys.executable, "-m", "rngd_pd.cli", "serve", "--repository", str(repo), "--config-name", "cpu",
            "--dtype", "fp32", "--kv-transport", "shm", "--http-port", str(ports[0]), "--grpc-port",
            str(ports[1]), "--metrics-port", str(ports[2]), "--openai-port", str(ports[3]),
            "--status-file", str(work / "status.json"), "--ready-timeout", str(START_TIMEOUT_S),
            "--max-restarts", "5", "--restart-window", "900"]
    env = {**os.environ, "PD_SHM_ROOT": shm_root, "PYTHONUNBUFFERED": "1", "AIRM_KV_SHM_TTL_S": str(KV_TTL_S)}
    log = work / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    s = Serve(proc, repo, log, Path(shm_root))
    load_before = os.getloadavg()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S + 60
        while not (m := re.search(r"^serve: openai (http://\S+)/v1$", s.log_text(), re.M)):
            assert proc.poll() is None and time.monotonic() < deadline, f"serve did not start\n{s.log_text()}"
            time.sleep(0.5)
        s.openai_url = m[1]
        s.start_s = float(re.search(r"^serve: ready in ([\d.]+) s", s.log_text(), re.M)[1])
        s.grpc_url = re.search(r"grpc (\S+)\s+metrics", s.log_text())[1]
        yield s
    finally:
        stop_and_reap(proc, repo)
        _write_timings(s, load_before)
        sys.stderr.write("--- serve log (serve lines and errors) ---\n" + "\n".join(
            ln for ln in s.log_text().splitlines()
            if ln.startswith(("serve:", "E1", "E0")) and "CUDA" not in ln and "CudaDriver" not in ln) + "\n")
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm_root, ignore_errors=True)
        shutil.rmtree(repo, ignore_errors=True)


def _write_timings(serve: Serve, load_before: tuple[float, ...]) -> None:
    """The cases' timings as JSON where RNGD_PD_FAULT_TIMINGS names a file (else nothing is written)."""
    path = RNGD_PD_FAULT_TIMINGS.get()
    if path is None or not serve.timings:
        return
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")
    doc = {"test": "tests/test_e2e_faults.py", "commit": commit, "cpu": cpu, "cores": os.cpu_count(),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "load_average_1_5_15": {"start": [round(x, 2) for x in load_before],
                                   "end": [round(x, 2) for x in os.getloadavg()]},
           "setup": "rngd-pd serve --config-name cpu --dtype fp32 --kv-transport shm, 8 streams "
                    f"(3 gRPC pd, 3 gRPC llm, 2 OpenAI) of {LONG} tokens; AIRM_KV_SHM_TTL_S={KV_TTL_S:g}",
           "first_start_s": serve.start_s, "recovery_bound_s": serve.recover_s,
           "seconds_after_the_kill": serve.timings}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    sys.stderr.write(f"fault timings written to {path}\n")


# ------------------------------------------------------------------ the KV a killed server leaves


def _writer_dead(pool: Path) -> bool:
    """Whether a writer pool's flock is free (its process is gone: rngd_pd.kv.shm.pool)."""
    try:
        fd = os.open(pool / "lock", os.O_RDWR)
    except FileNotFoundError:
        return False  # being created, or being removed
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    finally:
        os.close(fd)


def _shm_state(root: Path) -> dict[str, set[str]]:
    """Published keys under PD_SHM_ROOT/keys, and the writer pools whose writer died."""
    keys = {p.name for p in (root / "keys").glob("*")}
    dead = {p.name for p in (root / "pool").glob("*") if p.is_dir() and _writer_dead(p)}
    return {"keys": keys, "dead_pools": dead}


def _bytes_under(paths: list[Path]) -> int:
    total = 0
    for p in paths:
        for f in p.rglob("*"):
            with contextlib.suppress(OSError):
                total += f.stat().st_size if f.is_file() else 0
    return total


def _wait_reclaimed(serve: Serve, left: dict[str, set[str]], deadline: float) -> dict[str, set[str]]:
    """Poll until none of the keys and dead pools in `left` remains and `keys/` is empty (nothing is
    in flight by then); returns what remains at the deadline (empty sets: all reclaimed)."""
    while True:
        remains = {"keys": _shm_state(serve.shm_root)["keys"],
                   "dead_pools": {p for p in left["dead_pools"] if (serve.shm_root / "pool" / p).exists()}}
        if not any(remains.values()) or time.monotonic() > deadline:
            return remains
        time.sleep(0.5)


# ------------------------------------------------------------------ clients


@dataclass
class Stream:
    """One in-flight request: tokens so far, how it ended (error text or None) and when."""

    name: str
    tokens: int = 0
    error: str | None = None
    ended_at: float | None = None
    first: threading.Event = field(default_factory=threading.Event)


def _grpc_stream(url: str, model: str, values: dict, s: Stream) -> None:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    responses: queue.SimpleQueue = queue.SimpleQueue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    final = False
    try:
        client.async_stream_infer(model, E.grpc_inputs(values), enable_empty_final_response=True,
                                  outputs=[grpcclient.InferRequestedOutput("output_ids")])
        while True:
            result, error = responses.get(timeout=ERROR_WITHIN_S + 60)
            if error is not None:
                s.error = str(error)
                return
            out = result.as_numpy("output_ids")
            if out is not None and out.size:
                s.tokens += int(out.size)
                s.first.set()
            if result.get_response().parameters["triton_final_response"].bool_param:
                final = True
                return
    except Exception as exc:  # recorded: the test says which stream failed how
        s.error = f"{type(exc).__name__}: {exc}"
    finally:
        s.ended_at = time.monotonic()
        s.first.set()
        with contextlib.suppress(Exception):
            client.stop_stream(cancel_requests=not final)  # see rngd_pd.testing.e2e.stream_infer
            client.close()


def _openai_stream(base: str, s: Stream) -> None:
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=ERROR_WITHIN_S + 60)
    try:
        for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=LONG, stream=True,
                                               temperature=0, extra_body={"ignore_eos": True}):
            if chunk.choices and chunk.choices[0].text:
                s.tokens += 1
                s.first.set()
    except Exception as exc:  # recorded, as above
        s.error = f"{type(exc).__name__}: {getattr(exc, 'message', exc)}"
    finally:
        s.ended_at = time.monotonic()
        s.first.set()


def _start_load(serve: Serve) -> tuple[list[Stream], list[threading.Thread]]:
    ids = E.prompt_ids(PROMPT)
    eos = {"ignore_eos": np.array([True])}
    jobs = []
    for i in range(3):
        jobs.append((Stream(f"grpc-pd-{i}"), _grpc_stream,
                     (serve.grpc_url, "pd", E.pd_inputs(ids, max_tokens=LONG, **eos))))
        jobs.append((Stream(f"grpc-llm-{i}"), _grpc_stream,
                     (serve.grpc_url, "llm", E.llm_inputs(PROMPT, max_tokens=LONG, **eos))))
    for i in range(2):
        jobs.append((Stream(f"openai-{i}"), _openai_stream, (serve.openai_url,)))
    threads = []
    for s, fn, args in jobs:
        threads.append(threading.Thread(target=fn, args=(*args, s), name=s.name, daemon=True))
        threads[-1].start()
    return [s for s, _, _ in jobs], threads


def _greedy(serve: Serve) -> tuple[list[int], str]:
    """Greedy tokens over gRPC `pd` and the greedy text through the front end (12 tokens each)."""
    ids = E.ids_of(E.stream_infer(serve.grpc_url, "pd", E.pd_inputs(E.prompt_ids(PROMPT)),
                                  ("output_ids", "finish_reason"), timeout=60))
    client = openai.OpenAI(base_url=serve.openai_url + "/v1", api_key="none", max_retries=0, timeout=60)
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=E.MAX_TOKENS, temperature=0)
    return ids, text.choices[0].text


def _restarts(serve: Serve) -> int:
    status, body = _get(serve.openai_url + "/metrics")
    assert status == 200, body
    return int(float(re.search(r"^rngd_pd_server_restarts_total (\S+)$", body, re.M)[1]))


def _watch_health(serve: Serve, until: threading.Event, seen: list) -> None:
    """Sample /health and a new request every 0.2 s: (time, health status, detail, new-request answer)."""
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 2}).encode()
    while not until.is_set():
        code, text = _get(serve.openai_url + "/health", timeout=3)
        answer = None
        if code == 503:
            req = urllib.request.Request(serve.openai_url + "/v1/completions", body,
                                         {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=10) as resp:
                    answer = (resp.status, resp.read().decode(), None)
            except urllib.error.HTTPError as exc:
                answer = (exc.code, exc.read().decode(), exc.headers.get("Retry-After"))
            except OSError as exc:
                answer = (0, str(exc), None)
        seen.append((time.monotonic(), code, text, answer))
        until.wait(0.2)


# ------------------------------------------------------------------ the faults


@pytest.mark.parametrize("victim", ["decode", "prefill", "pd"])
def test_killed_stub_under_load_is_recovered(serve: Serve, victim: str) -> None:
    _wait_healthy(serve, serve.recover_s)  # the previous case's recovery, if any
    before_ids, before_text = _greedy(serve)
    assert len(before_ids) == E.MAX_TOKENS and before_text
    restarts = _restarts(serve)

    streams, threads = _start_load(serve)
    for s in streams:
        assert s.first.wait(180), f"{s.name} got no token before the kill"
    assert all(s.error is None and s.ended_at is None for s in streams), [(s.name, s.error) for s in streams]
    stubs = {st.model: st for st in stub_processes(serve.tritonserver_pid())}
    assert victim in stubs, stubs
    seen: list = []
    stop_watch = threading.Event()
    watcher = threading.Thread(target=_watch_health, args=(serve, stop_watch, seen), daemon=True)
    t_kill = time.monotonic()
    os.kill(stubs[victim].pid, signal.SIGKILL)
    watcher.start()
    try:
        for t in threads:
            t.join(max(0.0, t_kill + ERROR_WITHIN_S - time.monotonic()))
        ended = {s.name: (s.error, None if s.ended_at is None else round(s.ended_at - t_kill, 1))
                 for s in streams}
        print(f"\n{victim}: in-flight requests ended (error, s after the kill): {ended}")
        late = [s.name for s in streams if s.ended_at is None or s.ended_at - t_kill > ERROR_WITHIN_S]
        assert not late, f"still running {ERROR_WITHIN_S:.0f} s after the kill: {late}; {ended}"
        assert all(s.error for s in streams), f"a request survived the restart without an error: {ended}"
        named = f"stub of model {victim} (pid {stubs[victim].pid}) died"
        for s in streams:
            if victim != "pd":  # pd itself names its dead callee, to the front end and tritonclient alike
                assert named in s.error, s.error
            elif s.name.startswith("openai"):  # pd is gone: serve's status names it, through the front end
                assert "The server is recovering" in s.error and named in s.error, s.error

        # pd ends its requests before serve has noticed (it polls every 0.5 s): wait for the restart to
        # begin before waiting for health, or an old, still healthy-looking server would count
        while _restarts(serve) <= restarts and time.monotonic() < t_kill + serve.recover_s:
            time.sleep(0.2)
        took = _wait_healthy(serve, max(1.0, t_kill + serve.recover_s - time.monotonic()))
        healthy_s = time.monotonic() - t_kill
        # what the killed server left behind; nothing has pushed or swept in the new one yet
        left_behind = _shm_state(serve.shm_root)
        dead_bytes = _bytes_under([serve.shm_root / "pool" / p for p in left_behind["dead_pools"]])
        print(f"{victim}: /health 200 again {healthy_s:.1f} s after the kill "
              f"(waited {took:.1f} s after the streams ended)")
    finally:
        stop_watch.set()
        watcher.join(15)

    unhealthy = [(t - t_kill, code, text, answer) for t, code, text, answer in seen if code != 200]
    assert unhealthy, "the front end never said it was not ready"
    first_t, _, detail, answer = unhealthy[0]
    assert first_t < 5.0, f"/health said 503 only {first_t:.1f} s after the kill"
    assert named in detail and "recovering" in detail, detail
    assert answer is not None and answer[0] == 503, answer
    error = json.loads(answer[1])["error"]
    assert error["type"] == "service_unavailable" and error["code"] == "server_recovering", error
    assert named in error["message"] and answer[2] == "5", answer

    after_ids, after_text = _greedy(serve)
    assert after_ids == before_ids and after_text == before_text
    correct_s = time.monotonic() - t_kill
    left = _wait_reclaimed(serve, left_behind, time.monotonic() + RECLAIM_WITHIN_S)
    reclaimed_s = time.monotonic() - t_kill
    print(f"{victim}: left behind {len(left_behind['keys'])} published keys, "
          f"{len(left_behind['dead_pools'])} dead writer pools ({dead_bytes} bytes); all reclaimed "
          f"{reclaimed_s:.1f} s after the kill")
    assert not any(left.values()), f"not reclaimed {RECLAIM_WITHIN_S:.0f} s after the restart: {left}"
    ended_after = [s.ended_at - t_kill for s in streams if s.ended_at is not None]
    serve.timings.append({
        "victim": victim, "health_503": round(first_t, 2),
        "requests_ended": [round(min(ended_after), 2), round(max(ended_after), 2)],
        "health_200": round(healthy_s, 1), "correct_tokens": round(correct_s, 1),
        "kv_reclaimed": round(reclaimed_s, 1),
        "kv_left_behind": {"keys": len(left_behind["keys"]), "dead_pool_bytes": dead_bytes,
                           "dead_writer_pools": len(left_behind["dead_pools"])}})
    assert _restarts(serve) == restarts + 1
    log = serve.log_text()
    assert f"serve: {named}; restarting tritonserver (restart {restarts + 1})" in log, log[-3000:]
    assert "serve: tritonserver ready again in" in log
    new = {st.model: st.pid for st in stub_processes(serve.tritonserver_pid())}
    assert set(new) == set(stubs) and new[victim] != stubs[victim].pid
