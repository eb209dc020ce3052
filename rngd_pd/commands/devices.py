"""`rngd-pd devices`: which device kinds are usable here, the model config `serve` would choose, and the
compute dtype the models would use on this host (`auto`: bf16 only where the CPU computes it natively)."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from pathlib import Path

from rngd_pd.devices.cpu_features import (
    AUTO,
    CpuFeatures,
    DtypeChoice,
    choose_compute_dtype,
    read_cpu_features,
)
from rngd_pd.triton.params import ENV_DTYPE

HELP = "list usable devices (cpu, cuda, rngd, atom), the model config and compute dtype serve would choose"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repository", type=Path, default=None,
                   help="model repository (default ./model_repository)")
    p.add_argument("--role", default="all", choices=["all", "prefill", "decode", "gateway"])
    p.add_argument("--json", action="store_true", help="print JSON lines instead of a table")


def compute_dtype_choice(env: Mapping[str, str] | None = None) -> tuple[DtypeChoice, CpuFeatures]:
    """The compute dtype the served models would choose on this host ($RNGD_PD_DTYPE, else auto)."""
    env = os.environ if env is None else env
    requested = env.get(ENV_DTYPE, "") or AUTO
    return choose_compute_dtype(requested, source=f"${ENV_DTYPE}"), read_cpu_features()


def run(args: argparse.Namespace) -> int:
    from rngd_pd.commands.serve import choose_config_name, default_repository
    from rngd_pd.devices import probe_devices

    rows = probe_devices()
    usable = {r.kind for r in rows if r.available}
    name, why = choose_config_name((args.repository or default_repository()).resolve(), args.role, usable)
    choice, cpu = compute_dtype_choice()
    if args.json:
        for r in rows:
            print(json.dumps({"kind": r.kind, "available": r.available, "cards": list(r.cards),
                              "reason": r.reason}))
        print(json.dumps({"config_name": name, "why": why, "role": args.role,
                          "compute_dtype": choice.dtype, "compute_dtype_requested": choice.requested,
                          "compute_dtype_why": choice.reason, "cpu": cpu.model, "cpu_arch": cpu.arch,
                          "cpu_native_bf16": cpu.native_bf16}))
        return 0
    print(f"{'kind':6} {'usable':7} {'cards':24} why not")
    for r in rows:
        cards = ", ".join(r.cards) or "-"
        print(f"{r.kind:6} {'yes' if r.available else 'no':7} {cards:24} {r.reason}")
    print(f"\nserve --role {args.role} would use: {name or 'config.pbtxt'} ({why})")
    print(f"compute dtype: {choice.dtype} ({choice.reason}; CPU: {cpu.model or cpu.arch or 'unknown'})")
    return 0
