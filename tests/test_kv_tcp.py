"""tcp transport and KV relay specifics: auth, limits, checksums, logging, failures without hangs."""

from __future__ import annotations

import hashlib
import logging
import socket
import threading
import time

import numpy as np
import pytest

from rngd_pd.errors import (
    TransportCapacityError,
    TransportError,
    TransportIntegrityError,
    TransportTimeoutError,
)
from rngd_pd.kv.options import RelayOptions, crc_algorithm, options
from rngd_pd.kv.relay import frames as wire
from rngd_pd.kv.relay.proc import start_relay
from rngd_pd.kv.relay.server import config_from_env
from rngd_pd.kv.relay.tcp import RelayClient, TcpTransport, parse_addr


@pytest.fixture(scope="module")
def relay():
    with start_relay() as r:
        yield r.addr


def test_roundtrip_many_threads_one_pool(relay):
    data = np.random.default_rng(0).integers(0, 256, (16, 300_000), np.uint8)
    with TcpTransport(relay) as push, TcpTransport(relay) as pull:
        assert push.client._pool is pull.client._pool  # one pool per process and address
        errors = []

        def work(i: int) -> None:
            try:
                out = np.empty(300_000, np.uint8)
                push.push("mt", i, data[i])
                assert pull.pull("mt", i, out, 5.0) == 300_000 and np.array_equal(out, data[i])
            except Exception as e:
                errors.append(e)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert not errors
        assert push.client.stat("mt")["key_blobs"] == 16
        assert push.client.delete("mt") == 16 and push.client.stat()["used_bytes"] == 0


def test_small_descriptor_api(relay):
    with RelayClient(relay) as c:
        c.put("desc", 0, b'{"addr": 1}')
        assert c.get("desc", 0, 1.0) == b'{"addr": 1}'
        c.delete("desc")


def test_secret_is_required_and_checked():
    with start_relay("127.0.0.1", 0, "--secret", "s3cret") as r:
        with RelayClient(r.addr, "s3cret") as ok:
            ok.put("k", 0, b"x")
            assert ok.get("k", 0, 1.0) == b"x"
        with pytest.raises(TransportError, match="refused our secret"), RelayClient(r.addr, "wrong") as bad:
            bad.put("k", 1, b"x")
        with pytest.raises(TransportError, match="requires a shared secret"), RelayClient(r.addr) as none:
            none.stat()


def test_hmac_answer_depends_on_nonce_and_hides_the_secret():
    secret = b"correct horse battery staple"
    a, b = wire.auth_digest(secret, b"n1"), wire.auth_digest(secret, b"n2")
    assert a != b and secret not in a and len(a) == 32


def test_memory_cap_is_a_clear_capacity_error():
    with start_relay("127.0.0.1", 0, "--max-mb", "1") as r, RelayClient(r.addr) as c:
        c.put("a", 0, bytes(600_000))
        with pytest.raises(TransportCapacityError, match="memory cap"):
            c.put("a", 1, bytes(600_000))
        c.put("a", 2, b"small")  # the connection is still in sync
        c.delete("a")
        c.put("a", 1, bytes(600_000))  # room again after release


def test_pipelined_push_is_stored_once_flush_returns(relay):
    with TcpTransport(relay) as t:
        for i in range(20):  # more than PUSH_WINDOW answers: some are read while pushing
            t.push("pipe", i, bytes([i]) * 100_000)
        t.flush("pipe")
        assert t.client.stat("pipe")["key_blobs"] == 20 and "pipe" not in t.client._pushing
        t.flush("pipe")  # nothing due: a no-op
        t.release("pipe")


def test_pipelined_push_error_comes_by_a_later_push_or_flush():
    with start_relay("127.0.0.1", 0, "--max-mb", "1") as r, TcpTransport(r.addr) as t:
        t.push("a", 0, bytes(600_000))
        with pytest.raises(TransportCapacityError, match="memory cap"):
            # over the cap: the relay refuses it; its answer is read by this push when it is already
            # there (the relay answers as soon as it has discarded the body), else by the flush
            t.push("a", 1, bytes(600_000))
            t.flush("a")
        assert "a" not in t.client._pushing
        t.push("a", 2, b"small")  # a fresh connection: the client still works
        t.flush("a")
        assert t.client.stat("a")["key_blobs"] == 2
        t.release("a")  # flushes our own pushes first, so no PUT lands after the DELETE
        assert t.client.stat()["used_bytes"] == 0


def test_a_client_that_never_flushes_keeps_a_bounded_number_of_connections(relay):
    from rngd_pd.kv.relay.tcp import PUSH_KEYS

    with TcpTransport(relay) as t:
        for k in range(PUSH_KEYS + 10):
            t.push(f"nf{k}", 0, b"x" * 10)
        assert len(t.client._pushing) == PUSH_KEYS
        for k in range(10):  # the displaced (oldest) keys had their answers read: stored
            assert t.client.stat(f"nf{k}")["key_blobs"] == 1
        for k in range(PUSH_KEYS + 10):
            t.release(f"nf{k}")


