"""nixl-ucx transport: real NIXL agents in spawned child processes, a real relay started here.

The pytest process itself never creates a NIXL agent (agents are per process and their native teardown
is best kept out of the test runner); each `Peer` is a child that owns one and runs commands sent to it.
Skipped only when nixl's UCX plugin cannot be used on this host.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest

from rngd_pd.kv.nixl.agent import SlotAllocator, apply_ucx_env, backend_params
from rngd_pd.kv.relay.tcp import RelayClient

MiB = 1 << 20
CALL_TIMEOUT = 120.0


def payload(seed: int, size: int) -> bytes:
    return np.random.default_rng(seed).bytes(size)


# ------------------------------------------------------------------ the child side (one NIXL agent)
class _Ops:
    """What a peer can be asked to do; runs inside the child."""

    def __init__(self) -> None:
        self.transports: dict[str, Any] = {}
        self.records: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda rec: self.records.append(rec.getMessage())  # type: ignore[method-assign]
        logging.getLogger("rngd_pd.kv.nixl.ucx").addHandler(handler)
        logging.getLogger("rngd_pd.kv.nixl.ucx").setLevel(logging.INFO)

    def open(self, name: str, **options: Any) -> None:
        from rngd_pd.kv.nixl.ucx import NixlUcxTransport

        self.transports[name] = NixlUcxTransport(**options)

    def push(self, t: str, key: str, index: int, seed: int, size: int) -> None:
        self.transports[t].push(key, index, payload(seed, size))

    def pull(self, t: str, key: str, index: int, seed: int, size: int, timeout: float) -> dict:
        out = np.zeros(size + 8, np.uint8)
        t0 = time.monotonic()
        n = self.transports[t].pull(key, index, out, timeout)
        took = time.monotonic() - t0
        exact = out[:n].tobytes() == payload(seed, size) and not out[n:].any()
        return {"n": n, "exact": exact, "s": took}

    def flush(self, t: str) -> None:
        self.transports[t].flush()

    def held(self, t: str, key: str | None = None) -> tuple[int, int]:
        return self.transports[t].held(key)

    def release(self, t: str, key: str) -> None:
        self.transports[t].release(key)

    def corrupt(self, t: str, key: str) -> None:
        ep = self.transports[t].ep
        with ep.lock:
            slot = [s for s in ep.slots.values() if s.key == key][-1]
            ep.arena[slot.offset + slot.nbytes // 2] ^= 0xFF

    def parked_descriptor(self, t: str, key: str) -> int | None:
        """The blob index whose descriptor GET is already on its way from the relay, if any."""
        parked = self.transports[t].relay._ahead.get(key)
        return parked[1] if parked else None

    def idle_cpu(self, seconds: float) -> float:
        """CPU seconds this process burns while its Python threads sleep (NIXL's threads alone)."""
        t0 = time.process_time()
        time.sleep(seconds)
        return time.process_time() - t0

    def arena_used(self, t: str) -> int:
        return self.transports[t].ep.allocator.used

    def logs(self) -> list[str]:
        return list(self.records)


def _peer_main(conn: Any, env: dict[str, str]) -> None:
    os.environ.update(env)
    ops = _Ops()
    while True:
        cmd, args, kwargs = conn.recv()
        if cmd == "exit":
            conn.close()
            os._exit(args[0])  # like a crashed prefill process: nothing cleaned up
        try:
            conn.send(("ok", getattr(ops, cmd)(*args, **kwargs)))
        except Exception as exc:
            conn.send(("err", type(exc).__name__, str(exc)))


class PeerError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class Peer:
    """A spawned child process with its own NIXL agent, driven over a pipe."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_peer_main, args=(child, env or {}), daemon=True)
        self.proc.start()

    def __call__(self, cmd: str, *args: Any, timeout: float = CALL_TIMEOUT, **kwargs: Any) -> Any:
        self.conn.send((cmd, args, kwargs))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer did not answer {cmd} within {timeout} s")
        status, *rest = self.conn.recv()
        if status == "err":
            raise PeerError(*rest)
        return rest[0]

    def crash(self) -> None:
        self.conn.send(("exit", (3,), {}))
        self.proc.join(30)

    def close(self) -> None:
        if self.proc.is_alive():
            self.crash()
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def _wait_until(fn, timeout: float = 10.0, step: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(step)


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def ucx_info() -> dict:
    """`python -m rngd_pd.kv.nixl.agent --json` (a child process); skip the NIXL tests if UCX is unusable."""
    proc = subprocess.run([sys.executable, "-m", "rngd_pd.kv.nixl.agent", "--json"], capture_output=True,
                          text=True, timeout=120)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    info = json.loads(lines[-1]) if lines else {"error": proc.stderr[-2000:]}
    if "error" in info or "UCX" not in info.get("plugins available", []):
        pytest.skip(f"nixl's UCX plugin is not usable here: {info.get('error')}")
    return info


@pytest.fixture(scope="module")
def relay():
    from rngd_pd.kv.relay.proc import start_relay

    with start_relay() as r:
        yield r


@pytest.fixture(scope="module")
def peers(ucx_info, relay):
    """Two long-lived children (prefill-like A, decode-like B), each with a 64 MiB arena."""
    a, b = Peer(), Peer()
    try:
        for p in (a, b):
            p("open", "main", addr=relay.addr, pool_mb=64)
        yield a, b
    finally:
        a.close()
        b.close()


# ------------------------------------------------------------------------------ unit (no NIXL)
def test_slot_allocator_aligns_merges_and_fills():
    al = SlotAllocator(16 * 4096)
    a, b, c = al.alloc(1), al.alloc(4097), al.alloc(4096)
    assert (a, b, c) == (0, 4096, 3 * 4096) and al.used == 4 * 4096
    assert al.alloc(13 * 4096) is None  # only 12 pages left
    al.free(b, 4097)
    al.free(a, 1)
    assert al.alloc(3 * 4096) == 0  # the two freed neighbours merged
    al.free(0, 3 * 4096)
    al.free(c, 4096)
    assert al.used == 0 and al.alloc(16 * 4096) == 0


def test_shared_memory_tls_turn_error_handling_off():
    assert backend_params({"UCX_TLS": "sm,self"}) == {"ucx_error_handling_mode": "none"}
    assert backend_params({"UCX_TLS": "posix,cma,self"}) == {"ucx_error_handling_mode": "none"}
    assert backend_params({"UCX_TLS": "tcp"}) == {}
    assert backend_params({}) == {}


def test_ucx_defaults_never_override_the_user(monkeypatch):
    for name in ("UCX_TLS", "UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE", "UCX_MODULES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("UCX_TLS", "rc,ud,sm,self")
    env = apply_ucx_env()
    assert env["UCX_TLS"] == "rc,ud,sm,self" and env["UCX_MODULES"] == "^ib"
    assert "UCX_TCP_TX_SEG_SIZE" not in env  # no TCP in use: UCX would warn about the setting
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_TCP_RX_SEG_SIZE", "1m")
    env = apply_ucx_env()
    assert env["UCX_TCP_TX_SEG_SIZE"] == "512k" and env["UCX_TCP_RX_SEG_SIZE"] == "1m"


def test_publisher_keeps_push_order_and_reports_a_failed_put():
    from rngd_pd.errors import TransportError
    from rngd_pd.kv.nixl.publish import Publisher
    from rngd_pd.kv.relay.proc import start_relay

    freed: list[str] = []
    with start_relay() as relay:
        client = RelayClient(relay.addr)
        pub = Publisher(client, freed.append)
        for i in range(50):
            pub.submit("pub", i, f"d{i}".encode(), f"t{i}")
        pub.flush(10)
        assert [client.get("pub", i, 1.0) for i in (0, 49)] == [b"d0", b"d49"]
        relay.stop()
        pub.submit("pub", 50, b"late", "t50")
        with pytest.raises(TransportError, match="blob 50"):
            pub.flush(10)
        assert freed == ["t50"]  # the slot of a blob nobody can find is given back
        pub.close(5)
        client.close()


def test_bad_settings_fail_before_any_nixl_agent_exists(monkeypatch):
    from rngd_pd.errors import TransportError
    from rngd_pd.kv.nixl.ucx import NixlUcxTransport

    monkeypatch.delenv("AIRM_KV_TCP_ADDR", raising=False)
    with pytest.raises(TransportError, match="AIRM_KV_TCP_ADDR"):
        NixlUcxTransport()
    with pytest.raises(TransportError, match="AIRM_KV_UCX_POOL_MB"):
        NixlUcxTransport("127.0.0.1:1", pool_mb=0)
    monkeypatch.setenv("AIRM_KV_UCX_READ_AHEAD", "lots")
    with pytest.raises(TransportError, match=r"AIRM_KV_UCX_READ_AHEAD.*'lots'"):
        NixlUcxTransport("127.0.0.1:1")
    monkeypatch.delenv("AIRM_KV_UCX_READ_AHEAD")
    monkeypatch.setenv("AIRM_KV_UCX_PROGRESS_US", "soon")
    with pytest.raises(TransportError, match=r"AIRM_KV_UCX_PROGRESS_US.*'soon'"):
        NixlUcxTransport("127.0.0.1:1")
    from rngd_pd.kv.nixl import endpoint as ucx_endpoint

    assert ucx_endpoint.current() is None  # nothing above got as far as creating an agent


# ------------------------------------------------------------------------------ real NIXL
@pytest.mark.nixl
def test_describe_cli_names_plugin_and_settings(ucx_info):
    assert ucx_info["nixl version"] and "UCX" in ucx_info["plugins available"]
    assert ucx_info["UCX settings in force"]["UCX_MODULES"]
    assert ucx_info["UCX transports"] == ucx_info["UCX settings in force"]["UCX_TLS"]
    assert "UCX backend params (beyond the plugin defaults)" in ucx_info


@pytest.mark.nixl
def test_roundtrip_is_byte_exact_and_reads_free_the_pushers_slots(peers):
    a, b = peers
    sizes = [1, 4096 + 3, MiB, 5 * MiB + 7]
    for i, size in enumerate(sizes):
        a("push", "main", "rt", i, 10 + i, size)
    assert a("held", "main", "rt") == (len(sizes), sum(sizes))
    for i, size in enumerate(sizes):
        got = b("pull", "main", "rt", i, 10 + i, size, 30.0)
        assert got["n"] == size and got["exact"], (size, got)
    # each READ's notification freed its slot in the pushing process
    assert _wait_until(lambda: a("held", "main", "rt") == (0, 0)), a("held", "main", "rt")
    b("release", "main", "rt")
    with pytest.raises(PeerError, match="TransportTimeoutError"):
        b("pull", "main", "rt", 0, 10, 1, 0.2)


@pytest.mark.nixl
def test_read_ahead_posts_the_next_reads_and_release_frees_them(peers):
    a, b = peers
    for i in range(4):
        a("push", "main", "ra", i, 20 + i, MiB)
    a("flush", "main")  # descriptors are published in the background: read-ahead only sees published ones
    assert b("arena_used", "main") == 0
    got = b("pull", "main", "ra", 0, 20, MiB, 30.0)
    assert got["exact"]
    assert _wait_until(lambda: b("arena_used", "main") == 2 * MiB)  # blobs 1 and 2 are read ahead
    assert b("pull", "main", "ra", 1, 21, MiB, 30.0)["exact"]  # served from the read-ahead
    assert _wait_until(lambda: b("arena_used", "main") == 2 * MiB)  # now blobs 2 and 3
    assert b("parked_descriptor", "main", "ra") == 4  # the next descriptor is already being asked for
    b("release", "main", "ra")  # nobody will pull 2 and 3: release drops their read-aheads
    assert b("arena_used", "main") == 0
    assert b("parked_descriptor", "main", "ra") is None  # and the parked descriptor GET
    # NIXL sends a READ's notification once the reader sees it complete: all four slots freed
    assert _wait_until(lambda: a("held", "main", "ra") == (0, 0)), a("held", "main", "ra")


@pytest.mark.nixl
def test_pull_waits_for_a_later_push(peers):
    a, b = peers
    b.conn.send(("pull", ("main", "late", 0, 7, 300_000, 30.0), {}))
    time.sleep(1.0)
    a("push", "main", "late", 0, 7, 300_000)
    assert b.conn.poll(30)
    status, got = b.conn.recv()
    assert status == "ok" and got["exact"] and got["s"] > 0.5, got
    b("release", "main", "late")


@pytest.mark.nixl
def test_checksum_mismatch_is_an_integrity_error(peers):
    a, b = peers
    a("push", "main", "bad", 0, 3, MiB)
    a("corrupt", "main", "bad")
    with pytest.raises(PeerError, match="TransportIntegrityError") as err:
        b("pull", "main", "bad", 0, 3, MiB, 10.0)
    assert "checksum" in str(err.value)
    b("release", "main", "bad")


@pytest.mark.nixl
def test_missing_blob_times_out_on_time(peers):
    _, b = peers
    t0 = time.monotonic()
    with pytest.raises(PeerError, match="TransportTimeoutError"):
        b("pull", "main", "never", 0, 0, 64, 0.5)
    assert time.monotonic() - t0 < 3.0


@pytest.mark.nixl
def test_output_buffer_too_small_is_refused(peers):
    a, b = peers
    a("push", "main", "big", 0, 1, 4096)
    with pytest.raises(PeerError, match="TransportIntegrityError"):
        b("pull", "main", "big", 0, 1, 100, 5.0)  # payload(1, 100) buffer of 108 bytes < 4096
    b("release", "main", "big")
    a("release", "main", "big")
    assert a("held", "main", "big") == (0, 0)


@pytest.mark.nixl
def test_full_arena_is_a_capacity_error_and_release_frees_it(peers, relay):
    a, _ = peers
    a("open", "cap", addr=relay.addr, capacity_wait_s=0.2)  # same 64 MiB arena, short backpressure wait
    a("push", "cap", "cap", 0, 1, 30 * MiB)
    a("push", "cap", "cap", 1, 2, 30 * MiB)
    t0 = time.monotonic()
    with pytest.raises(PeerError, match="TransportCapacityError") as err:
        a("push", "cap", "cap", 2, 3, 30 * MiB)
    assert "AIRM_KV_UCX_POOL_MB" in str(err.value) and time.monotonic() - t0 < 5.0
    a("release", "cap", "cap")
    assert a("held", "cap", "cap") == (0, 0)
    a("push", "cap", "cap", 2, 3, 30 * MiB)  # room again
    a("release", "cap", "cap")


@pytest.mark.nixl
def test_unread_slots_expire(peers):
    from rngd_pd.kv.relay.proc import start_relay

    a, b = peers
    with start_relay("127.0.0.1", 0, "--ttl-s", "0.5") as short:
        a("open", "ttl", addr=short.addr, ttl_s=0.5)
        b("open", "ttl", addr=short.addr, ttl_s=0.5)
        a("push", "ttl", "exp", 0, 1, MiB)
        assert a("held", "ttl", "exp") == (1, MiB)
        assert _wait_until(lambda: a("held", "ttl", "exp") == (0, 0), timeout=5.0)
        with RelayClient(short.addr) as probe:  # the relay drops the descriptor on the same TTL
            assert _wait_until(lambda: probe.stat("exp")["key_blobs"] == 0, timeout=5.0)
        with pytest.raises(PeerError, match="TransportTimeoutError"):  # the relay dropped the descriptor
            b("pull", "ttl", "exp", 0, 1, MiB, 1.0)


@pytest.mark.nixl
def test_blob_log_names_size_and_sha256(peers, relay):
    import hashlib

    a, _ = peers
    a("open", "logged", addr=relay.addr, log_blobs=True)
    a("push", "logged", "lg", 0, 5, 1000)
    sha = hashlib.sha256(payload(5, 1000)).hexdigest()
    assert any(f"lg[0] 1000 bytes sha256={sha}" in line for line in a("logs")), a("logs")
    a("release", "logged", "lg")


@pytest.mark.nixl
def test_dead_pusher_is_a_transport_error_not_a_hang(peers, relay):
    _, b = peers
    dier = Peer()
    try:
        dier("open", "main", addr=relay.addr, pool_mb=16)
        dier("push", "main", "dead", 0, 9, MiB)
        dier("flush", "main")  # the descriptor is in the relay, the bytes only in the dead arena
        dier.crash()
        t0 = time.monotonic()
        with pytest.raises(PeerError, match="TransportError"):
            b("pull", "main", "dead", 0, 9, MiB, 2.0)
        assert time.monotonic() - t0 < 10.0
    finally:
        dier.close()
        b("release", "main", "dead")


@pytest.mark.nixl
@pytest.mark.slow
def test_conformance_suite_passes_for_nixl_ucx(ucx_info, monkeypatch):
    monkeypatch.delenv("AIRM_KV_TCP_ADDR", raising=False)
    proc = subprocess.run([sys.executable, "-m", "rngd_pd.kv.conformance", "nixl-ucx"], capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.count("PASS") == 15 and "FAIL" not in proc.stdout, proc.stdout


@pytest.mark.nixl
def test_progress_thread_sleeps_between_events(peers, relay):
    """NIXL's Python agent makes its UCX progress thread spin on a whole core; ours waits for events
    (AIRM_KV_UCX_PROGRESS_US, default 1000), and 0 restores the spinning."""
    a, _ = peers
    assert a("idle_cpu", 1.0) < 0.3
    spinning = Peer({"AIRM_KV_UCX_PROGRESS_US": "0"})
    try:
        spinning("open", "main", addr=relay.addr, pool_mb=8)
        assert spinning("idle_cpu", 1.0) > 0.5
    finally:
        spinning.close()

