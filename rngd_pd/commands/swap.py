"""`rngd-pd swap`: reload one model of a running server as another variant (changed parameters,
e.g. decode's num_slots) without stopping it (rngd_pd.serve.model_control)."""

from __future__ import annotations

import argparse
import sys

from rngd_pd.errors import RngdPdError
from rngd_pd.serve.model_control import swap

HELP = "reload a model of a running server with changed parameters; in-flight requests finish on the old one"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="Triton's HTTP address (host:port)")
    p.add_argument("--model", required=True, help="the model to reload (decode, prefill, pd, ...)")
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                   help="a model parameter of the new variant (repeatable), e.g. num_slots=16")
    p.add_argument("--probe", default="pd",
                   help="after the reload, time one request through this model to its first decoded "
                        "token (default pd; '' for none)")


def run(args: argparse.Namespace) -> int:
    params = {}
    for item in args.param:
        name, sep, value = item.partition("=")
        if not sep or not name:
            print(f"rngd-pd swap: --param takes NAME=VALUE, got {item!r}", file=sys.stderr)
            return 2
        params[name] = value
    try:
        report = swap(args.url, args.model, params, probe=args.probe or None)
    except RngdPdError as exc:
        print(f"rngd-pd swap: {exc}", file=sys.stderr)
        return 1
    print(report.to_json())
    return 0
