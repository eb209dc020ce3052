"""Start a real tritonserver for a test: free 127.0.0.1 ports, bounded readiness wait, always stopped.

    from tests.triton_harness import triton_server

    with triton_server(repo, config_name="cpu", env={"AIRM_KV_TRANSPORT": "tcp"}) as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)

It is `rngd_pd.serve.server.TritonServer` (the same launcher `rngd-pd serve` uses) with the log
written to a file whose tail is attached to any start failure, and a failure naming `make setup`
where no tritonserver is installed (it comes with the nvidia-pytriton dependency). The server runs in
its own process group and is stopped (SIGTERM, then SIGKILL) with every Python stub it started. The
repository it serves is laid out with rngd_pd.testing.repository (shared with bench/).
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from rngd_pd.config.env import RNGD_PD_TEST_READY_TIMEOUT
from rngd_pd.serve.server import ServerConfig, TritonServer, TritonServerError, find_tritonserver

READY_TIMEOUT_S = RNGD_PD_TEST_READY_TIMEOUT.get()


def require_tritonserver() -> None:
    """Fail the calling test when no tritonserver is installed, naming what installs it."""
    try:
        find_tritonserver()
    except TritonServerError as exc:
        pytest.fail(f"tritonserver unavailable: {exc} (`make setup` installs it: nvidia-pytriton)")


@contextlib.contextmanager
def triton_server(repository: str | Path, config_name: str | None = None,
                  env: Mapping[str, str] | None = None, *, models: Sequence[str] = (),
                  timeout: float = READY_TIMEOUT_S, log_verbose: int = 0,
                  extra_args: Sequence[str] = ()) -> Iterator[TritonServer]:
    """A ready tritonserver serving `repository`; stopped (process group) on exit, also on failure."""
    require_tritonserver()
    cfg = ServerConfig(Path(repository), config_name, http_port=0, grpc_port=0, metrics_port=0,
                       env=dict(env or {}), log_verbose=log_verbose, extra_args=tuple(extra_args))
    log_dir = Path(tempfile.mkdtemp(prefix="rngd-pd-triton-"))
    server = TritonServer(cfg, log=log_dir / "tritonserver.log")
    try:
        server.start()
        server.wait_ready(timeout, models)
        yield server
    except BaseException:
        sys.stderr.write(f"--- tritonserver log (errors and tail) ---\n{server.log_tail(60)}\n")
        raise
    finally:
        server.stop()
        shutil.rmtree(log_dir, ignore_errors=True)


@contextlib.contextmanager
def shm_server(models: Sequence[str], env: Mapping[str, str] | None = None,
               prefix: str = "rngd-pd-shm-") -> Iterator[TritonServer]:
    """A ready tritonserver (cpu config) serving a repository of just `models`, the KV handed over by
    shm in a root of its own under /dev/shm; the root and the repository go with it."""
    from rngd_pd.testing import e2e as E

    shm_root = tempfile.mkdtemp(prefix=prefix, dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    repo = E.subset_repository(list(models))
    try:
        with triton_server(repo, "cpu", {"AIRM_KV_TRANSPORT": "shm", "PD_SHM_ROOT": shm_root,
                                         **(env or {})}) as server:
            yield server
    finally:
        shutil.rmtree(shm_root, ignore_errors=True)
        shutil.rmtree(repo, ignore_errors=True)
