"""`rngd-pd devices`: which device kinds are usable here, and the model config `serve` would choose."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HELP = "list usable devices (cpu, cuda, rngd, atom) and the model config serve would choose"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repository", type=Path, default=None,
                   help="model repository (default ./model_repository)")
    p.add_argument("--role", default="all", choices=["all", "prefill", "decode", "gateway"])
    p.add_argument("--json", action="store_true", help="print JSON lines instead of a table")


def run(args: argparse.Namespace) -> int:
    from rngd_pd.commands.serve import choose_config_name, default_repository
    from rngd_pd.devices import probe_devices

    rows = probe_devices()
    usable = {r.kind for r in rows if r.available}
    name, why = choose_config_name((args.repository or default_repository()).resolve(), args.role, usable)
    if args.json:
        for r in rows:
            print(json.dumps({"kind": r.kind, "available": r.available, "cards": list(r.cards),
                              "reason": r.reason}))
        print(json.dumps({"config_name": name, "why": why, "role": args.role}))
        return 0
    print(f"{'kind':6} {'usable':7} {'cards':24} why not")
    for r in rows:
        cards = ", ".join(r.cards) or "-"
        print(f"{r.kind:6} {'yes' if r.available else 'no':7} {cards:24} {r.reason}")
    print(f"\nserve --role {args.role} would use: {name or 'config.pbtxt'} ({why})")
    return 0