def test_blob_and_key_limits():
    with start_relay("127.0.0.1", 0, "--max-blob-mb", "1") as r, RelayClient(r.addr) as c:
        with pytest.raises(TransportCapacityError, match="limit of 1048576"):
            c.put("big", 0, bytes((1 << 20) + 1))
        with pytest.raises(TransportError, match=r"key must be 1\.\.512"):
            c.put("k" * 600, 0, b"x")
        c.put("ok", 0, b"x")


def test_output_too_small(relay):
    with RelayClient(relay) as c:
        c.put("small", 0, bytes(100))
        with pytest.raises(TransportIntegrityError, match="output buffer only 10"):
            c.get_into("small", 0, bytearray(10), 1.0)
        c.delete("small")


def test_crc_settings(monkeypatch, relay):
    assert crc_algorithm("0") is None and crc_algorithm("crc32") == "crc32" and crc_algorithm("1") == "crc32c"
    monkeypatch.setenv("AIRM_KV_TCP_CRC", "0")
    with RelayClient(relay) as c:
        assert c.alg == 0
        c.put("nocrc", 0, b"abc")
        assert c.get("nocrc", 0, 1.0) == b"abc"
        c.delete("nocrc")


def test_log_size_and_sha256(monkeypatch, relay, caplog):
    monkeypatch.setenv("AIRM_KV_TCP_LOG", "1")
    caplog.set_level(logging.INFO, logger="rngd_pd.kv.relay.tcp")
    with RelayClient(relay) as c:
        c.put("logged", 0, b"hello")
        c.get("logged", 0, 1.0)
        c.delete("logged")
    digest = hashlib.sha256(b"hello").hexdigest()
    assert f"push logged[0] 5 bytes sha256={digest}" in caplog.text
    assert f"pull logged[0] 5 bytes sha256={digest}" in caplog.text


def test_address_errors(monkeypatch):
    monkeypatch.delenv("AIRM_KV_TCP_ADDR", raising=False)
    with pytest.raises(TransportError, match="AIRM_KV_TCP_ADDR"):
        parse_addr(None)
    with pytest.raises(TransportError, match="not host:port"):
        parse_addr("nohost")
    monkeypatch.setenv("AIRM_KV_TCP_ADDR", "[::1]:7700")
    assert parse_addr(options(RelayOptions, "tcp").addr) == ("::1", 7700)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    with RelayClient(f"127.0.0.1:{port}") as c, pytest.raises(TransportError, match="cannot reach the KV"):
        c.stat()


def test_relay_dying_mid_pull_is_an_error_not_a_hang():
    r = start_relay()
    with RelayClient(r.addr) as c:
        threading.Timer(0.5, r.stop).start()
        t0 = time.monotonic()
        with pytest.raises(TransportError) as e:
            c.get_into("never", 0, bytearray(10), 30.0)
        assert not isinstance(e.value, TransportTimeoutError) and time.monotonic() - t0 < 5


def test_garbage_client_is_dropped_and_relay_keeps_serving(relay):
    host, port = parse_addr(relay)
    with socket.create_connection((host, port)) as s:
        s.recv(64)  # hello
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(32))
        s.settimeout(5)
        try:
            assert s.recv(64) == b""  # closed by the relay
        except ConnectionResetError:
            pass  # closed with our junk unread: also closed
    with RelayClient(relay) as c:
        c.stat()


def _fake_relay_with_bad_crc(srv: socket.socket) -> None:
    """Answers one GET with a checksum that does not match the payload (the receiver must notice)."""
    conn, _ = srv.accept()
    with conn:
        conn.sendall(wire.Frame(wire.ST_OK, size=wire.NONCE_BYTES).pack() + bytes(wire.NONCE_BYTES))
        f = wire.unpack(conn.recv(32, socket.MSG_WAITALL))
        conn.recv(f.klen, socket.MSG_WAITALL)
        body = b"corrupted!"
        conn.sendall(wire.Frame(wire.ST_OK, wire.ALG_IDS["crc32c"], size=len(body), crc=12345).pack() + body)
        conn.recv(1)


def test_receiver_checks_the_checksum():
    srv = socket.create_server(("127.0.0.1", 0))
    th = threading.Thread(target=_fake_relay_with_bad_crc, args=(srv,), daemon=True)
    th.start()
    addr = f"127.0.0.1:{srv.getsockname()[1]}"
    with RelayClient(addr) as c, pytest.raises(TransportIntegrityError, match="as received from the relay"):
        c.get_into("k", 0, bytearray(64), 1.0)
    srv.close()


