"""NIXL/UCX plumbing shared by the nixl-ucx transport and its benchmark.

Why a module of its own: NIXL (and the UCX inside it) reads its settings from the environment once, when
the first agent is created, and creating an agent costs time, so every process keeps exactly one agent
(`process_agent`). This module owns those defaults, the pre-faulted host arena both sides register once,
and `bare_read_gbps`, the two-agent NIXL READ that bench/kv_bench.py uses as the limit for nixl-ucx.

`python -m rngd_pd.kv.nixl.agent` prints what NIXL/UCX would use on this host. nixl is imported only inside
functions here, with an install hint, so `import rngd_pd` works without it.
"""

from __future__ import annotations

import bisect
import json
import mmap
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import numpy as np

from rngd_pd.config.env import (
    AIRM_KV_UCX_POOL_MB,
    AIRM_KV_UCX_PROGRESS_US,
    UCX_,
    UCX_MODULES,
    UCX_NET_DEVICES,
    UCX_TCP_RX_SEG_SIZE,
    UCX_TCP_TX_SEG_SIZE,
    UCX_TLS,
)
from rngd_pd.errors import TransportError

INSTALL_HINT = "install the NIXL wheels with the UCX plugin: pip install 'nixl>=1.5' 'nixl-cu12>=1.5'"

# Defaults that work on these hosts, applied only where the environment does not already say otherwise.
# TCP with 512 KiB segments moves a READ at ~2 GB/s instead of ~0.6 GB/s with UCX's 64 KiB default;
# UCX_MODULES=^ib keeps the bundled libibverbs (and its libnl exit-time crash) out of the process.
UCX_DEFAULTS: dict[str, str] = {v.name: v.default for v in (UCX_TLS, UCX_TCP_TX_SEG_SIZE, UCX_TCP_RX_SEG_SIZE,
                                                             UCX_MODULES)}

# UCX transports that only work with NIXL's ucx_error_handling_mode=none (peer mode fails on them).
_SHARED_MEMORY_TLS = ("sm", "shm", "posix", "sysv", "cma", "xpmem", "knem")

_agent_lock = threading.Lock()
_agent: Any = None
_patch_lock = threading.Lock()

# The progress thread of NIXL's UCX backend waits for UCX events with poll(timeout = this, rounded up
# to ms). nixl_agent() hard-codes 0, and then that thread spins on a whole core in every process;
# on a 2-core host that halved the transfer rate. UCX events wake it at once either way.
def progress_delay_us() -> int:
    """The progress thread's poll timeout in microseconds ($AIRM_KV_UCX_PROGRESS_US, 0 = spin)."""
    raw = AIRM_KV_UCX_PROGRESS_US.raw() or str(AIRM_KV_UCX_PROGRESS_US.default)
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise TransportError(f"{AIRM_KV_UCX_PROGRESS_US.name} must be an int >= 0 (microseconds), "
                             f"got {raw!r}")
    return value


def _new_agent(api: Any, name: str, conf: Any, delay_us: int) -> Any:
    """nixl_agent(name, conf) with the progress thread's poll timeout set to `delay_us`.

    nixl_agent() gives its native config no way in, so the native constructor is wrapped for the
    duration of the call (under a lock); a NIXL without that seam gets its own default.
    """
    bind = getattr(api, "nixlBind", None)
    native = getattr(bind, "nixlAgent", None)
    if not delay_us or native is None:
        return api.nixl_agent(name, conf)

    def with_delay(agent_name: str, config: Any) -> Any:
        config.pthrDelay = delay_us
        return native(agent_name, config)

    with _patch_lock:
        bind.nixlAgent = with_delay
        try:
            return api.nixl_agent(name, conf)
        finally:
            bind.nixlAgent = native


