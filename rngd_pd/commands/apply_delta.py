"""`rngd-pd apply-delta`: update a running server's weights to a checkpoint in which some tensors
changed, reading only those (rngd_pd.model.delta; pd switches prefill and decode together,
rngd_pd.engine.switch)."""

from __future__ import annotations

import argparse
import json
import sys

from rngd_pd.errors import RngdPdError
from rngd_pd.wire.weights import DRAIN_S, apply_delta

HELP = "update a running server's weights to a changed checkpoint, reading only the changed tensors"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="Triton's HTTP address (host:port) of the server with pd")
    p.add_argument("--checkpoint", required=True,
                   help="the new checkpoint directory, as the server's host sees it (same config)")
    p.add_argument("--drain-s", type=float, default=DRAIN_S,
                   help="how long running requests may take to finish before the update gives up "
                        f"(default {DRAIN_S:.0f}; new requests wait meanwhile)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        report = apply_delta(args.url, args.checkpoint, drain_s=args.drain_s)
    except RngdPdError as exc:
        print(f"rngd-pd apply-delta: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, indent=1, sort_keys=True))
    elif not report.get("switched"):
        print(f"no tensor changed; still serving {report['old_fingerprint']}")
    else:
        print(f"{len(report['changed'])} tensors changed: {', '.join(report['changed'])}")
        mib = {k: report[f"bytes_{k}"] >> 20 for k in ("read", "hashed", "written", "shared")}
        print(f"read and converted {mib['read']} MiB (hashed {mib['hashed']} MiB to compare), "
              f"wrote {mib['written']} MiB, shared {mib['shared']} MiB")
        print(f"fingerprint {report['old_fingerprint']} -> {report['new_fingerprint']} (generation "
              f"{report['generation']}); {report['seconds_total']:.2f} s in all: "
              + ", ".join(f"{k} {v:.2f} s" for k, v in report["steps_s"].items()))
    return 0
