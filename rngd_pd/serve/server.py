"""Find, launch and stop a real tritonserver serving a model repository.

The pieces `rngd-pd serve`, the test harness and `--print-command` share:

* `find_tritonserver()`: `$TRITONSERVER`, then `PATH`, then the binary `nvidia-pytriton` carries.
* `backend_directory()`: a cache folder of symlinks holding the Python backend plus the stub built
  for this interpreter's Python version (site-packages is never written to).
* `server_env()`: LD_LIBRARY_PATH for the bundled libraries, and PATH / PYTHONPATH / VIRTUAL_ENV so the
  stub process imports rngd_pd and torch from this environment.
* `TritonServer`: starts tritonserver in its own process group (the stubs are its children), waits for
  readiness with a bounded timeout, and stops the whole group, so no stub outlives it; with `on_line`
  its output passes through this process line by line (serve's supervisor reads the log that way).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shlex
import shutil
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from rngd_pd.config.env import LD_LIBRARY_PATH, PATH, PYTHONPATH, TRITONSERVER, VIRTUAL_ENV
from rngd_pd.config.settings import cache_root
from rngd_pd.errors import RngdPdError
from rngd_pd.host.children import die_with_parent
from rngd_pd.host.shm_refs import store_root
from rngd_pd.serve.procs import (
    remove_shm_regions,
    shm_regions,
    stop_process_group,
)

PY_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"
SYSTEM_BACKENDS = Path("/opt/tritonserver/backends")


class TritonServerError(RngdPdError):
    """tritonserver could not be found, did not start, or did not become ready in time."""


@dataclass(frozen=True)
class TritonInstall:
    """Where a tritonserver binary and its Python backend live."""

    binary: Path
    backends: Path           # contains python/libtriton_python.so
    stubs: Path | None       # python_backend_stubs/<X.Y>/triton_python_backend_stub (pytriton layout)
    libs: Path | None        # shared libraries to put on LD_LIBRARY_PATH

    @property
    def stub(self) -> Path:
        """The Python backend stub matching the running interpreter."""
        candidates = [self.backends / "python" / "triton_python_backend_stub"]
        if self.stubs is not None:
            candidates.insert(0, self.stubs / PY_VERSION / "triton_python_backend_stub")
        for path in candidates:
            if path.is_file():
                return path
        raise TritonServerError(
            f"no triton_python_backend_stub for Python {PY_VERSION} next to {self.binary} "
            f"(looked at {', '.join(map(str, candidates))}); install nvidia-pytriton into this "
            "environment or build the stub for this Python version"
        )


def _pytriton_install() -> TritonInstall | None:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    if not (root / "bin" / "tritonserver").is_file():
        return None
    libs = root.parent.parent / "nvidia_pytriton.libs"
    return TritonInstall(root / "bin" / "tritonserver", root / "backends", root / "python_backend_stubs",
                         libs if libs.is_dir() else None)


def _install_for(binary: Path) -> TritonInstall:
    """The install layout around a tritonserver binary named by $TRITONSERVER or found on PATH."""
    binary = binary.resolve()
    bundled = _pytriton_install()
    if bundled is not None and bundled.binary.resolve() == binary:
        return bundled
    local = binary.parent.parent / "backends"
    backends = local if (local / "python").is_dir() else SYSTEM_BACKENDS
    stubs = binary.parent.parent / "python_backend_stubs"
    return TritonInstall(binary, backends, stubs if stubs.is_dir() else None, None)


def find_tritonserver(env: Mapping[str, str] | None = None) -> TritonInstall:
    """Locate tritonserver: $TRITONSERVER, then PATH, then nvidia-pytriton's bundled binary."""
    path = TRITONSERVER.get(env)
    if path is not None:
        if not path.is_file() or not os.access(path, os.X_OK):
            raise TritonServerError(f"${TRITONSERVER.name}={path} is not an executable file; fix or unset it")
        return _install_for(path)
    on_path = shutil.which("tritonserver", path=PATH.get(env))
    if on_path:
        return _install_for(Path(on_path))
    bundled = _pytriton_install()
    if bundled is None:
        raise TritonServerError(
            "tritonserver not found: set $TRITONSERVER, put it on PATH, or `pip install nvidia-pytriton` "
            "into this environment (it carries tritonserver 2.51 with the Python backend)"
        )
    return bundled