def apply_ucx_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Put `env` then UCX_DEFAULTS into os.environ (defaults only where unset); return the UCX_* in force.

    Must run before the process's first NIXL agent exists: UCX reads its environment once.
    """
    if env:
        os.environ.update({k: str(v) for k, v in env.items()})
    preset = UCX_.members()
    uses_tcp = any(t.strip() in ("tcp", "all") for t in preset.get(UCX_TLS.name, UCX_TLS.default).split(","))
    # UCX warns about settings of a transport it does not use
    os.environ.update({name: value for name, value in UCX_DEFAULTS.items()
                       if name not in preset and (uses_tcp or "_TCP_" not in name)})
    return UCX_.members()


def backend_params(ucx_env: Mapping[str, str]) -> dict[str, str]:
    """NIXL UCX backend parameters for these UCX settings (shared memory needs error handling off)."""
    tls = [t.strip().lstrip("^") for t in ucx_env.get(UCX_TLS.name, "").split(",") if t.strip()]
    if any(t == s or t.startswith(s + "/") for t in tls for s in _SHARED_MEMORY_TLS):
        return {"ucx_error_handling_mode": "none"}
    return {}


def import_nixl() -> Any:
    """Import nixl's Python API or raise TransportError with an install hint."""
    try:
        from nixl import _api
    except Exception as exc:  # ImportError, or a broken native library underneath
        raise TransportError(f"NIXL is not importable ({exc!r}); {INSTALL_HINT}") from exc
    return _api


def create_agent(name: str | None = None, env: Mapping[str, str] | None = None) -> Any:
    """Create a NIXL agent with the UCX backend configured for this host's UCX settings.

    Thread-safe (STRICT sync): the transport's notification thread shares the agent with callers.
    """
    ucx_env = apply_ucx_env(env)
    api = import_nixl()
    conf = api.nixl_agent_config(
        backends=[], sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    )
    name = name or f"rngd-kv-{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    agent = _new_agent(api, name, conf, progress_delay_us())
    if "UCX" not in agent.get_plugin_list():
        plugins = agent.get_plugin_list()
        raise TransportError(f"NIXL has no UCX plugin here (plugins: {plugins}); {INSTALL_HINT}")
    try:
        agent.create_backend("UCX", backend_params(ucx_env))
    except Exception as exc:
        raise TransportError(f"NIXL could not start its UCX backend with {ucx_env}: {exc}") from exc
    return agent


def process_agent() -> Any:
    """The one NIXL agent of this process, created on first use (agent creation is slow)."""
    global _agent
    with _agent_lock:
        if _agent is None:
            _agent = create_agent()
        return _agent


def alloc_arena(nbytes: int) -> np.ndarray:
    """A page-aligned, pre-faulted uint8 host buffer (fresh pages cost more than the copies into them)."""
    if nbytes <= 0:
        raise ValueError(f"arena size must be positive, got {nbytes}")
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    buf = mmap.mmap(-1, nbytes, flags=flags)
    arr = np.frombuffer(buf, dtype=np.uint8)
    if not getattr(mmap, "MAP_POPULATE", 0):
        arr[:: mmap.PAGESIZE] = 0
    return arr


def register_arena(agent: Any, arena: np.ndarray) -> Any:
    """Register the whole arena with NIXL once; returns the registration list (for deregistering)."""
    addr = arena.ctypes.data
    try:
        return agent.register_memory([(addr, arena.nbytes, 0, "")], "DRAM")
    except Exception as exc:
        raise TransportError(f"NIXL could not register a {arena.nbytes} byte host arena: {exc}") from exc


def wait_xfer(agent: Any, handle: Any, deadline: float) -> str:
    """Poll one transfer until it ends: "DONE", "ERR", or "TIMEOUT" if still running at `deadline`.

    Spins (yielding the GIL) for the first ~100 us, then sleeps in short steps, so a waiting reader does
    not take a whole core from the other processes on a small host.
    """
    spins = 0
    while True:
        try:
            state = agent.check_xfer_state(handle)
        except Exception:  # NIXL raises for a disconnected peer instead of returning ERR
            return "ERR"
        if state != "PROC":
            return state
        if time.monotonic() > deadline:
            return "TIMEOUT"
        spins += 1
        time.sleep(0 if spins < 200 else 20e-6)


