"""ai-rm adapter: KV transports by name, and the workload runner `run(workload, **config)`.

ai-rm loads transports through the `airm.kv_transports` entry points (or `load_transport(name)`
here) and starts serving through `airm.workloads: rngd-pd = rngd_pd.airm:run`. Other ai-rm
components are never imported; the KV path is selected only by name.

`run` starts one role as an `rngd-pd serve` process and returns the Popen (or `(argv, env)` with
dry_run). Workload.kind: `prefill` (a tritonserver with the prefill model), `decode` (the decode
model), `serve` (the gateway: llm ensemble + pd reaching prefill/decode by gRPC, and the OpenAI front
end), `all` (every model in one server). Config keys (the original's):

    kv_transport   shm                  airm.kv_transports name (AIRM_KV_TRANSPORT, --kv-transport)
    port           8000                 prefill/decode: Triton HTTP port (gRPC port+1, metrics port+2);
                                        serve/all: the OpenAI port (Triton HTTP, gRPC, metrics: port+1..3)
    seq_len        256                  longest prompt + output (parameter max_len of every model)
    prefill_url    127.0.0.1:8101       serve: gRPC host:port of the prefill server
    decode_url     127.0.0.1:8201       serve: gRPC host:port of the decode server
    metrics_port   port+2 / port+3      Triton metrics port, where the airm_* families are (AIRM_METRICS_PORT)
    args, env      none                 extra `rngd-pd serve` arguments, extra environment variables
    dry_run        False                return (argv, env) instead of starting

Also, for the pods' layout the Helm chart (deploy/helm/rngd-pd) uses:

    role           none                 prefill, decode, gateway or all: `rngd-pd serve --role ROLE` with
                                        the chart's ports (wins over Workload.kind, which may be absent):
                                        Triton HTTP on `port` (8000), gRPC port+1, metrics port+2 (or
                                        metrics_port) in every role; the gateway's OpenAI front end on
                                        openai_port; every endpoint on `host`
    host           0.0.0.0 with role    the address every endpoint binds to (without role: serve's
                                        127.0.0.1)
    openai_port    9000                 role gateway/all: the OpenAI front end's port

Workload.model becomes --model; for decode Workload.batch_hint becomes the decode slot count.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

from rngd_pd.config.env import AIRM_KV_TRANSPORT, AIRM_METRICS_PORT
from rngd_pd.config.settings import param_env
from rngd_pd.errors import ConfigError
from rngd_pd.kv.registry import known_names, load_transport, require_servable, transport_class

__all__ = ["KINDS", "build_command", "known_names", "load_transport", "run"]

KINDS = {"prefill": "prefill", "decode": "decode", "serve": "gateway", "all": "all"}
ROLES = ("prefill", "decode", "gateway", "all")  # `rngd-pd serve --role`, as the chart's pods run it
DEFAULTS: dict[str, Any] = {
    "kv_transport": AIRM_KV_TRANSPORT.default, "port": 8000, "seq_len": 256, "prefill_url": "127.0.0.1:8101",
    "decode_url": "127.0.0.1:8201", "metrics_port": None, "args": (), "env": None, "dry_run": False,
    "role": None, "host": None, "openai_port": 9000,
}
_TRANSPORT_CLASSES = {"ShmTransport": "shm", "TcpTransport": "tcp", "NixlUcxTransport": "nixl-ucx",
                      "NixlTransport": "nixl"}


def __getattr__(name: str) -> Any:
    """`rngd_pd.airm.ShmTransport` and friends, as the original exported them (imported on use)."""
    if name in _TRANSPORT_CLASSES:
        return transport_class(_TRANSPORT_CLASSES[name])
    raise AttributeError(f"module 'rngd_pd.airm' has no attribute {name!r}")


def _field(workload: Any, name: str, default: Any = None) -> Any:
    if isinstance(workload, Mapping):
        return workload.get(name, default)
    return getattr(workload, name, default)


def _ports(role: str, port: int, metrics_port: int | None) -> list[str]:
    if role in ("gateway", "all"):  # clients call the OpenAI front end on `port`
        http, ports = port + 1, ["--openai-port", str(port)]
    else:
        http, ports = port, ["--openai-port", "-1"]
    metrics = metrics_port if metrics_port is not None else http + 2
    return [*ports, "--http-port", str(http), "--grpc-port", str(http + 1), "--metrics-port", str(metrics)]


def _pod_ports(role: str, port: int, metrics_port: int | None, openai_port: int) -> list[str]:
    """The chart's layout: Triton on port..port+2 in every role, the OpenAI front end on its own port."""
    metrics = metrics_port if metrics_port is not None else port + 2
    openai = openai_port if role in ("gateway", "all") else -1
    return ["--http-port", str(port), "--grpc-port", str(port + 1), "--metrics-port", str(metrics),
            "--openai-port", str(openai)]


