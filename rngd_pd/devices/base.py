"""What a selected device is, and the errors that say how to run without it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rngd_pd.errors import DeviceUnavailableError

CPU_HINT = "to run without it, serve on the CPU: `rngd-pd serve --config-name cpu` " \
           "(tritonserver --model-config-name cpu)"


def unavailable(what: str, fix: str) -> DeviceUnavailableError:
    """A DeviceUnavailableError naming what is missing, how to fix it, and how to run on cpu."""
    return DeviceUnavailableError(f"{what}; {fix}; {CPU_HINT}")


@dataclass(frozen=True)
class Device:
    """A device an instance runs on.

    kind: cpu | cuda | rngd | atom. index: ordinal among the visible cards (what the vendor runtime
    expects; 0 for cpu). name: the runtime's device string (`cuda:0`, `rngd:2`, `atom:0`).
    detail: how it was chosen, for the load log.
    """

    kind: str
    index: int
    name: str
    detail: str = ""

    @property
    def torch_device(self) -> Any:
        """torch.device for cpu/cuda; NPUs take host (cpu) tensors from torch."""
        import torch

        return torch.device(self.name if self.kind == "cuda" else "cpu")


@dataclass(frozen=True)
class DeviceReport:
    """One row of `rngd-pd devices`: is the kind usable here, which cards, and why not."""

    kind: str
    available: bool
    cards: tuple[str, ...] = ()
    reason: str = ""
