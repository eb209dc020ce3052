"""Vendor NPU adapters: FuriosaAI RNGD and Rebellions ATOM.

ATOM's SDK is imported only here, lazily, with an install hint; RNGD's lives in `.venv-rngd`
(rngd_pd/devices/rngd/runtime.py says why) and is looked for there. No SDK or card exists on development
machines; the adapters are written against the vendors' public packages and verified where the
hardware is. What they do here: check the SDK, find the cards, resolve the allocated one.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass

from rngd_pd.config.env import RNGD_PD_DEV_ROOT
from rngd_pd.devices.allocation import resolve_ordinal, visible_cards
from rngd_pd.devices.base import Device, DeviceReport, unavailable
from rngd_pd.devices.rngd.env import rngd_env, rngd_python


@dataclass(frozen=True)
class NpuKind:
    """How one vendor's cards are found and addressed."""

    kind: str
    label: str              # human name
    sdk_module: str         # imported lazily to prove the SDK is there
    install_hint: str
    card_glob: str          # device nodes, one per card
    resource: str           # Kubernetes extended resource of the device plugin


RNGD = NpuKind("rngd", "FuriosaAI RNGD", "furiosa.torch",
               "install the RNGD driver, then run `make rngd-env` (furiosa-torch in its own .venv-rngd)",
               "/dev/rngd/npu[0-9]*", "furiosa.ai/rngd")
ATOM = NpuKind("atom", "Rebellions ATOM", "rebel",
               "install the Rebellions SDK (rebel-compiler and the RBLN driver/runtime)",
               "/dev/rbln[0-9]*", "rebellions.ai/ATOM")
NPUS: dict[str, NpuKind] = {RNGD.kind: RNGD, ATOM.kind: ATOM}


def sdk_missing(npu: NpuKind, env: Mapping[str, str] | None = None) -> str | None:
    """Why the SDK cannot be used, or None when it can. RNGD's lives in its own environment
    (furiosa-torch pins torch 2.10 and numpy 2: rngd_pd/devices/rngd/runtime.py); ATOM's is imported here."""
    if npu is RNGD:

        if rngd_python(env) is None:
            return f"the FuriosaAI RNGD SDK environment {rngd_env(env)} is missing or incomplete"
        return None
    try:
        importlib.import_module(npu.sdk_module)
    except ImportError as exc:
        return f"the {npu.label} SDK is not installed (import {npu.sdk_module}: {exc})"
    return None


def cards(npu: NpuKind, env: Mapping[str, str] | None = None) -> list[str]:
    """The visible cards of this vendor."""
    return visible_cards(npu.card_glob, RNGD_PD_DEV_ROOT.get(env))


def select_npu(npu: NpuKind, device_id: int, instance: int = 0,
               env: Mapping[str, str] | None = None) -> Device:
    """The card an instance runs on; DeviceUnavailableError naming the missing SDK or card."""
    missing = sdk_missing(npu, env)
    if missing:
        raise unavailable(missing, npu.install_hint)
    found = cards(npu, env)
    if not found:
        raise unavailable(f"no {npu.label} card is visible ({npu.card_glob})",
                          "check the driver, and the pod's device mounts / resource request")
    ordinal, how = resolve_ordinal(npu.kind, npu.resource, found, device_id, instance, env)
    return Device(npu.kind, ordinal, f"{npu.kind}:{ordinal}", how)


def report(npu: NpuKind, env: Mapping[str, str] | None = None) -> DeviceReport:
    """Is this vendor usable here: SDK importable and at least one card visible."""
    found = tuple(cards(npu, env))
    missing = sdk_missing(npu, env)
    if missing:
        return DeviceReport(npu.kind, False, found, f"{missing}; {npu.install_hint}")
    if not found:
        return DeviceReport(npu.kind, False, found, f"no {npu.label} card visible ({npu.card_glob})")
    return DeviceReport(npu.kind, True, found)