def test_relay_config_from_env(monkeypatch):
    monkeypatch.setenv("AIRM_KV_TCP_TTL_S", "7.5")
    monkeypatch.setenv("AIRM_KV_TCP_SECRET", "abc")
    cfg = config_from_env(max_bytes=10)
    assert (cfg.ttl_s, cfg.secret, cfg.max_bytes) == (7.5, b"abc", 10)


def test_relay_dies_with_the_process_that_started_it():
    import os
    import subprocess
    import sys

    code = ("from rngd_pd.kv.relay.proc import start_relay; r = start_relay(); "
            "print(r.proc.pid, flush=True); import os; os._exit(0)")
    pid = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True, timeout=60).stdout)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(pid, 9)
    pytest.fail(f"the relay (pid {pid}) outlived the process that started it by 10 s")
    raise AssertionError("the relay outlived its parent")


def test_read_ahead_in_order_and_out_of_order(relay):
    with TcpTransport(relay) as push, TcpTransport(relay) as t:
        for i in range(4):
            push.push("ra", i, bytes([i]) * 1000)
        out = bytearray(1000)
        assert t.pull("ra", 0, out, 5.0) == 1000 and out == b"\x00" * 1000
        assert t.client._ahead["ra"][1] == 1  # the GET for blob 1 is already on its way
        assert t.pull("ra", 1, out, 5.0) == 1000 and out == b"\x01" * 1000
        assert t.pull("ra", 3, out, 5.0) == 1000 and out == b"\x03" * 1000  # skips: parked link dropped
        t.release("ra")
        assert "ra" not in t.client._ahead and push.client.stat("ra")["key_blobs"] == 0


def test_read_ahead_honours_the_callers_timeout(relay):
    with TcpTransport(relay) as push, TcpTransport(relay) as t:
        push.push("rt", 0, b"a" * 64)
        t.pull("rt", 0, bytearray(64), 5.0)
        t0 = time.monotonic()
        with pytest.raises(TransportTimeoutError):
            t.pull("rt", 1, bytearray(64), 0.2)
        assert time.monotonic() - t0 < 1.0  # not the read-ahead's own 2 s
        push.push("rt", 1, b"b" * 64)
        out = bytearray(64)
        assert t.pull("rt", 1, out, 5.0) == 64 and out == b"b" * 64
        t.release("rt")


def test_read_ahead_with_other_sizes_and_expiry(relay, monkeypatch):
    import rngd_pd.kv.relay.tcp as tcp

    monkeypatch.setattr(tcp, "AHEAD_WAIT_S", 0.2)
    with TcpTransport(relay) as push, TcpTransport(relay) as t:
        push.push("rs", 0, b"s" * 10)
        push.push("rs", 1, b"L" * 100)
        t.pull("rs", 0, bytearray(10), 5.0)  # read-ahead asked for blob 1 with room for 10 bytes
        out = bytearray(100)
        assert t.pull("rs", 1, out, 5.0) == 100 and out == b"L" * 100  # asked again with 100
        push.push("rs", 2, b"x" * 200)
        with pytest.raises(TransportIntegrityError):
            t.pull("rs", 2, bytearray(100), 5.0)  # larger than the buffer, whichever way it is asked
        t.pull("rs", 0, bytearray(1000), 5.0)  # read-ahead for blob 1 now allows 1000 bytes
        with pytest.raises(TransportIntegrityError):
            t.pull("rs", 1, bytearray(10), 5.0)  # 100 bytes arrive for a 10-byte buffer: refused
        t.pull("rs", 0, bytearray(10), 5.0)
        time.sleep(0.5)  # the relay answers the parked GET for blob 1 with "timeout"
        assert t.pull("rs", 1, out, 5.0) == 100
        t.release("rs")


def test_relay_buffer_pool_follows_the_blob_size():
    """A pool full of 1 MiB buffers gives them up for 4 MiB ones (else every 4 MiB blob faults in
    fresh pages), and never holds more than its cap."""
    from rngd_pd.kv.relay.server import RelayConfig, Store

    store = Store(RelayConfig(pool_bytes=8 << 20))
    small = [store.reserve(1 << 20) for _ in range(8)]
    for buf in small:
        store.unreserve(buf)
    assert store.pooled == 8 << 20 and len(store.pool[1 << 20]) == 8
    big = store.reserve(4 << 20)
    store.unreserve(big)
    assert store.pool[4 << 20] == [big] and len(store.pool[1 << 20]) == 4
    assert store.pooled == 8 << 20
    assert store.reserve(4 << 20) is big  # the next 4 MiB blob reuses its pages
    store.unreserve(store.reserve(16 << 20))  # larger than the whole pool: not kept
    assert store.pooled == 4 << 20 and store.used == 4 << 20
