"""The runtime of a selected device: torch for cpu and cuda, the vendor adapter for rngd and atom.

The one place that knows every runtime, so the runtimes themselves import only the interface
(devices/runtime.py).
"""

from __future__ import annotations

from typing import Any

from rngd_pd.devices.atom import AtomRuntime
from rngd_pd.devices.base import Device, unavailable
from rngd_pd.devices.rngd.artifacts import CompileOptions
from rngd_pd.devices.rngd.runtime import RngdRuntime
from rngd_pd.devices.runtime import DeviceRuntime
from rngd_pd.devices.torch_runtime import TorchRuntime


def runtime_for(device: Device, loaded: Any, rngd: CompileOptions | None = None) -> DeviceRuntime:
    """The runtime of a selected device. cpu/cuda: torch (the weights move to the GPU); rngd/atom:
    the vendor adapter, which raises naming what it lacks. Never the CPU for a card. `rngd`: how
    an RNGD card gets its graphs (tactic search, artifact directory)."""
    if device.kind in ("cpu", "cuda"):
        return TorchRuntime(device, loaded)
    if device.kind == "rngd":
        return RngdRuntime(device, loaded, options=rngd)
    if device.kind == "atom":
        return AtomRuntime(device, loaded)
    raise unavailable(f"no runtime for device kind {device.kind!r}", "use cpu, cuda, rngd or atom")