class SlotAllocator:
    """First-fit allocator of aligned byte ranges inside one arena; freed neighbours merge.

    Not thread-safe: the transport calls it under its own lock. Offsets are multiples of `align`.
    """

    def __init__(self, size: int, align: int = 4096) -> None:
        self.size, self.align = size, align
        self._free: list[tuple[int, int]] = [(0, size)]  # (offset, length), sorted, never adjacent
        self.used = 0

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a free range of at least `nbytes` (rounded up to `align`), or None when full."""
        need = max(self.align, -(-nbytes // self.align) * self.align)
        for i, (off, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    del self._free[i]
                else:
                    self._free[i] = (off + need, length - need)
                self.used += need
                return off
        return None

    def free(self, offset: int, nbytes: int) -> None:
        """Give back a range returned by alloc(nbytes)."""
        need = max(self.align, -(-nbytes // self.align) * self.align)
        self.used -= need
        i = bisect.bisect_left(self._free, (offset, 0))
        start, end = offset, offset + need
        if i < len(self._free) and self._free[i][0] == end:  # merge with the next free range
            end += self._free.pop(i)[1]
        if i > 0 and sum(self._free[i - 1]) == start:  # and with the previous one
            start = self._free[i - 1][0]
            i -= 1
            self._free.pop(i)
        self._free.insert(i, (start, end - start))


# --- bare two-agent READ: the limit the transport is measured against ---------------------------------


def _pattern(nbytes: int) -> np.ndarray:
    return np.resize(np.arange(251, dtype=np.uint8), nbytes)  # 251: a prime, so blobs differ


def _bare_target(conn: Any, nbytes: int, env: Mapping[str, str] | None) -> None:
    """Child: own an arena filled with a pattern, publish it, stay up until the reader is done."""
    agent = create_agent("bare-target", env)
    arena = alloc_arena(nbytes)
    arena[:] = _pattern(nbytes)
    register_arena(agent, arena)
    conn.send((agent.get_agent_metadata(), arena.ctypes.data))
    conn.recv()  # the reader's "done"
    conn.close()
    os._exit(0)  # skip interpreter teardown of native NIXL state


def _bare_wait(agent: Any, handle: Any) -> None:
    state = wait_xfer(agent, handle, time.monotonic() + 60)
    if state != "DONE":
        raise TransportError(f"bare NIXL READ ended in state {state}")
    handle.release()


def _bare_reader(conn: Any, nbytes: int, blob_size: int, in_flight: int, repeats: int,
                 env: Mapping[str, str] | None) -> None:
    """Child: READ the target's arena blob by blob, `in_flight` streams at once; send back the times."""
    agent = create_agent("bare-reader", env)
    arena = alloc_arena(nbytes)
    register_arena(agent, arena)
    meta, remote_base = conn.recv()
    peer = agent.add_remote_agent(meta)
    local_base = arena.ctypes.data
    offsets = list(range(0, nbytes, blob_size))
    times = []
    for _ in range(repeats + 1):  # the first round also sets up the connection; not timed
        t0 = time.perf_counter()
        pending = []
        for off in offsets:
            size = min(blob_size, nbytes - off)
            local = agent.get_xfer_descs([(local_base + off, size, 0)], "DRAM")
            remote = agent.get_xfer_descs([(remote_base + off, size, 0)], "DRAM")
            handle = agent.initialize_xfer("READ", local, remote, peer)
            if agent.transfer(handle) == "ERR":
                raise TransportError("bare NIXL READ failed to post")
            pending.append(handle)
            if len(pending) >= in_flight:
                _bare_wait(agent, pending.pop(0))
        for handle in pending:
            _bare_wait(agent, handle)
        times.append(time.perf_counter() - t0)
    conn.send((times[1:], bool(np.array_equal(arena, _pattern(nbytes)))))
    conn.close()
    os._exit(0)


