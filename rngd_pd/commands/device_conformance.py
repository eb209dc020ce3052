"""`rngd-pd device-conformance`: a device's runtime against transformers, shape by shape
(rngd_pd.devices.conformance, also `python -m rngd_pd.devices.conformance`), plus the compile-only
check of the RNGD graphs for hosts without a card.

    .venv/bin/rngd-pd device-conformance cpu|cuda|rngd|atom [--dtype bf16] [--json]
    .venv/bin/rngd-pd device-conformance rngd --compile-only [--stage import|lower|compile]

`rngd --compile-only` compiles every graph with the Furiosa compiler inside `.venv-rngd` (it says to
run `make rngd-env` when that is missing) and checks nothing numeric: for hosts without a card.
`--stage import` (the default) stops where the compiler accepts or refuses each op (seconds a graph);
`--stage compile` goes to the binary (minutes a graph on 2 cores: docs/devices-rngd.md). Exits 1 on
any failure, 2 when the device cannot be used here; prints what it checked either way.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

from rngd_pd.devices import conformance
from rngd_pd.devices.conformance import Check, report
from rngd_pd.devices.rngd.artifacts import DEFAULT_SEARCH, FULL, parse_search
from rngd_pd.devices.rngd.runtime import compile_check, configured_shapes
from rngd_pd.devices.runtime import GraphShapes
from rngd_pd.errors import DeviceUnavailableError


def compile_scope(stage: str) -> str:
    """What `rngd --compile-only --stage <stage>` checked, in one sentence (printed with the table)."""
    graphs = ("every graph the shapes need: per shape one decoder layer (its weights as inputs, run "
              "once per layer of the model) and the LM head")
    return {"import": f"furiosa's decompositions + DFG import (where ops are refused) of {graphs}",
            "lower": f"import + lowering of {graphs}",
            "compile": f"the whole compiler, down to the binary, of {graphs}",
            }[stage] + ". Nothing runs: no card"


def compile_only(kind: str, shapes: GraphShapes, stage: str = "import", per_graph_timeout: float = 7200.0,
                 no_cache: bool = False, search: int | None = DEFAULT_SEARCH) -> list[Check]:
    """Take every graph through the card's compiler on a host that may have none (rngd only), up to
    `stage` (import: every op accepted, seconds a graph; compile: the binary, minutes a graph on 2
    cores), by the call serving compiles with (rngd.graphs.compile_graph). `no_cache`: a real
    compile, not furiosa's cache; `search`: the tactic search, bounded by default as in serving
    (rngd.runtime.compile_check)."""
    if kind != "rngd":
        raise DeviceUnavailableError(f"--compile-only is for rngd (its compiler runs without a card); "
                                     f"{kind} needs its hardware for conformance")

    checks = []
    for r in compile_check(shapes, stage=stage, per_graph_timeout=per_graph_timeout, no_cache=no_cache,
                           search=search):
        secs = r.get("seconds") or {}
        total = secs.get("total", sum(secs.values())) if isinstance(secs, dict) else float(secs)
        refused = ", ".join(r.get("refused_ops") or [])
        detail = r.get("error") or (f"refused: {refused}" if refused else f"reached {r.get('stage')}")
        if r.get("ok") and r.get("binary_bytes"):
            detail += f", binary {r['binary_bytes']} bytes"
        if r.get("search") == FULL:
            detail += ", furiosa's full tactic search"
        elif r.get("search"):
            detail += f", tactic search bounded to {r['search']} shapes"
        sdk = ", ".join(f"{k} {v}" for k, v in (r.get("sdk") or {}).items())
        name = f"{r.get('graph', 'graph')}_{r.get('part', 'graph')}@{stage}"
        checks.append(Check(name, str(r.get("shape", "")), bool(r.get("ok")),
                            f"{detail} ({sdk})" if sdk else detail, round(total, 1)))
    return checks


HELP = "check a device's graphs against transformers, shape by shape (cpu, cuda, rngd, atom)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    conformance.add_arguments(p)
    p.add_argument("--compile-only", action="store_true", help="rngd: compile every graph, run nothing")
    p.add_argument("--stage", default="import", choices=("import", "lower", "compile"),
                   help="--compile-only: how far the compiler goes (import: every op accepted; compile: "
                        "down to the binary)")
    p.add_argument("--no-cache", action="store_true", help="--compile-only: bypass furiosa's compile cache")
    p.add_argument("--timeout", type=float, default=7200.0, help="--compile-only: seconds per graph")
    p.add_argument("--search", type=parse_search, default=DEFAULT_SEARCH,
                   help=f"--compile-only: the compiler's tactic search, as serving's rngd_search: `full` or "
                        f"a bound of N unique shapes (default {DEFAULT_SEARCH})")
    p.add_argument("--config-shapes", action="store_true",
                   help="rngd: the shapes the model repository's rngd configs need (prefill chunk_size, "
                        "every decode bucket of decode/configs/rngd.pbtxt) instead of --chunks/--decode")


def run(args: argparse.Namespace) -> int:
    shapes = conformance.shapes_of(args)
    if args.config_shapes:
        shapes = dataclasses.replace(configured_shapes(), dtype=args.dtype, kv_dtype=args.kv_dtype)
    if not args.compile_only:
        return conformance.run(args, shapes)
    print(f"rngd --compile-only --stage {args.stage}: {compile_scope(args.stage)}; "
          f"shapes {shapes.describe()}", file=sys.stderr if args.json else sys.stdout, flush=True)
    try:
        checks = compile_only(args.device, shapes, args.stage, args.timeout, args.no_cache, args.search)
    except DeviceUnavailableError as exc:
        print(f"device conformance: {args.device} cannot be checked here: {exc}", file=sys.stderr)
        return 2
    return report(args.device, checks, args.json)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rngd-pd device-conformance", description=(__doc__ or "").split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