def _link(target: Path, link: Path) -> None:
    """Point `link` at `target`, atomically, leaving a correct link alone (safe when run concurrently)."""
    if link.is_symlink() and Path(os.readlink(link)) == target:
        return
    tmp = link.with_name(f".{link.name}.{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    tmp.symlink_to(target)
    os.replace(tmp, link)


def backend_directory(install: TritonInstall, cache: Path | None = None) -> Path:
    """A --backend-directory whose python/ holds the backend files plus this Python's stub (symlinks)."""
    source = install.backends / "python"
    if not (source / "libtriton_python.so").is_file():
        raise TritonServerError(f"no Python backend at {source} (libtriton_python.so missing)")
    digest = hashlib.sha1(str(install.binary.resolve()).encode()).hexdigest()[:10]
    tag = f"py{PY_VERSION}-{digest}"
    root = (cache or cache_root()) / "triton-backends" / tag
    target = root / "python"
    target.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.name not in ("__pycache__", "triton_python_backend_stub"):
            _link(item.resolve(), target / item.name)
    _link(install.stub.resolve(), target / "triton_python_backend_stub")
    return root


def _prepend(value: str, current: str | None) -> str:
    return value if not current else f"{value}{os.pathsep}{current}"


def server_env(install: TritonInstall, extra: Mapping[str, str] | None = None,
               base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver and its stubs: bundled libraries, this venv, rngd_pd importable."""
    env = dict(os.environ if base is None else base)  # the whole environment, for the child
    if install.libs is not None:
        env[LD_LIBRARY_PATH.name] = _prepend(str(install.libs), LD_LIBRARY_PATH.get(env))
    env[PATH.name] = _prepend(str(Path(sys.executable).parent), PATH.get(env))
    if sys.prefix != sys.base_prefix:
        env[VIRTUAL_ENV.name] = sys.prefix
    package_parent = str(Path(__file__).resolve().parents[2])
    paths = [package_parent, sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    for path in reversed(dict.fromkeys(paths)):
        env[PYTHONPATH.name] = _prepend(path, PYTHONPATH.get(env))
    env.update(extra or {})
    return env


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class ServerConfig:
    """What to serve and where; ports 0 are replaced by free ports at start."""

    repository: Path
    config_name: str | None = None
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    env: dict[str, str] = field(default_factory=dict)
    log_verbose: int = 0
    exit_timeout_s: int = 10
    extra_args: tuple[str, ...] = ()
    exec_prefix: tuple[str, ...] = ()  # runs tritonserver through it, e.g. ("ip", "netns", "exec", NAME)

    def resolve_ports(self) -> None:
        """Replace each port 0 with a free port on `host` (any port is free in a fresh network
        namespace the prefix enters: then one free here on loopback)."""
        for name in ("http_port", "grpc_port", "metrics_port"):
            if getattr(self, name) == 0:
                setattr(self, name, free_port("127.0.0.1" if self.exec_prefix else self.host))


# The Python backend's thread pool runs every BLS call and response send; a BLS call to a decoupled
# model holds a thread until its first response. pd runs up to its max_inflight (32) requests at once,
# each holding two (prefill and decode), so the default of 32 threads could wedge prefill behind
# decode calls that wait for it. This leaves room for those plus sends and direct callers.
PYTHON_THREAD_POOL = 2 * 32 + 32


def build_command(install: TritonInstall, backend_dir: Path, cfg: ServerConfig) -> list[str]:
    """The tritonserver argv for `cfg` (addresses bound to cfg.host, 127.0.0.1 by default)."""
    cmd = [
        *cfg.exec_prefix,
        str(install.binary),
        f"--model-repository={Path(cfg.repository).resolve()}",
        f"--backend-directory={backend_dir}",
        f"--http-address={cfg.host}", f"--http-port={cfg.http_port}",
        f"--grpc-address={cfg.host}", f"--grpc-port={cfg.grpc_port}",
        f"--metrics-address={cfg.host}", f"--metrics-port={cfg.metrics_port}",
        "--allow-gpu-metrics=false",
        f"--exit-timeout-secs={cfg.exit_timeout_s}",
        f"--backend-config=python,thread-pool-size={PYTHON_THREAD_POOL}",
        f"--log-verbose={cfg.log_verbose}",
    ]
    if cfg.config_name:
        cmd.append(f"--model-config-name={cfg.config_name}")
    return cmd + list(cfg.extra_args)


def shell_command(cmd: Sequence[str], env: Mapping[str, str], keys: Sequence[str]) -> str:
    """A copy-pasteable shell line: the chosen environment variables, then the command."""
    assigns = [f"{k}={shlex.quote(env[k])}" for k in keys if k in env]
    return " ".join([*assigns, *map(shlex.quote, cmd)])


SHOWN_ENV = tuple(v.name for v in (LD_LIBRARY_PATH, PATH, PYTHONPATH, VIRTUAL_ENV))
_NOISE = ("CudaDriverHelper", "CUDA driver version is insufficient")  # harmless on CPU-only hosts


class TritonServer:
    """A tritonserver process we started (own process group), with its urls; a context manager.

    `start()` launches it, `wait_ready()` polls /v2/health/ready until every model is ready, the
    process exits (error with the log's tail) or the timeout passes, and `stop()` sends SIGTERM to the
    whole group, then SIGKILL after a grace period, so the Python stubs die with it.
    """

    def __init__(self, cfg: ServerConfig, install: TritonInstall | None = None,
                 log: Path | IO[bytes] | None = None, cache: Path | None = None,
                 on_line: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.install = install or find_tritonserver()
        self.backend_dir = backend_directory(self.install, cache)
        self._log = log
        self._log_file: IO[bytes] | None = None
        self._on_line = on_line
        self._relay: threading.Thread | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def env(self) -> dict[str, str]:
        return server_env(self.install, self.cfg.env)

    @property
    def command(self) -> list[str]:
        return build_command(self.install, self.backend_dir, self.cfg)

    @property
    def http_url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.cfg.host}:{self.cfg.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.metrics_port}/metrics"

    def start(self) -> TritonServer:
        """Launch tritonserver in a new session (process group); returns at once. Weight stores
        left by a server that was killed are removed first (rngd_pd.host.shm_refs)."""
        self.cfg.resolve_ports()
        self._sweep_weights()
        out: IO[bytes] | None = None
        if isinstance(self._log, Path):
            self._log_file = out = open(self._log, "wb")  # noqa: SIM115 - closed in stop()
        elif self._log is not None:
            out = self._log
        relay = self._on_line is not None and out is None
        self.proc = subprocess.Popen(self.command, env=self.env, stderr=subprocess.STDOUT,
                                     stdout=subprocess.PIPE if relay else out,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=die_with_parent)
        if relay:
            self._relay = threading.Thread(target=self._relay_log, args=(self.proc.stdout,),
                                           name="tritonserver-log", daemon=True)
            self._relay.start()
        return self

    def _relay_log(self, pipe: IO[bytes]) -> None:
        """Copy the server's output (stubs' included) to our stdout, handing each line to `on_line`."""
        sink = getattr(sys.stdout, "buffer", None)
        with contextlib.suppress(OSError, ValueError):
            for raw in pipe:
                if sink is not None:
                    with contextlib.suppress(OSError, ValueError):
                        sink.write(raw)
                        sink.flush()
                assert self._on_line is not None
                self._on_line(raw.decode(errors="replace"))

    def log_tail(self, lines: int = 12) -> str:
        """Error lines and the last lines of the server log (when it goes to a file)."""
        if not isinstance(self._log, Path) or not self._log.exists():
            return ""
        text = self._log.read_text(errors="replace").splitlines()
        errors = [ln for ln in text if ln.startswith("E") and not any(n in ln for n in _NOISE)]
        return "\n".join(dict.fromkeys(errors[-20:] + text[-lines:]))

    def _fail(self, what: str) -> TritonServerError:
        tail = self.log_tail()
        return TritonServerError(f"{what}" + (f"\n--- tritonserver log (tail) ---\n{tail}" if tail else ""))

    def is_ready(self, model: str | None = None) -> bool:
        """Whether /v2/health/ready (or one model's ready endpoint) answers 200."""
        path = f"/v2/models/{model}/ready" if model else "/v2/health/ready"
        try:
            with urllib.request.urlopen(self.http_url + path, timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def wait_ready(self, timeout: float = 120.0, models: Sequence[str] = (),
                   cancel: threading.Event | None = None) -> float:
        """Block until ready (every model in `models` too); returns the seconds waited.

        Raises TritonServerError when the server exits, the timeout passes or `cancel` is set.
        """
        if self.proc is None:
            raise TritonServerError("wait_ready() before start()")
        t0 = time.monotonic()
        while True:
            if cancel is not None and cancel.is_set():
                raise TritonServerError("interrupted while waiting for tritonserver to become ready")
            code = self.proc.poll()
            if code is not None:
                raise self._fail(f"tritonserver exited with code {code} before it was ready")
            if self.is_ready() and all(self.is_ready(m) for m in models):
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                self.stop()
                raise self._fail(f"tritonserver not ready after {timeout:.0f} s (stopped it)")
            time.sleep(0.1)

    def stop(self, grace_s: float = 15.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after `grace_s`; idempotent. Returns the exit code."""
        if self.proc is None:
            return None
        regions = shm_regions(self.proc.pid)
        code = stop_process_group(self.proc, grace_s)
        remove_shm_regions(regions)
        self._sweep_weights()  # a stub killed before finalize left its weight store held by no one
        if self._relay is not None:
            self._relay.join(5)  # the pipe ends with the last process holding it
            self._relay = None
            if self.proc.stdout is not None:
                self.proc.stdout.close()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return code

    def _sweep_weights(self) -> None:
        removed = store_root(self.env).sweep()
        if removed:
            print(f"serve: removed weight stores no live process holds: {', '.join(removed)}", flush=True)

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
