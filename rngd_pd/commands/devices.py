"""`rngd-pd devices`: which device kinds are usable here and why not, the SDKs and environments found,
which model configs can load, the one `serve` would choose, and the compute dtype each phase's model
would use on this host (`auto`: the faster of bf16 and fp32, measured per phase, rngd_pd.devices.kernels)."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from rngd_pd.commands.serve import CONFIG_CHOICES, choose_config_name, default_repository
from rngd_pd.config.env import RNGD_PD_DTYPE, RNGD_PD_MODEL
from rngd_pd.devices import probe_devices
from rngd_pd.devices.cpu_features import (
    CpuFeatures,
    DtypeChoice,
    choose_compute_dtype,
    read_cpu_features,
)
from rngd_pd.devices.rngd.env import rngd_env
from rngd_pd.devices.rngd.runtime import smi_snapshot
from rngd_pd.model.checkpoint import open_checkpoint

HELP = "list usable devices (cpu, cuda, rngd, atom), the model config and compute dtype serve would choose"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repository", type=Path, default=None,
                   help="model repository (default ./model_repository)")
    p.add_argument("--role", default="all", choices=["all", "prefill", "decode", "gateway"])
    p.add_argument("--json", action="store_true", help="print JSON lines instead of a table")


PHASE_OF = {"prefill": "prefill", "decode": "decode", "colocated": "both"}  # model -> kernels phase


def compute_dtype_choice(env: Mapping[str, str] | None = None, phase: str | None = None
                         ) -> tuple[DtypeChoice, CpuFeatures]:
    """The compute dtype a served model of `phase` would choose on this host ($RNGD_PD_DTYPE, else
    auto; with a phase, measured as the model would, for $RNGD_PD_MODEL or the embedded model)."""
    requested = RNGD_PD_DTYPE.get(env)
    config = None
    if phase is not None:
        config = open_checkpoint(RNGD_PD_MODEL.get(env)).config()
    return (choose_compute_dtype(requested, source=f"${RNGD_PD_DTYPE.name}", phase=phase, config=config),
            read_cpu_features())


SDK_PACKAGES = ("torch", "numpy", "rebel-compiler", "furiosa-torch", "furiosa-smi")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environments() -> list[dict]:
    """Each Python environment a device runs in, with the SDK versions found in it."""
    import torch

    main = {p: _version(p) for p in SDK_PACKAGES}
    main["torch"] = f"{main['torch']} ({'CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU build'})"
    rows = [{"env": "this (.venv)", "path": sys.prefix, "for": "cpu, cuda, atom",
             "packages": {k: v for k, v in main.items() if v}}]
    venv = rngd_env()
    python = venv / "bin" / "python"
    rngd: dict = {"env": venv.name, "path": str(venv), "for": "rngd (furiosa-torch pins torch 2.10)"}
    if python.exists():
        code = "\n".join(["import importlib.metadata as m, json", "out = {}", f"for p in {SDK_PACKAGES!r}:",
                          "    try: out[p] = m.version(p)", "    except m.PackageNotFoundError: pass",
                          "print(json.dumps(out))"])
        try:
            done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60)
            rngd["packages"] = json.loads(done.stdout) if done.returncode == 0 else {}
            rngd["problem"] = "" if done.returncode == 0 else done.stderr.strip()[-200:]
        except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
            rngd["packages"], rngd["problem"] = {}, str(exc)
    else:
        rngd["packages"], rngd["problem"] = {}, "missing: run `make rngd-env`"
    return [*rows, rngd]


def smi_lines(smi: Mapping) -> list[str]:
    """`rngd-pd devices`' lines for furiosa-smi's view of the RNGD cards (rngd.smi_snapshot)."""
    version = (smi.get("sdk") or {}).get("furiosa-smi")
    head = f"rngd cards (furiosa-smi {version}):" if version else "rngd cards (furiosa-smi):"
    if smi.get("error"):
        return [f"{head} {smi['error']}"]
    driver = smi.get("driver") or f"none ({smi.get('driver_error') or 'not reported'})"
    lines = [f"{head} driver {driver}"]
    for d in smi.get("devices") or []:
        gb = 10**9
        mem, temp = d.get("memory") or {}, d.get("temperature_c") or {}
        parts = [f"npu{d.get('index')}", str(d.get("name") or "?"), f"fw {d.get('firmware') or '?'}",
                 f"{d['power_w']:.1f} W" if d.get("power_w") is not None else "power ?",
                 f"{temp['soc_peak']:.0f} C" if temp.get("soc_peak") is not None else "temperature ?",
                 f"memory {mem['in_use_bytes'] / gb:.1f} / {mem['total_bytes'] / gb:.1f} GB in use"
                 if mem else "memory ?"]
        unread = f" (unreadable: {', '.join(d['errors'])})" if d.get("errors") else ""
        lines.append("  " + ", ".join(parts) + unread)
    if not smi.get("devices"):
        lines.append("  none listed")
    return lines


def config_rows(repository: Path, role: str, usable: set[str], reasons: Mapping[str, str]) -> list[dict]:
    """Each device binding of the model repository: can it load here for `role`, and if not why."""
    out = []
    for variant, needs in CONFIG_CHOICES:
        if variant is not None and not any(repository.glob(f"*/configs/{variant}.pbtxt")):
            continue
        missing = [k for k in needs[role] if k not in usable]
        why = "; ".join(f"{k}: {reasons.get(k) or 'not usable'}" for k in missing)
        out.append({"config": variant or "config.pbtxt", "needs": list(needs[role]) or ["cpu"],
                    "loads": not missing, "why_not": why})
    return out


def run(args: argparse.Namespace) -> int:
    rows = probe_devices()
    usable = {r.kind for r in rows if r.available}
    repository = (args.repository or default_repository()).resolve()
    name, why = choose_config_name(repository, args.role, usable)
    choice, cpu = compute_dtype_choice()
    phases = {model: compute_dtype_choice(phase=phase)[0] for model, phase in PHASE_OF.items()}
    envs = environments()
    smi = smi_snapshot()
    configs = config_rows(repository, args.role, usable, {r.kind: r.reason for r in rows})
    if args.json:
        for r in rows:
            print(json.dumps({"kind": r.kind, "available": r.available, "cards": list(r.cards),
                              "reason": r.reason}))
        for e in envs:
            print(json.dumps({"environment": e["env"], **{k: v for k, v in e.items() if k != "env"}}))
        print(json.dumps({"furiosa_smi": smi}))
        for c in configs:
            print(json.dumps(c))
        print(json.dumps({"config_name": name, "why": why, "role": args.role,
                          "compute_dtype": choice.dtype, "compute_dtype_requested": choice.requested,
                          "compute_dtype_why": choice.reason, "cpu": cpu.model, "cpu_arch": cpu.arch,
                          "cpu_native_bf16": cpu.native_bf16,
                          "compute_dtype_by_model": {m: {"dtype": c.dtype, "why": c.reason}
                                                     for m, c in phases.items()}}))
        return 0
    print(f"{'kind':6} {'usable':7} {'cards':24} why not")
    for r in rows:
        cards = ", ".join(r.cards) or "-"
        print(f"{r.kind:6} {'yes' if r.available else 'no':7} {cards:24} {r.reason}")
    print("\nenvironments:")
    for e in envs:
        found = ", ".join(f"{k} {v}" for k, v in e["packages"].items()) or "-"
        print(f"  {e['env']:14} for {e['for']}: {found}" + (f" ({e['problem']})" if e.get("problem") else ""))
    print("\n" + "\n".join(smi_lines(smi)))
    print(f"\nmodel configs for --role {args.role}:")
    for c in configs:
        state = "loads" if c["loads"] else "cannot load"
        why_not = f": {c['why_not']}" if c["why_not"] else ""
        print(f"  {c['config']:13} needs {', '.join(c['needs']):10} {state}{why_not}")
    print(f"\nserve --role {args.role} would use: {name or 'config.pbtxt'} ({why})")
    print(f"compute dtype by CPU flags: {choice.dtype} ({choice.reason}; "
          f"CPU: {cpu.model or cpu.arch or 'unknown'})")
    print("compute dtype the models use (auto: measured per phase on this host, cached):")
    for model, c in phases.items():
        print(f"  {model:10} {c.dtype:5} {c.reason}")
    return 0
