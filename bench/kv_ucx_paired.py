"""nixl-ucx against a bare NIXL READ of the same bytes, measured in alternating pairs.

Why another benchmark: on a shared 2-core host the load changes from second to second, so a limit
measured a minute before the transport (bench/kv_bench.py) can be off by 10x either way. Here the same
two processes (same agents, same UCX settings, same connection) alternate a transport round and a bare
round many times; the ratio of each pair is taken, then the median.

* transport round: the pushing child pushes `in_flight` requests of 64 blobs (one thread per request,
  as prefill's layer hook would), this child pulls them concurrently (one thread per request), release.
* bare round: this child READs `in_flight` x 64 blobs already sitting in the pusher's registered arena
  (addresses taken from descriptors once), `in_flight` READs outstanding, no relay, no checksum, no
  copy: the limit the transport is held to (>= 0.8x).

    python bench/kv_ucx_paired.py [--seq 512] [--in-flight 1] [--pairs 9] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time

import numpy as np

LAYERS, KV_HEADS, HEAD_DIM, ELEM = 32, 8, 128, 2
BLOBS = 2 * LAYERS


def _pusher(conn, addr: str, pool_mb: int, blob: int) -> None:
    from rngd_pd.kv.nixl.ucx import NixlUcxTransport

    t = NixlUcxTransport(addr, pool_mb=pool_mb)
    src = np.random.default_rng(1).integers(0, 256, blob * BLOBS, np.uint8).reshape(BLOBS, blob)
    conn.send("ready")
    while (keys := conn.recv()) is not None:
        threads = [threading.Thread(target=lambda k=k: [t.push(k, i, src[i]) for i in range(BLOBS)])
                   for k in keys]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        t.flush()
        conn.send("pushed")
    os._exit(0)


def _bare_round(t, descs: list[dict], staging: int, in_flight: int) -> float:
    from rngd_pd.kv.nixl.agent import wait_xfer

    agent, ep = t.ep.agent, t.ep
    t0 = time.perf_counter()
    pending = []
    for i, d in enumerate(descs):
        off = staging + (i % (in_flight * 4)) * d["len"]
        local = agent.get_xfer_descs([(ep.base + off, d["len"], 0)], "DRAM")
        remote = agent.get_xfer_descs([(d["addr"], d["len"], 0)], "DRAM")
        handle = agent.initialize_xfer("READ", local, remote, d["agent"])
        agent.transfer(handle)
        pending.append(handle)
        if len(pending) >= in_flight:
            h = pending.pop(0)
            assert wait_xfer(agent, h, time.monotonic() + 60) == "DONE"
            h.release()
    for h in pending:
        assert wait_xfer(agent, h, time.monotonic() + 60) == "DONE"
        h.release()
    return time.perf_counter() - t0


def _transport_round(t, conn, keys: list[str], outs: list[np.ndarray]) -> float:
    t0 = time.perf_counter()
    conn.send(keys)
    pulls = [threading.Thread(target=lambda k=k, o=o: [t.pull(k, i, o[i], 60.0) for i in range(BLOBS)])
             for k, o in zip(keys, outs, strict=True)]
    for th in pulls:
        th.start()
    for th in pulls:
        th.join()
    dt = time.perf_counter() - t0
    assert conn.recv() == "pushed"
    for k in keys:
        t.release(k)
    return dt


def _puller(report, pusher_conn, addr: str, pool_mb: int, blob: int, in_flight: int, pairs: int) -> None:
    from rngd_pd.kv.nixl.ucx import NixlUcxTransport

    t = NixlUcxTransport(addr, pool_mb=pool_mb)
    assert pusher_conn.recv() == "ready"
    # the bare source: blobs pushed once and never read through the transport (no notification frees them)
    src_keys = [f"bare-src-{r}" for r in range(in_flight)]
    pusher_conn.send(src_keys)
    assert pusher_conn.recv() == "pushed"
    descs = [t._descriptor(k, i, 10.0) for i in range(BLOBS) for k in src_keys]
    for d in descs:
        t.ep.remote(d["agent"], d["md"], "bare")
    staging = t.ep.reserve(in_flight * 4 * blob, "bare", 0.0)
    outs = [np.ones((BLOBS, blob), np.uint8) for _ in range(in_flight)]
    expect = np.random.default_rng(1).integers(0, 256, blob * BLOBS, np.uint8).reshape(BLOBS, blob)
    rows = []
    for rep in range(pairs + 1):  # pair 0 warms both paths, not reported
        keys = [f"paired-{rep}-{r}" for r in range(in_flight)]
        first_bare = rep % 2 == 1
        bare = _bare_round(t, descs, staging, in_flight) if first_bare else None
        tr = _transport_round(t, pusher_conn, keys, outs)
        bare = bare if first_bare else _bare_round(t, descs, staging, in_flight)
        assert all(np.array_equal(o, expect) for o in outs), "transport bytes differ"
        if rep:
            rows.append((tr, bare))
    pusher_conn.send(None)
    report.send(rows)
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--in-flight", type=int, default=1)
    p.add_argument("--pairs", type=int, default=9)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    blob = KV_HEADS * args.seq * HEAD_DIM * ELEM
    pool_mb = max(256, 3 * args.in_flight * blob * BLOBS // (1 << 20))
    from rngd_pd.kv.relay.proc import start_relay

    ctx = mp.get_context("spawn")
    with start_relay("127.0.0.1", 0, "--max-mb", "1024") as relay:
        a, b = ctx.Pipe()
        rep_parent, rep_child = ctx.Pipe()
        pusher = ctx.Process(target=_pusher, args=(a, relay.addr, pool_mb, blob), daemon=True)
        puller = ctx.Process(target=_puller, args=(rep_child, b, relay.addr, pool_mb, blob, args.in_flight,
                                                   args.pairs), daemon=True)
        pusher.start()
        puller.start()
        rows = rep_parent.recv()
        for proc in (puller, pusher):
            proc.join(30)
    nbytes = blob * BLOBS * args.in_flight
    tr_ms = statistics.median(r[0] for r in rows) * 1e3
    bare_ms = statistics.median(r[1] for r in rows) * 1e3
    out = {"transport": "nixl-ucx", "seq": args.seq, "bytes": nbytes, "in_flight": args.in_flight,
           "pairs": len(rows), "ms": round(tr_ms, 2), "gbps": round(nbytes / tr_ms / 1e6, 3),
           "limit": "nixl-read (paired)", "limit_ms": round(bare_ms, 2),
           "limit_gbps": round(nbytes / bare_ms / 1e6, 3),
           "ratio": round(statistics.median(r[1] / r[0] for r in rows), 3),
           "ucx_tls": os.environ.get("UCX_TLS", "tcp (default)")}
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:12} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