def build_command(workload: Any, **config: Any) -> tuple[list[str], dict[str, str]]:
    """The `rngd-pd serve` argv and environment for one workload; ConfigError on a bad key or kind."""
    unknown = sorted(set(config) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"unknown workload config key(s) {', '.join(unknown)}; "
                          f"known: {', '.join(DEFAULTS)}")
    cfg = {**DEFAULTS, **config}
    require_servable(cfg["kv_transport"])  # ConfigError: unknown, or a transport serving cannot use
    if cfg["role"] is not None:
        if cfg["role"] not in ROLES:
            raise ConfigError(f"unknown role {cfg['role']!r}; known: {', '.join(ROLES)}")
        role = cfg["role"]
        host = cfg["host"] or "0.0.0.0"
        ports = ["--host", host, *_pod_ports(role, int(cfg["port"]), cfg["metrics_port"],
                                             int(cfg["openai_port"]))]
    else:
        kind = _field(workload, "kind", "serve")
        if kind not in KINDS:
            raise ConfigError(f"unknown workload kind {kind!r}; known: {', '.join(KINDS)}")
        role = KINDS[kind]
        ports = _ports(role, int(cfg["port"]), cfg["metrics_port"])
        if cfg["host"]:
            ports = ["--host", str(cfg["host"]), *ports]
    argv = [sys.executable, "-m", "rngd_pd.cli", "serve", "--role", role,
            "--kv-transport", cfg["kv_transport"], *ports,
            "--param", f"max_len={int(cfg['seq_len'])}"]
    model = _field(workload, "model")
    if model:
        argv += ["--model", str(model)]
    batch = _field(workload, "batch_hint")
    if role == "decode" and batch:
        argv += ["--param", f"num_slots={int(batch)}"]
    if role == "gateway":
        argv += ["--prefill-url", cfg["prefill_url"], "--decode-url", cfg["decode_url"]]
    argv += [str(a) for a in (cfg["args"] or ())]
    env = {AIRM_KV_TRANSPORT.name: cfg["kv_transport"], param_env("max_len"): str(int(cfg["seq_len"]))}
    metrics_at = argv[argv.index("--metrics-port") + 1]
    env[AIRM_METRICS_PORT.name] = metrics_at
    env.update({str(k): str(v) for k, v in (cfg["env"] or {}).items()})
    return argv, env


def run(workload: Any, **config: Any) -> subprocess.Popen | tuple[list[str], dict[str, str]]:
    """Start the workload's role as `rngd-pd serve` (own process group) and return the Popen.

    With dry_run=True nothing starts and `(argv, env)` is returned (env: the variables added to the
    current environment). Stop it with `os.killpg(proc.pid, signal.SIGTERM)` or proc.terminate():
    serve stops tritonserver, its stubs and the front end on SIGTERM.
    """
    argv, env = build_command(workload, **config)
    if config.get("dry_run"):
        return argv, env
    return subprocess.Popen(argv, env={**os.environ, **env}, start_new_session=True)
