"""Move one Llama-3.1-8B request's KV between two processes with each transport; compare to the limits.

Geometry: 32 layers x (K, V), 8 kv heads, head_dim 128, bf16: at S=512 64 blobs of 1 MiB (67 MB), at
S=2048 64 blobs of 4 MiB (268 MB). A pushing child process pushes every blob of `in_flight` requests (one
thread per request), this process pulls them concurrently into preallocated, pre-faulted buffers; a
round's time runs from the push command to the last pulled byte, so the transfer overlaps as in serving.
In the same run it measures the limits, each right before the row it belongs to: memcpy into a
pre-faulted buffer (shm's), a raw loopback socket stream between two processes (tcp's), and a bare
two-agent NIXL READ of the same bytes and in-flight count (nixl-ucx's, when NIXL is importable). Rows:
ms per round (`in_flight` requests), ms per request, GB/s, the limit and the ratio to it (medians);
the `limit:*` rows repeat the best limit seen. shm rows also carry the copy-in/copy-out ceiling measured
right after them (`ceiling_gbps`: two processes copying the request's bytes at once, the least work of
any design that copies into shared memory and out again) and `ratio_to_ceiling`.

    python bench/kv_bench.py [--quick] [--json] [--transports shm,tcp,nixl-ucx]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable

import numpy as np

from rngd_pd.kv import load_transport
from rngd_pd.kv.protocol import flush
from rngd_pd.kv.relay.frames import tune_socket

LAYERS, KV_HEADS, HEAD_DIM, ELEM = 32, 8, 128, 2


def blob_bytes(seq: int) -> int:
    return KV_HEADS * seq * HEAD_DIM * ELEM


def progress(msg: str) -> None:
    print(f"  .. {msg}", file=sys.stderr, flush=True)


def faulted(nbytes: int) -> np.ndarray:
    a = np.empty(nbytes, np.uint8)
    a.fill(1)  # touch every page now, as a serving process's reused buffers are
    return a


def from_child(conn, proc, timeout: float = 300.0):
    """The child's next message; raises instead of hanging when the child died or went silent."""
    deadline = time.monotonic() + timeout
    while not conn.poll(0.2):
        if not proc.is_alive():
            raise RuntimeError(f"benchmark child {proc.name} exited with {proc.exitcode} (see its stderr)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"benchmark child {proc.name} sent nothing for {timeout:g} s")
    return conn.recv()


# ------------------------------------------------------------------------------------------ limits
def memcpy_gbps(nbytes: int, reps: int) -> float:
    src, dst = faulted(nbytes), faulted(nbytes)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def _copier(conn, nbytes: int, blob: int) -> None:
    src, dst = faulted(nbytes), faulted(nbytes)
    conn.send("ready")
    while conn.recv():
        _copy_blobs(src, dst, blob)
        conn.send("done")


def _copy_blobs(src: np.ndarray, dst: np.ndarray, blob: int) -> None:
    for off in range(0, len(src), blob):
        np.copyto(dst[off: off + blob], src[off: off + blob])


def two_copy_gbps(nbytes: int, blob: int, reps: int) -> float:
    """The copy-in/copy-out ceiling: this process and a child each copy the request's bytes, blob by
    blob, at the same time (the least a transport that copies into shared memory in one process and
    out of it in another must do). On a host whose memory bandwidth one core nearly saturates, this is
    about half the memcpy figure: shm's 0.5 x memcpy target sits at this ceiling there."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_copier, args=(child, nbytes, blob), daemon=True)
    p.start()
    src, dst, times = faulted(nbytes), faulted(nbytes), []
    assert from_child(parent, p) == "ready"
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        parent.send(True)
        _copy_blobs(src, dst, blob)
        from_child(parent, p)
        times.append(time.perf_counter() - t0)
    parent.send(False)
    p.join(10)
    return nbytes / statistics.median(times[1:]) / 1e9


def _sock_receiver(port_conn, nbytes: int, reps: int) -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    port_conn.send(srv.getsockname()[1])
    conn, _ = srv.accept()
    tune_socket(conn)
    buf = memoryview(faulted(nbytes))
    for _ in range(reps):
        got = 0
        while got < nbytes:
            got += conn.recv_into(buf[got:])
        conn.sendall(b"k")
    conn.close()
    srv.close()


def socket_gbps(nbytes: int, reps: int) -> float:
    """One TCP connection on loopback, sendall of the whole request into a pre-faulted recv buffer."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_sock_receiver, args=(child, nbytes, reps), daemon=True)
    p.start()
    sock = socket.create_connection(("127.0.0.1", from_child(parent, p)))
    tune_socket(sock)
    src, ack, times = faulted(nbytes), bytearray(1), []
    for _ in range(reps):
        t0 = time.perf_counter()
        sock.sendall(src)
        sock.recv_into(ack)
        times.append(time.perf_counter() - t0)
    sock.close()
    p.join(10)
    return nbytes / statistics.median(times) / 1e9


def nixl_gbps(nbytes: int, blob: int, in_flight: int, reps: int) -> float | None:
    try:
        from rngd_pd.kv.nixl import agent as ucx

        return ucx.bare_read_gbps(nbytes, blob, in_flight=in_flight, repeats=reps)
    except Exception as e:  # NIXL missing or broken here: no limit row, said why
        progress(f"nixl-ucx bare READ unavailable: {e}")
        return None


# -------------------------------------------------------------------------------- pushing process
def _pusher(conn, name: str, options: dict, blob: int, blobs: int) -> None:
    t = load_transport(name, **options)
    src = np.random.default_rng(1).integers(0, 256, blob * blobs, np.uint8).reshape(blobs, blob)
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            break
        t0 = time.perf_counter()
        threads = [threading.Thread(target=_push_all, args=(t, k, src)) for k in msg]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        conn.send(time.perf_counter() - t0)
        conn.recv()  # stay up (holding what nixl-ucx must serve) until the puller says so
    t.close()
    conn.send("closed")


def _push_all(t, key: str, src: np.ndarray) -> None:
    for i in range(len(src)):
        t.push(key, i, src[i])
    flush(t, key)  # a pipelining transport (tcp) is done only when the relay acknowledged everything


def run_transport(name: str, options: dict, seq: int, in_flight: int, reps: int) -> dict:
    """Time `reps` rounds of `in_flight` requests; median round; byte-exactness checked each round."""
    blob, blobs = blob_bytes(seq), 2 * LAYERS
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_pusher, args=(child, name, options, blob, blobs), daemon=True)
    proc.start()
    t = load_transport(name, **options)
    outs = [faulted(blob * blobs).reshape(blobs, blob) for _ in range(in_flight)]
    expect = np.random.default_rng(1).integers(0, 256, blob * blobs, np.uint8).reshape(blobs, blob)
    assert from_child(parent, proc) == "ready"
    times, push_times = [], []
    try:
        for rep in range(reps + 1):  # round 0 warms pools and connections, not timed
            keys = [f"bench-{os.getpid()}-{rep}-{r}" for r in range(in_flight)]
            t0 = time.perf_counter()
            parent.send(keys)
            pulls = [threading.Thread(target=_pull_all, args=(t, k, outs[r], blobs))
                     for r, k in enumerate(keys)]
            for th in pulls:
                th.start()
            for th in pulls:
                th.join()
            dt = time.perf_counter() - t0
            push_s = from_child(parent, proc)
            for r, k in enumerate(keys):
                if not (np.array_equal(outs[r][0], expect[0]) and np.array_equal(outs[r][-1], expect[-1])):
                    raise SystemExit(f"{name}: bytes differ in request {k}")
                outs[r][[0, -1]] = 0
                t.release(k)
            parent.send("go on")
            if rep:
                times.append(dt)
                push_times.append(push_s)
                progress(f"{name} S={seq} x{in_flight} round {rep}/{reps}: {dt * 1e3:.1f} ms")
    finally:
        with contextlib.suppress(OSError, EOFError, RuntimeError):  # the child may be gone already
            parent.send(None)
            from_child(parent, proc, 30.0)
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        t.close()
    ms = statistics.median(times) * 1e3
    nbytes = blob * blobs * in_flight
    return {"transport": name, "seq": seq, "bytes": nbytes, "in_flight": in_flight, "ms": round(ms, 2),
            "ms_per_request": round(ms / in_flight, 2), "gbps": round(nbytes / ms / 1e6, 3),
            "push_ms": round(statistics.median(push_times) * 1e3, 2)}