def bare_read_gbps(nbytes: int, blob_size: int, in_flight: int = 1, env: Mapping[str, str] | None = None,
                   repeats: int = 3, timeout: float = 120.0) -> float:
    """GB/s of a bare NIXL READ of `nbytes` between two fresh processes, in `blob_size` READs.

    `in_flight` READs are outstanding at once (1 = one blob after another). `env` (UCX_* settings) is
    applied in both children before their agents exist, so pass what the transport runs with. Returns the
    median of `repeats` timed rounds (as kv_bench reports the transports); raises TransportError if the
    bytes that arrived are wrong.
    """
    if nbytes <= 0 or blob_size <= 0 or in_flight <= 0:
        raise ValueError("nbytes, blob_size and in_flight must be positive")
    ctx = mp.get_context("spawn")
    t_parent, t_child = ctx.Pipe()
    r_parent, r_child = ctx.Pipe()
    target = ctx.Process(target=_bare_target, args=(t_child, nbytes, env), daemon=True)
    reader = ctx.Process(target=_bare_reader, args=(r_child, nbytes, blob_size, in_flight, repeats, env),
                         daemon=True)
    target.start()
    reader.start()
    try:
        if not t_parent.poll(timeout):
            raise TransportError("bare READ target did not start (NIXL agent creation hung?)")
        r_parent.send(t_parent.recv())
        if not r_parent.poll(timeout):
            raise TransportError("bare READ reader did not finish in time")
        times, exact = r_parent.recv()
        t_parent.send("done")
    finally:
        for proc in (reader, target):
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if not exact:
        raise TransportError("bare NIXL READ delivered wrong bytes")
    return nbytes / statistics.median(times) / 1e9


# --- python -m rngd_pd.kv.nixl.agent -----------------------------------------------------------------------


def describe() -> dict[str, Any]:
    """What NIXL/UCX would use on this host: versions, plugins, UCX settings, backend parameters."""
    info: dict[str, Any] = {}
    for pkg in ("nixl", "nixl-cu12", "nixl-cu13"):
        try:
            info[f"{pkg} version"] = version(pkg)
        except PackageNotFoundError:
            info[f"{pkg} version"] = None
    preset = {k: v for k, v in UCX_.members().items() if k in UCX_DEFAULTS}
    ucx_env = apply_ucx_env()
    info["UCX settings (preset by you)"] = preset
    info["UCX settings in force"] = ucx_env
    info["UCX transports"] = ucx_env.get(UCX_TLS.name, "all (UCX default)")
    info["UCX devices"] = ucx_env.get(UCX_NET_DEVICES.name, "all (UCX default)")
    info["UCX backend params (beyond the plugin defaults)"] = backend_params(ucx_env)
    try:
        agent = create_agent()
    except TransportError as exc:
        info["error"] = str(exc)
        return info
    info["agent"] = agent.name
    info["plugins available"] = agent.get_plugin_list()
    info["UCX plugin params"] = agent.get_plugin_params("UCX")
    info["UCX memory types"] = agent.get_backend_mem_types("UCX")
    info[f"progress thread poll timeout us ({AIRM_KV_UCX_PROGRESS_US.name})"] = progress_delay_us()
    info[f"arena MiB ({AIRM_KV_UCX_POOL_MB.name})"] = AIRM_KV_UCX_POOL_MB.get()
    info["infiniband devices"] = sorted(os.listdir("/sys/class/infiniband")) \
        if os.path.isdir("/sys/class/infiniband") else []
    return info


def main(argv: list[str] | None = None) -> int:
    """Print describe() as `name: value` lines (or JSON with --json)."""
    argv = sys.argv[1:] if argv is None else argv
    info = describe()
    if "--json" in argv:
        print(json.dumps(info))
    else:
        for name, value in info.items():
            print(f"{name}: {value}")
    sys.stdout.flush()
    return 1 if "error" in info else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # NIXL's native teardown at interpreter exit is not needed and can crash
