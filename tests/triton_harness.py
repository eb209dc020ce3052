"""Start a real tritonserver for a test: free 127.0.0.1 ports, bounded readiness wait, always stopped.

    from tests.triton_harness import triton_server, server_fixture

    with triton_server(repo, config_name="cpu", env={"AIRM_KV_TRANSPORT": "tcp"}) as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)

    llm_server = server_fixture(REPO, config_name="cpu", scope="module")   # in a test module

It is `rngd_pd.serve.server.TritonServer` (the same launcher `rngd-pd serve` uses) with the log
written to a file whose tail is attached to any start failure. The server runs in its own process
group and is stopped (SIGTERM, then SIGKILL) with every Python stub it started.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from rngd_pd.serve.server import ServerConfig, TritonServer, TritonServerError, find_tritonserver
from rngd_pd.wire.tensors import ModelSpec, TensorSpec

READY_TIMEOUT_S = float(os.environ.get("RNGD_PD_TEST_READY_TIMEOUT", "180"))


def require_tritonserver() -> None:
    """Skip the calling test when no tritonserver is installed (with the reason)."""
    try:
        find_tritonserver()
    except TritonServerError as exc:
        pytest.skip(f"tritonserver unavailable: {exc}")


@contextlib.contextmanager
def triton_server(repository: str | Path, config_name: str | None = None,
                  env: Mapping[str, str] | None = None, *, models: Sequence[str] = (),
                  timeout: float = READY_TIMEOUT_S, log_verbose: int = 0) -> Iterator[TritonServer]:
    """A ready tritonserver serving `repository`; stopped (process group) on exit, also on failure."""
    require_tritonserver()
    cfg = ServerConfig(Path(repository), config_name, http_port=0, grpc_port=0, metrics_port=0,
                       env=dict(env or {}), log_verbose=log_verbose)
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


def server_fixture(repository: str | Path, config_name: str | None = None,
                   env: Mapping[str, str] | None = None, *, scope: str = "module",
                   models: Sequence[str] = (), timeout: float = READY_TIMEOUT_S):
    """A pytest fixture yielding a ready TritonServer for `repository` (module-scoped by default)."""

    @pytest.fixture(scope=scope)
    def _server() -> Iterator[TritonServer]:
        with triton_server(repository, config_name, env, models=models, timeout=timeout) as server:
            yield server

    return _server


def config_pbtxt(spec: ModelSpec, parameters: Mapping[str, str] | None = None,
                 instances: int = 1) -> str:
    """A python-backend config.pbtxt for `spec` (tensors from the spec; parameters as strings)."""

    def tensor(t: TensorSpec, optional: bool) -> str:
        opt = " optional: true" if optional and t.optional else ""
        return f'  {{ name: "{t.name}" data_type: {t.config_dtype} dims: {list(t.dims)}{opt} }}'

    lines = [f'name: "{spec.name}"', 'backend: "python"', "max_batch_size: 0"]
    if spec.decoupled:
        lines.append("model_transaction_policy { decoupled: true }")
    lines.append("input [\n" + ",\n".join(tensor(t, True) for t in spec.inputs) + "\n]")
    lines.append("output [\n" + ",\n".join(tensor(t, False) for t in spec.outputs) + "\n]")
    lines.append(f"instance_group [ {{ count: {instances} kind: KIND_CPU }} ]")
    for key, value in (parameters or {}).items():
        lines.append(f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}')
    return "\n".join(lines) + "\n"


def write_model(repository: Path, name: str, model_py: Path, config: str,
                variants: Mapping[str, str] | None = None) -> Path:
    """Lay out `<repository>/<name>/{config.pbtxt, configs/<variant>.pbtxt, 1/model.py}`."""
    root = repository / name
    (root / "1").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(model_py, root / "1" / "model.py")
    (root / "config.pbtxt").write_text(config)
    for variant, text in (variants or {}).items():
        (root / "configs").mkdir(exist_ok=True)
        (root / "configs" / f"{variant}.pbtxt").write_text(text)
    return root
