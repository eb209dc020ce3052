"""`rngd-pd serve`: run tritonserver on the model repository, plus the OpenAI front end.

Finds tritonserver, prepares the Python backend stub and its environment, picks the model config
variant from the devices present (`--config-name` overrides; the choice and the reason are printed),
passes model path / KV transport / KV dtype to the models as environment overrides, binds to
127.0.0.1 by default, waits until the models are ready, prints the endpoints, and on Ctrl-C or
SIGTERM stops everything it started (each child runs in its own process group, stubs included).
While it runs it supervises tritonserver (rngd_pd.serve.supervisor): a model stub that died, or
tritonserver exiting, turns the status file to `recovering` (the front end answers 503) and restarts
tritonserver with the same command, a bounded number of times.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from rngd_pd.config import kv_events
from rngd_pd.config.dtypes import COMPUTE_CHOICES, KV_DTYPES
from rngd_pd.config.env import (
    AIRM_KV_TRANSPORT,
    RNGD_PD_DECODE_URL,
    RNGD_PD_DTYPE,
    RNGD_PD_KV_DTYPE,
    RNGD_PD_KV_EVENTS_CONFIG,
    RNGD_PD_MODEL,
    RNGD_PD_PREFILL_URL,
    RNGD_PD_ROLE,
    RNGD_PD_SERVER_RESTARTS,
)
from rngd_pd.config.settings import param_env
from rngd_pd.devices import probe_devices
from rngd_pd.errors import ConfigError
from rngd_pd.host.stubs import Failure, StubWatch
from rngd_pd.kv.registry import require_servable
from rngd_pd.serve.server import (
    SHOWN_ENV,
    ServerConfig,
    TritonServer,
    TritonServerError,
    free_port,
    shell_command,
    stop_process_group,
)
from rngd_pd.serve.supervisor import ProgressWatch, RestartPolicy, Supervisor
from rngd_pd.wire.status import FAILED, STARTING, STOPPING

HELP = "serve the model repository with tritonserver (and the OpenAI front end)"

ROLE_MODELS: dict[str, tuple[str, ...] | None] = {
    "all": ("*",),  # every model in the repository (explicit mode: `rngd-pd swap` can reload one)
    "prefill": ("prefill",),
    "decode": ("decode",),
    "gateway": ("llm",),  # the ensemble loads preprocess, pd, postprocess with it
}
# (variant, the device kinds it needs); the first whose needs are met and that exists is chosen.
CONFIG_CHOICES: tuple[tuple[str | None, dict[str, tuple[str, ...]]], ...] = (
    (None, {"all": ("rngd", "atom"), "prefill": ("rngd",), "decode": ("atom",), "gateway": ()}),
    ("rngd", {"all": ("rngd",), "prefill": ("rngd",), "decode": ("rngd",), "gateway": ()}),
    ("cuda", {role: ("cuda",) for role in ROLE_MODELS}),
    ("cpu", {role: () for role in ROLE_MODELS}),
)


def default_repository() -> Path:
    """./model_repository when it exists, else the one of the source checkout."""
    here = Path.cwd() / "model_repository"
    return here if here.is_dir() else Path(__file__).resolve().parents[2] / "model_repository"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint dir (HF Llama) or .gguf; default: the embedded SmolLM2-135M")
    p.add_argument("--kv-transport",
                   help="KV transport name (airm.kv_transports); default $AIRM_KV_TRANSPORT or the config's")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, help="KV wire dtype (default: the config's, bf16)")
    p.add_argument("--dtype", choices=COMPUTE_CHOICES,
                   help="compute dtype (default auto: bf16 where the CPU/GPU has native bf16, e.g. "
                        "AVX512-BF16/AMX, else fp32; `rngd-pd devices` shows the choice); bf16 or fp32 "
                        "force one; fp32 gives the transformers oracle's tokens exactly")
    p.add_argument("--config-name",
                   help="tritonserver --model-config-name: cpu, cuda, rngd, or `default` for config.pbtxt "
                        "itself (prefill on RNGD, decode on ATOM; never probed, never a fallback); "
                        "unset: chosen from the devices present")
    p.add_argument("--host", default="127.0.0.1", help="address every endpoint binds to (default 127.0.0.1)")
    p.add_argument("--http-port", type=int, default=8000, help="Triton HTTP port (0 = any free port)")
    p.add_argument("--grpc-port", type=int, default=8001, help="Triton gRPC port (0 = any free port)")
    p.add_argument("--metrics-port", type=int, default=8002, help="Triton metrics port (0 = any free port)")
    p.add_argument("--openai-port", type=int, default=9000, help="OpenAI front end port (-1 = no front end)")
    p.add_argument("--repository", type=Path, default=None,
                   help="model repository (default ./model_repository)")
    p.add_argument("--role", choices=list(ROLE_MODELS), default="all",
                   help="all models, or one pod of the split layout: prefill, decode, gateway")
    p.add_argument("--prefill-url", help="gateway: gRPC host:port of the prefill server")
    p.add_argument("--decode-url", help="gateway: gRPC host:port of the decode server")
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                   help="set a model parameter in every model that has it (repeatable), e.g. max_len=512")
    p.add_argument("--kv-events-config", metavar="JSON",
                   help="publish prefill's KV cache events as vLLM does, e.g. '{\"enable_kv_cache_events\": "
                        "true, \"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\", "
                        "\"topic\": \"kv@POD@MODEL\"}' (vLLM's KVEventsConfig keys; default "
                        "$RNGD_PD_KV_EVENTS_CONFIG, else off; docs/kv-events.md)")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the models")
    p.add_argument("--max-restarts", type=int, default=5,
                   help="restarts of tritonserver (after a model's stub died) allowed within "
                        "--restart-window; past that serve exits 1 (default 5; 0 = exit at the first "
                        "failure)")
    p.add_argument("--restart-window", type=float, default=600.0,
                   help="seconds over which --max-restarts counts (default 600)")
    p.add_argument("--hang-timeout", type=float, default=180.0,
                   help="a model with requests waiting that runs none for this many seconds is hung "
                        "(its stub alive but stuck) and tritonserver is restarted (default 180; 0 = off)")
    p.add_argument("--status-file", type=Path, default=None,
                   help="where serve keeps its JSON status (ready/recovering/failed, reason, restarts) for "
                        "the front end and exec probes (default: a file in a temporary folder)")
    p.add_argument("--log-verbose", type=int, default=0, help="tritonserver --log-verbose level")
    p.add_argument("--print-command", action="store_true",
                   help="print the equivalent tritonserver shell command and exit")


def model_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment overrides the models read through rngd_pd.config.params."""
    env: dict[str, str] = {}
    pairs = ((RNGD_PD_MODEL, args.model), (AIRM_KV_TRANSPORT, args.kv_transport),
             (RNGD_PD_KV_DTYPE, args.kv_dtype), (RNGD_PD_DTYPE, args.dtype),
             (RNGD_PD_PREFILL_URL, args.prefill_url),
             (RNGD_PD_DECODE_URL, args.decode_url), (RNGD_PD_ROLE, args.role),
             (RNGD_PD_KV_EVENTS_CONFIG, args.kv_events_config))
    for var, value in pairs:
        if value:
            env[var.name] = str(Path(value).resolve()) if var is RNGD_PD_MODEL else value
    for item in args.param:
        name, _, value = item.partition("=")
        env[param_env(name.strip())] = value.strip()
    return env


