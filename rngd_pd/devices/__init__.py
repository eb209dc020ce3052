"""Where a model instance runs: cpu and cuda through torch, rngd (FuriosaAI) and atom (Rebellions).

    device = select_device(params.device, params.device_id_for(instance), instance=instance)

A kind whose SDK or card is missing raises DeviceUnavailableError naming what is missing and
pointing at the cpu configuration. `device_id -1` means the card the device plugin allocated.
"""

from __future__ import annotations

from collections.abc import Mapping

from rngd_pd.devices.base import CPU_HINT, Device, DeviceReport, unavailable
from rngd_pd.devices.npu import ATOM, NPUS, RNGD, report, select_npu

KINDS = ("cpu", "cuda", "rngd", "atom")

__all__ = ["ATOM", "CPU_HINT", "KINDS", "RNGD", "Device", "DeviceReport", "probe_devices", "select_device"]


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _select_cuda(device_id: int) -> Device:
    count = _cuda_count()
    if count == 0:
        raise unavailable("no CUDA device is available to torch (torch.cuda.is_available() is False)",
                          "install a CUDA build of torch and the NVIDIA driver")
    index = 0 if device_id == -1 else device_id
    if not 0 <= index < count:
        raise unavailable(f"cuda device id {device_id} is out of range ({count} visible)",
                          "use -1 or an ordinal below the count")
    how = "the first visible GPU (CUDA_VISIBLE_DEVICES holds the allocation)" if device_id == -1 else ""
    return Device("cuda", index, f"cuda:{index}", how or f"device id {index}")


def select_device(kind: str, device_id: int = -1, *, instance: int = 0,
                  env: Mapping[str, str] | None = None) -> Device:
    """The device of one instance; DeviceUnavailableError when its SDK or card is missing."""
    if kind == "cpu":
        return Device("cpu", 0, "cpu", "host CPU")
    if kind == "cuda":
        return _select_cuda(device_id)
    if kind in NPUS:
        return select_npu(NPUS[kind], device_id, instance, env)
    raise unavailable(f"unknown device kind {kind!r} (known: {', '.join(KINDS)})", "fix the device parameter")


def probe_devices(env: Mapping[str, str] | None = None) -> list[DeviceReport]:
    """One report per kind: usable here or not, the cards, and why not."""
    rows = [DeviceReport("cpu", True, ("cpu",))]
    try:
        count = _cuda_count()
        rows.append(DeviceReport("cuda", count > 0, tuple(f"cuda:{i}" for i in range(count)),
                                 "" if count else "torch sees no CUDA device"))
    except ImportError as exc:
        rows.append(DeviceReport("cuda", False, (), f"torch is not importable: {exc}"))
    rows += [report(RNGD, env), report(ATOM, env)]
    return rows
