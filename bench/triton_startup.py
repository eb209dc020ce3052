"""tritonserver start-to-ready time for a model repository, with each model's load time from the log.

    .venv/bin/python bench/triton_startup.py [--repository model_repository] [--config-name cpu]
                                              [--runs 1] [--json]

Starts the server exactly as `rngd-pd serve` does (rngd_pd.serve.server), waits for /v2/health/ready,
stops it, and reads "loading: NAME:1" / "successfully loaded 'NAME'" timestamps from the log. It also
sums the CPU seconds tritonserver and its stubs spent until ready (/proc): unlike the wall time, that
figure hardly moves with the host's load, so a start-up change can be judged on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from rngd_pd.serve.server import ServerConfig, TritonServer

_STAMP = r"^I\d{4} (\d\d:\d\d:\d\d\.\d+)"
_LOADING = re.compile(_STAMP + r".*\"loading: (\w+):\d+\"")
_LOADED = re.compile(_STAMP + r".*\"successfully loaded '(\w+)'")


def _seconds(stamp: str) -> float:
    t = datetime.strptime(stamp, "%H:%M:%S.%f")
    return t.hour * 3600 + t.minute * 60 + t.second + t.microsecond / 1e6


def model_load_times(log: str) -> dict[str, float]:
    """Seconds from 'loading' to 'successfully loaded' per model."""
    start: dict[str, float] = {}
    took: dict[str, float] = {}
    for line in log.splitlines():
        if m := _LOADING.match(line):
            start[m[2]] = _seconds(m[1])
        elif (m := _LOADED.match(line)) and m[2] in start:
            took[m[2]] = _seconds(m[1]) - start[m[2]]
    return took


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds of process `root` and its descendants (and their reaped children)."""
    procs: dict[int, tuple[int, int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            procs[int(entry.name)] = (int(fields[1]), sum(int(f) for f in fields[11:15]))
    tree = {root}
    while grown := {pid for pid, (ppid, _) in procs.items() if ppid in tree} - tree:
        tree |= grown
    return sum(procs[pid][1] for pid in tree if pid in procs) / os.sysconf("SC_CLK_TCK")


def measure(repository: Path, config_name: str | None, timeout: float) -> dict:
    """One start: seconds to ready and per-model load seconds."""
    log = Path(tempfile.mkdtemp(prefix="rngd-pd-startup-")) / "tritonserver.log"
    cfg = ServerConfig(repository, config_name, http_port=0, grpc_port=0, metrics_port=0)
    server = TritonServer(cfg, log=log)
    t0 = time.monotonic()
    server.start()
    try:
        server.wait_ready(timeout)
        ready_s = time.monotonic() - t0
        cpu_s = tree_cpu_seconds(server.proc.pid)
    finally:
        server.stop()
    return {"start_to_ready_s": round(ready_s, 2), "cpu_s_to_ready": round(cpu_s, 1),
            "load_avg_1m": round(os.getloadavg()[0], 1),
            "models_s": {k: round(v, 2) for k, v in sorted(model_load_times(log.read_text()).items())}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repository", type=Path, default=Path("model_repository"))
    p.add_argument("--config-name", default="cpu")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json", action="store_true", help="print JSON lines")
    args = p.parse_args(argv)
    for run in range(args.runs):
        row = {"run": run, "config_name": args.config_name, **measure(args.repository, args.config_name,
                                                                      args.timeout)}
        if args.json:
            print(json.dumps(row), flush=True)
            continue
        print(f"run {run}: start to ready {row['start_to_ready_s']:.1f} s, {row['cpu_s_to_ready']:.1f} CPU s "
              f"(tritonserver + stubs; config {args.config_name}, load {row['load_avg_1m']})")
        for name, secs in row["models_s"].items():
            print(f"  {name:12} {secs:7.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