def _pull_all(t, key: str, out: np.ndarray, blobs: int) -> None:
    for i in range(blobs):
        t.pull(key, i, out[i], 60.0)


# ---------------------------------------------------------------------------------------- driver
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="S=512 only, fewer rounds")
    p.add_argument("--json", action="store_true", help="one JSON object per row instead of a table")
    p.add_argument("--transports", default="shm,tcp,nixl-ucx")
    p.add_argument("--reps", type=int, default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs to stdout: keep --json parseable
    seqs = (512,) if args.quick else (512, 2048)
    reps = args.reps or (3 if args.quick else 5)
    names = [n for n in args.transports.split(",") if n != "nixl-ucx" or _nixl_importable()]
    if not args.json:
        print(HEAD, flush=True)
    with contextlib.ExitStack() as stack:
        relay = None
        if ("tcp" in names or "nixl-ucx" in names) and not os.environ.get("AIRM_KV_TCP_ADDR"):
            from rngd_pd.kv.relay.proc import start_relay

            relay = stack.enter_context(start_relay("127.0.0.1", 0, "--max-mb", "8192")).addr
        for seq in seqs:
            bench_seq(seq, names, reps, relay, lambda row: emit(row, args.json))
    return 0


LIMITS = {"shm": "memcpy", "tcp": "socket", "nixl-ucx": "nixl-read"}


def measure_limit(name: str, seq: int, in_flight: int, reps: int) -> float | None:
    nbytes = blob_bytes(seq) * 2 * LAYERS
    if name == "shm":
        return memcpy_gbps(nbytes, reps)
    if name == "tcp":
        return socket_gbps(nbytes, reps)
    if name == "nixl-ucx":
        return nixl_gbps(nbytes * in_flight, blob_bytes(seq), in_flight, reps)
    return None


def bench_seq(seq: int, names: list[str], reps: int, relay: str | None, out: Callable[[dict], None]) -> None:
    """Each transport row with its limit measured right before it (the load here varies minute to minute)."""
    limits = []
    for name in names:
        opts = {"addr": relay} if name in ("tcp", "nixl-ucx") and relay else {}
        for in_flight in (1, 8):
            need = 3 * blob_bytes(seq) * 2 * LAYERS * in_flight  # sender's store + receiver's buffers + relay
            if need > available_bytes() // 2:
                progress(f"{name} S={seq} x{in_flight} skipped: needs ~{need / 1e9:.1f} GB, "
                         f"{available_bytes() / 1e9:.1f} GB available")
                continue
            progress(f"S={seq} x{in_flight}: limit for {name}")
            lim = measure_limit(name, seq, in_flight, reps)
            try:
                row = run_transport(name, opts, seq, in_flight, reps)
            except Exception as e:  # one broken transport must not hide the others' rows
                progress(f"{name} S={seq} x{in_flight} failed: {e!r}")
                continue
            row.update(limit=LIMITS.get(name, "?"), limit_gbps=round(lim, 3) if lim else None,
                       ratio=round(row["gbps"] / lim, 3) if lim else None)
            if name == "shm":
                ceiling = two_copy_gbps(blob_bytes(seq) * 2 * LAYERS, blob_bytes(seq), reps)
                row.update(ceiling="two-copies", ceiling_gbps=round(ceiling, 3),
                           ratio_to_ceiling=round(row["gbps"] / ceiling, 3))
            out(row)
            if lim and name != "nixl-ucx":
                limits.append((LIMITS[name], lim))
    nbytes = blob_bytes(seq) * 2 * LAYERS
    for lim_name in dict(limits):
        best = max(v for n, v in limits if n == lim_name)
        ms = round(nbytes / best / 1e6, 2)
        out({"transport": f"limit:{lim_name}", "seq": seq, "bytes": nbytes, "in_flight": 1,
             "ms": ms, "ms_per_request": ms, "gbps": round(best, 3), "limit": lim_name,
             "limit_gbps": round(best, 3), "ratio": 1.0})


def _nixl_importable() -> bool:
    try:
        import nixl  # noqa: F401

        from rngd_pd.kv.nixl import ucx as nixl_ucx  # noqa: F401
    except Exception:
        return False
    return True


HEAD = (f"{'transport':14} {'S':>5} {'in_flight':>9} {'MB':>7} {'ms':>9} {'ms/req':>8} {'GB/s':>7} "
        f"{'limit':>10} {'lim GB/s':>8} {'ratio':>6} {'/ceiling':>8}")


def emit(row: dict, as_json: bool) -> None:
    """Print one row as soon as it exists (a long run killed half-way keeps what it measured)."""
    if as_json:
        print(json.dumps(row), flush=True)
        return
    lim = f"{row['limit_gbps']:.2f}" if row.get("limit_gbps") else "-"
    ratio = f"{row['ratio']:.2f}" if row.get("ratio") else "-"
    ceiling = f"{row['ratio_to_ceiling']:.2f}" if row.get("ratio_to_ceiling") else "-"
    print(f"{row['transport']:14} {row['seq']:>5} {row['in_flight']:>9} {row['bytes'] / 1e6:>7.1f} "
          f"{row['ms']:>9.1f} {row['ms_per_request']:>8.1f} {row['gbps']:>7.2f} {row['limit']:>10} "
          f"{lim:>8} {ratio:>6} {ceiling:>8}", flush=True)


def available_bytes() -> int:
    """MemAvailable: rows that would need more than half of it are skipped (this host is shared)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


if __name__ == "__main__":
    sys.exit(main())