PRODUCTION = "default"  # --config-name default: config.pbtxt itself (pods that must never fall back)


def choose_config_name(repository: Path, role: str, usable: set[str]) -> tuple[str | None, str]:
    """The --model-config-name for the devices that are usable here, and why."""
    for variant, needs in CONFIG_CHOICES:
        need = needs[role]
        if any(kind not in usable for kind in need):
            continue
        if variant is None:
            return None, f"production binding; {', '.join(need) or 'no device'} needed"
        if any(repository.glob(f"*/configs/{variant}.pbtxt")):
            why = f"{', '.join(need)} usable" if need else "no RNGD/ATOM/CUDA device usable here"
            return variant, why
    return None, "no configs/<variant>.pbtxt matches the usable devices"


def validate(args: argparse.Namespace, repository: Path) -> str | None:
    """A message for a bad combination of arguments, or None."""
    if not repository.is_dir():
        return f"model repository {repository} does not exist; pass --repository DIR"
    if args.model and not Path(args.model).exists():
        return f"--model {args.model} does not exist (a checkpoint directory or a .gguf file)"
    bad = [p for p in args.param if "=" not in p or not p.partition("=")[0].strip()]
    if bad:
        return f"--param takes NAME=VALUE, got {', '.join(bad)}"
    if args.role == "gateway" and not (args.prefill_url and args.decode_url):
        return "--role gateway needs --prefill-url and --decode-url (gRPC host:port of the other servers)"
    try:
        kv_events.parse(args.kv_events_config)
    except ConfigError as exc:
        return str(exc)
    if args.max_restarts < 0 or args.restart_window <= 0:
        return "--max-restarts must be >= 0 and --restart-window > 0"
    if args.hang_timeout < 0:
        return "--hang-timeout must be >= 0 (0 = off)"
    try:
        require_servable(args.kv_transport or AIRM_KV_TRANSPORT.get())
    except ConfigError as exc:
        return f"--kv-transport (or ${AIRM_KV_TRANSPORT.name}): {exc}"
    return None


