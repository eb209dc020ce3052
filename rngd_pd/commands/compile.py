"""`rngd-pd compile`: every RNGD graph a model repository configuration needs, ahead of time, into
an artifact directory that a card host's load then uses without compiling.

    rngd-pd compile --config rngd|default [--model PATH] --out DIR [--search full|N] [--only NAMES]

`--config rngd` is what `tritonserver --model-config-name rngd` loads (each model's
configs/rngd.pbtxt, else its config.pbtxt), `default` every config.pbtxt; the graphs are those of
every model whose device is rngd, planned as its engines plan them (rngd.runtime.configured_shapes).
Each graph is compiled in `.venv-rngd` by `rngd.graphs.compile_graph`, the call serving, CI and
`--compile-only` compile with, with the same tactic search (`--search`, serving's `rngd_search`),
and saved into DIR (rngd.artifacts). Resumable: a graph DIR holds already is skipped, nothing is
compiled for it; an interrupted run keeps every graph it finished. Serve with
`--param rngd_artifacts=DIR` to load them. Exits 1 when a graph failed, 2 without `.venv-rngd`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rngd_pd.devices.rngd.artifacts import DEFAULT_SEARCH, parse_search, search_label
from rngd_pd.devices.rngd.runtime import CONFIGS, compile_artifacts, configured_shapes
from rngd_pd.errors import DeviceUnavailableError

HELP = "compile every RNGD graph a model repository configuration needs into an artifact directory"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", choices=CONFIGS, default="rngd",
                   help="which configs: rngd (configs/rngd.pbtxt, else config.pbtxt) or default "
                        "(config.pbtxt)")
    p.add_argument("--model", default=None,
                   help="GGUF file or checkpoint directory (default: the embedded model)")
    p.add_argument("--out", required=True, help="the artifact directory (created; graphs in it are skipped)")
    p.add_argument("--search", type=parse_search, default=DEFAULT_SEARCH,
                   help=f"the compiler's tactic search: `full` or a bound of N unique shapes (default "
                        f"{DEFAULT_SEARCH}, as serving's rngd_search)")
    p.add_argument("--only", default="", help="only these of the configured graphs (names, comma-separated)")
    p.add_argument("--timeout", type=float, default=7200.0, help="seconds per graph")
    p.add_argument("--json", action="store_true", help="one JSON object per graph instead of the table")


def run(args: argparse.Namespace) -> int:
    shapes = configured_shapes(args.config, args.model)
    only = [n for n in args.only.split(",") if n.strip()]
    print(f"rngd-pd compile --config {args.config}: {shapes.describe()}, search {search_label(args.search)} "
          f"-> {Path(args.out).resolve()}", file=sys.stderr, flush=True)
    counts = {"compiled": 0, "reused": 0, "failed": 0}
    t0 = time.monotonic()
    try:
        for row in compile_artifacts(shapes, args.out, search=args.search, model=args.model, only=only,
                                     per_graph_timeout=args.timeout):
            reused = row.get("source") == "artifacts"
            what = "failed" if not row.get("ok") else "reused" if reused else "compiled"
            counts[what] += 1
            secs = (row.get("seconds") or {}).get("total", 0.0)
            print(json.dumps(row) if args.json else
                  f"  {row['name']:<26} {row.get('shape', ''):<14} {what:<8} {secs:>8.1f} s  "
                  + (f"{row.get('binary_bytes', 0)} bytes" if row.get("ok") else
                     f"at {row.get('stage')}: {str(row.get('error', ''))[-400:]}"), flush=True)
    except DeviceUnavailableError as exc:
        print(f"rngd-pd compile: {exc}", file=sys.stderr)
        return 2
    print(f"{sum(counts.values())} graphs in {time.monotonic() - t0:.0f} s: {counts['compiled']} compiled, "
          f"{counts['reused']} already in {args.out}, {counts['failed']} failed", file=sys.stderr, flush=True)
    return 1 if counts["failed"] or not sum(counts.values()) else 0
