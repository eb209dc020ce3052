"""The Triton 2.51 stub deadlock on decoupled BLS streams, reproduced, next to the gRPC path pd uses.

    .venv/bin/python bench/bls_deadlock.py [--runs 3] [--threads 16] [--loops 200] [--tokens 40]
                                          [--spin 2] [--limit 120] [--via bls,grpc] [--json]

Each run starts a fresh tritonserver with two models (rngd_pd.testing.fanout): `echo` streams its input
ids back, and `fan` opens `threads` x `loops` streams of `tokens` tokens to it from `threads` threads
at once, while `spin` threads keep the GIL busy (they widen the race's window). `fan` reaches echo by
decoupled BLS (`via bls`, what pd did) or through the server's own gRPC endpoint (`via grpc`, what
pd does now, rngd_pd.stubs.pd_model). A run stalls when `fan` has not answered after `limit`
seconds; the stall's stacks are then read with gdb (when installed) and the three frames of the
cycle counted: `ResponseIterator::Next` (woke holding its iterator's mutex, waits for the GIL),
`EnqueueResponse` (holds the iterator map's mutex, waits for that iterator's) and
`GetResponseIterator` (holds the GIL, waits for the map's mutex). Exit status 1 when a gRPC run
stalls or comes back short.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FRAMES = ("ResponseIterator::Next", "EnqueueResponse", "GetResponseIterator")


def cycle_frames(pid: int) -> dict[str, int]:
    """How many threads of `pid` are in each frame of the cycle (empty without gdb)."""
    if shutil.which("gdb") is None:
        return {}
    out = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt 10"],
                         capture_output=True, text=True, timeout=120).stdout
    return {frame: len(re.findall(rf"{re.escape(frame)}\(", out)) for frame in FRAMES}


def one_run(via: str, args: argparse.Namespace) -> dict:
    from rngd_pd.serve.server import ServerConfig, TritonServer
    from rngd_pd.testing.fanout import fan, repository

    with tempfile.TemporaryDirectory(prefix="rngd-pd-bls-") as tmp:
        repo = repository(Path(tmp) / "repo", via)
        cfg = ServerConfig(repo, http_port=0, grpc_port=0, metrics_port=0)
        with TritonServer(cfg, log=Path(tmp) / "triton.log") as server:
            server.wait_ready(120, ("echo", "fan"))
            t0 = time.perf_counter()
            done = fan(server.grpc_url, args.threads, args.loops, args.tokens, args.spin, args.limit)
            wall = time.perf_counter() - t0
            frames: dict[str, int] = {}
            if done is None:
                from rngd_pd.host.stubs import stub_processes

                pids = [s.pid for s in stub_processes(server.proc.pid) if s.model == "fan"]
                frames = cycle_frames(pids[0]) if pids else {}
    want = args.threads * args.loops
    return {"via": via, "streams": want, "completed": done, "stalled": done is None,
            "wall_s": round(wall, 1), "streams_per_s": round(done / wall, 1) if done else 0.0,
            "cycle_frames": frames}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3, help="fresh servers per way")
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--loops", type=int, default=200, help="streams each thread opens, one after another")
    p.add_argument("--tokens", type=int, default=40, help="responses per stream")
    p.add_argument("--spin", type=int, default=2, help="threads keeping the GIL busy meanwhile")
    p.add_argument("--limit", type=float, default=120.0, help="seconds before a run counts as stalled")
    p.add_argument("--via", default="bls,grpc", help="comma-separated: bls, grpc")
    p.add_argument("--json", action="store_true", help="one JSON object per run")
    args = p.parse_args(argv)

    rows = []
    for via in args.via.split(","):
        for n in range(args.runs):
            print(f"  .. {via} run {n + 1}/{args.runs}", file=sys.stderr, flush=True)
            rows.append(one_run(via, args))
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print(f"{'via':<5} {'streams':>7} {'completed':>9} {'stalled':>7} {'wall s':>6} {'streams/s':>9}  "
              "threads in Next / EnqueueResponse / GetResponseIterator")
        for r in rows:
            frames = " / ".join(str(r["cycle_frames"].get(f, "-")) for f in FRAMES) if r["stalled"] else ""
            completed = "-" if r["completed"] is None else r["completed"]
            print(f"{r['via']:<5} {r['streams']:>7} {completed:>9} "
                  f"{r['stalled']!s:>7} {r['wall_s']:>6} {r['streams_per_s']:>9}  {frames}")
    bad = [r for r in rows if r["via"] == "grpc" and r["completed"] != r["streams"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