def _usable_devices() -> set[str]:
    return {row.kind for row in probe_devices() if row.available}


def _frontend_argv(args: argparse.Namespace, grpc_url: str, status: Path | None = None) -> list[str]:
    argv = [sys.executable, "-m", "rngd_pd.cli", "frontend", "--triton-url", grpc_url,
            "--host", args.host, "--port", str(args.openai_port)]
    argv += ["--server-status", str(status)] if status is not None else []
    return argv + (["--model", args.model] if args.model else [])


def _start_frontend(args: argparse.Namespace, grpc_url: str,
                    status: Path | None = None) -> subprocess.Popen | None:
    """The OpenAI front end as a child process (`rngd-pd frontend`), or None when unavailable/disabled."""
    if args.openai_port < 0 or args.role not in ("all", "gateway"):
        return None
    if importlib.util.find_spec("rngd_pd.commands.frontend") is None:
        print("serve: rngd_pd.commands.frontend is not available; no OpenAI front end", flush=True)
        return None
    if args.openai_port == 0:
        args.openai_port = free_port(args.host)
    return subprocess.Popen(_frontend_argv(args, grpc_url, status), start_new_session=True,
                            stdin=subprocess.DEVNULL)


def _wait_port(host: str, port: int, proc: subprocess.Popen, stop: threading.Event,
               timeout: float = 120.0) -> bool:
    """Wait until the front end accepts connections (False if it exited, a signal came, or timeout)."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and not stop.is_set() and time.monotonic() < deadline:
        with socket.socket() as s:
            s.settimeout(1)
            if s.connect_ex((host, port)) == 0:
                return True
        time.sleep(0.2)
    print(f"serve: the OpenAI front end is not listening on {host}:{port}", flush=True)
    return False


def _supervise(supervisor, frontend: subprocess.Popen | None, stop: threading.Event) -> int:
    """Until a signal (0), the front end exiting (its code, or 1) or the supervisor giving up (1)."""
    while not stop.wait(supervisor.poll_s):
        if frontend is not None and (code := frontend.poll()) is not None:
            print(f"serve: the OpenAI front end exited with code {code}; stopping", flush=True)
            return code or 1
        code = supervisor.step()
        if code is not None:
            return code
    return 0


def run(args: argparse.Namespace) -> int:
    repository = (args.repository or default_repository()).resolve()
    problem = validate(args, repository)
    if problem:
        print(f"serve: {problem}", file=sys.stderr)
        return 2
    if args.config_name == PRODUCTION:
        config_name, why = None, f"--config-name {PRODUCTION}: the production binding, no device probing"
    elif args.config_name:
        config_name, why = args.config_name, "from --config-name"
    else:
        config_name, why = choose_config_name(repository, args.role, _usable_devices())
    print(f"serve: model config {config_name or 'config.pbtxt'} ({why})", flush=True,
          file=sys.stderr if args.print_command else sys.stdout)
    models = ROLE_MODELS[args.role]
    extra = ("--model-control-mode=explicit", *(f"--load-model={m}" for m in models)) if models else ()
    cfg = ServerConfig(repository, config_name, args.host, args.http_port, args.grpc_port, args.metrics_port,
                       env=model_env(args), log_verbose=args.log_verbose, extra_args=extra)

    watch = StubWatch()
    try:
        server = TritonServer(cfg, on_line=watch.log_line)
    except TritonServerError as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 1
    if args.print_command:
        print(shell_command(server.command, server.env, (*SHOWN_ENV, *cfg.env)))
        return 0
    return _serve(args, server, watch)


def _serve(args: argparse.Namespace, server, watch) -> int:
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    own_dir = None if args.status_file else Path(tempfile.mkdtemp(prefix="rngd-pd-serve-"))
    status = (args.status_file or own_dir / "status.json").resolve()  # type: ignore[operator]
    status.parent.mkdir(parents=True, exist_ok=True)
    supervisor = Supervisor(server, status, stop, RestartPolicy(args.max_restarts, args.restart_window),
                            ready_timeout_s=args.ready_timeout, watch=watch,
                            progress=ProgressWatch(hang_s=args.hang_timeout))
    frontend = None
    code = 1
    try:
        supervisor.set_status(STARTING, "loading the models")
        print(f"serve: status file {status}", flush=True)
        t0 = time.monotonic()
        # the models can tell a restarted server from the first one
        server.cfg.env[RNGD_PD_SERVER_RESTARTS.name] = "0"
        server.start()
        try:
            server.wait_ready(args.ready_timeout, cancel=stop)
        except TritonServerError as exc:
            signal_no = -(server.proc.returncode or 0) if server.proc is not None else 0
            hung = "not ready after" in str(exc)
            if stop.is_set() or (signal_no <= 0 and not hung):  # a model that cannot load: no retry
                print(f"serve: {exc}", file=sys.stderr)
                supervisor.set_status(FAILED, str(exc).splitlines()[0])
                return 0 if stop.is_set() else 1
            # Triton 2.51 on a heavily loaded host: its Python backend aborts while loading
            # (boost::interprocess::lock_exception), or its stub-launch handshake fails and it waits
            # for a stub that never exits; both are retried under the restart policy
            print(f"serve: {str(exc).splitlines()[0]}", file=sys.stderr)
            crashed = Failure(f"did not become ready in {args.ready_timeout:.0f} s (stopped it)" if hung else
                              f"was killed by signal {signal_no} while loading the models")
            code = supervisor.recover(crashed)
            if code is not None:
                return code
        stubs = supervisor.watching()
        print(f"serve: ready in {time.monotonic() - t0:.1f} s; watching {len(stubs)} model stubs "
              f"({', '.join(f'{s.instance} pid {s.pid}' for s in stubs) or 'none'})", flush=True)
        print(f"serve: triton http {server.http_url}  grpc {server.grpc_url}  metrics {server.metrics_url}",
              flush=True)
        frontend = _start_frontend(args, server.grpc_url, status)
        if frontend is not None and _wait_port(args.host, args.openai_port, frontend, stop):
            print(f"serve: openai http://{args.host}:{args.openai_port}/v1", flush=True)
        code = _supervise(supervisor, frontend, stop)
        return code
    finally:
        if code == 0:
            supervisor.set_status(STOPPING)
        if frontend is not None:
            stop_process_group(frontend, grace_s=10.0)
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)
        print("serve: stopped", flush=True)
