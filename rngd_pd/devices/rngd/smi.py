"""RNGD cards as furiosa-smi sees them: discovery, driver, power, temperature, memory.

Runs INSIDE `.venv-rngd` (furiosa-smi 2026.4.0 is installed there by `make rngd-env`, beside
furiosa-torch); the serving environment reaches it through `rngd_pd.devices.rngd.runtime.smi_snapshot`, a
subprocess, and the card worker (`rngd.graphs --serve`) calls `memory` in-process:

    .venv-rngd/bin/python -m rngd_pd.devices.rngd.smi      # one JSON object

{"sdk": {"furiosa-smi": ...}, "driver": "x.y.z" | null, "devices": [{"index", "name", "uuid",
"serial", "arch", "firmware", "power_w", "power_limit_w", "temperature_c": {"soc_peak", "ambient"},
"memory": {"total_bytes", "in_use_bytes"}, "liveness", "cores", "errors": {field: why}}], "error":
why the listing failed, or ""}. Each field is read on its own: one the driver does not answer is
null with its reason under "errors", the others still come. Without a card (this host): "devices"
is [] and "driver" null ("device not found: no available device to read driver version").
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from importlib import metadata
from typing import Any

FIELDS: dict[str, Callable[[Any], Any]] = {
    "name": lambda d: d.device_name(),
    "uuid": lambda d: d.uuid(),
    "serial": lambda d: d.serial(),
    "arch": lambda d: str(d.arch()),
    "firmware": lambda d: str(d.firmware_version()),
    "power_w": lambda d: float(d.power_consumption()),
    "power_limit_w": lambda d: float(d.power_limit()),
    "temperature_c": lambda d: {"soc_peak": float(d.device_temperature().soc_peak()),
                                "ambient": float(d.device_temperature().ambient())},
    "memory": lambda d: memory_of(d),
    "liveness": lambda d: bool(d.liveness()),
    "cores": lambda d: int(d.core_num()),
}


def memory_of(device: Any) -> dict[str, int]:
    """furiosa-smi 2026.4's MemoryInfo (methods, like every getter of its Device)."""
    usage = device.memory_usage()
    return {"total_bytes": int(usage.total_bytes()), "in_use_bytes": int(usage.in_use_bytes())}


def describe(device: Any) -> dict[str, Any]:
    """One card's fields; a field the driver does not answer is None, its reason under "errors"."""
    out: dict[str, Any] = {"index": None, "errors": {}}
    try:
        out["index"] = int(device.dev_node_index())
    except Exception as exc:  # reported, not fatal: the other fields may still come
        out["errors"]["index"] = f"{type(exc).__name__}: {exc}"
    for name, read in FIELDS.items():
        try:
            out[name] = read(device)
        except Exception as exc:
            out[name] = None
            out["errors"][name] = f"{type(exc).__name__}: {exc}"
    return out


def snapshot() -> dict[str, Any]:
    """What furiosa-smi reports of this host's cards (never raises: failures are in the result)."""
    out: dict[str, Any] = {"sdk": {}, "driver": None, "driver_error": "", "devices": [], "error": ""}
    try:
        out["sdk"]["furiosa-smi"] = metadata.version("furiosa-smi")
        import furiosa_smi
    except Exception as exc:
        out["error"] = f"furiosa-smi is not usable: {type(exc).__name__}: {exc}; run `make rngd-env`"
        return out
    try:
        out["driver"] = str(furiosa_smi.driver_info())
    except Exception as exc:
        out["driver_error"] = f"{type(exc).__name__}: {exc}"
    try:
        out["devices"] = [describe(d) for d in furiosa_smi.list_devices()]
    except Exception as exc:
        out["error"] = f"list_devices: {type(exc).__name__}: {exc}"
    return out


def memory(index: int) -> dict[str, int]:
    """(total, in use) bytes of card `index` (its device node index), for the card worker."""
    import furiosa_smi

    for device in furiosa_smi.list_devices():
        if int(device.dev_node_index()) == index:
            return memory_of(device)
    raise LookupError(f"furiosa-smi lists no RNGD card with index {index}")


if __name__ == "__main__":
    print(json.dumps(snapshot()))
    sys.exit(0)
