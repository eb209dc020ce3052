"""Power readers for bench/kpi.py: RAPL energy counters (CPU), furiosa-smi (RNGD), rbln-stat (ATOM).

Each meter is started before a run and stopped after it; stop() returns the mean watts summed over the
cards it covers, or a reading whose note says why nothing could be read. Nothing is estimated: a card
without a readable sensor makes the whole sum unreadable rather than silently smaller.
The NPU parsers follow the tools' documented output and are verified only where the cards are.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

POWERCAP = Path("/sys/class/powercap")


@dataclass(frozen=True)
class PowerReading:
    """Mean watts over a run (None when unreadable), energy in joules, and where it came from."""

    watts: float | None
    joules: float | None
    seconds: float
    note: str


class Meter(Protocol):
    def start(self) -> None:
        """Begin measuring (called right before the load starts)."""

    def stop(self) -> PowerReading:
        """Stop and return the reading over the interval since start()."""


class Unreadable:
    """A meter for cards without a readable sensor; says why."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self._t0 = 0.0

    def start(self) -> None:
        self._t0 = time.monotonic()

    def stop(self) -> PowerReading:
        return PowerReading(None, None, time.monotonic() - self._t0, f"not readable: {self.reason}")


class RaplMeter:
    """CPU package energy from /sys/class/powercap/intel-rapl:N/energy_uj (AMD uses the same driver)."""

    def __init__(self, domains: Sequence[Path]) -> None:
        self.domains = list(domains)
        self._start: list[int] = []
        self._t0 = 0.0

    @staticmethod
    def _read(p: Path) -> int:
        return int((p / "energy_uj").read_text())

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._start = [self._read(d) for d in self.domains]

    def stop(self) -> PowerReading:
        dt = time.monotonic() - self._t0
        joules = 0.0
        for d, e0 in zip(self.domains, self._start, strict=True):
            e1 = self._read(d)
            if e1 < e0:  # the counter wrapped
                e1 += int((d / "max_energy_range_uj").read_text())
            joules += (e1 - e0) / 1e6
        names = ",".join(d.name for d in self.domains)
        return PowerReading(joules / dt if dt > 0 else None, joules, dt, f"RAPL {names}")


def rapl_domains(indices: Sequence[int], root: Path = POWERCAP) -> tuple[list[Path], str]:
    """The package domains for CPU sockets `indices`, or ([], why they cannot be read)."""
    found = []
    for i in indices:
        d = root / f"intel-rapl:{i}"
        try:
            int((d / "energy_uj").read_text())
        except FileNotFoundError:
            return [], f"{d}/energy_uj does not exist (no RAPL powercap driver in this kernel/container)"
        except (PermissionError, OSError, ValueError) as e:
            return [], f"{d}/energy_uj cannot be read ({e.__class__.__name__}: {e})"
        found.append(d)
    return found, ""


_WATTS = re.compile(r"(\d+(?:\.\d+)?)\s*W\b")


def parse_furiosa_smi(text: str) -> dict[int, float]:
    """Watts per npu index from `furiosa-smi info`'s table (rows `| rngd | npu0 | ... | 38.40 W | ...`)."""
    out: dict[int, float] = {}
    for line in text.splitlines():
        m = re.search(r"\|\s*npu(\d+)\s*\|", line)
        w = _WATTS.search(line)
        if m and w:
            out[int(m.group(1))] = float(w.group(1))
    return out


def _walk_power(obj: Any, out: dict[int, float]) -> None:
    if isinstance(obj, dict):
        idx = next((obj[k] for k in ("npu", "device", "index", "id") if k in obj), None)
        pw = next((v for k, v in obj.items()
                   if "power" in k.lower() and not isinstance(v, dict | list)), None)
        if idx is not None and pw is not None:
            m = re.search(r"\d+(?:\.\d+)?", str(pw))
            i = re.search(r"\d+", str(idx))
            if m and i:
                out[int(i.group())] = float(m.group())
        for v in obj.values():
            _walk_power(v, out)
    elif isinstance(obj, list):
        for v in obj:
            _walk_power(v, out)


def parse_rbln_stat(text: str) -> dict[int, float]:
    """Watts per device from `rbln-stat -j` (JSON) or, failing that, its table (one W value per row)."""
    out: dict[int, float] = {}
    try:
        _walk_power(json.loads(text), out)
        return out
    except json.JSONDecodeError:
        pass
    for line in text.splitlines():
        m = re.match(r"\s*\|?\s*(\d+)\s*\|.*RBLN", line)
        w = _WATTS.search(line)
        if m and w:
            out[int(m.group(1))] = float(w.group(1))
    return out


class SampledMeter:
    """Polls a vendor tool every `interval` seconds on a thread; mean watts summed over `indices`."""

    def __init__(self, argv: Sequence[str], parse: Callable[[str], dict[int, float]],
                 indices: Sequence[int], interval: float = 0.5) -> None:
        self.argv, self.parse, self.indices, self.interval = list(argv), parse, list(indices), interval
        self._samples: list[float] = []
        self._errors: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def sample(self) -> float:
        """One reading: the sum over the wanted cards; raises if a card is missing from the output."""
        text = subprocess.run(self.argv, capture_output=True, text=True, timeout=10, check=True).stdout
        watts = self.parse(text)
        missing = [i for i in self.indices if i not in watts]
        if missing:
            raise LookupError(f"{self.argv[0]} reported no power for card(s) {missing}")
        return sum(watts[i] for i in self.indices)

    def _loop(self) -> None:
        while True:  # at least one sample, even for a run shorter than the interval
            try:
                self._samples.append(self.sample())
            except (OSError, subprocess.SubprocessError, LookupError) as e:
                self._errors.append(str(e))
            if self._stop.wait(self.interval):
                return

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="power-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> PowerReading:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=15)
        dt = time.monotonic() - self._t0
        if not self._samples:
            why = self._errors[-1] if self._errors else "no sample taken"
            return PowerReading(None, None, dt, f"not readable: {why}")
        w = sum(self._samples) / len(self._samples)
        return PowerReading(w, w * dt, dt, f"{self.argv[0]} ({len(self._samples)} samples)")


class SumMeter:
    """Sums several meters (a PD configuration on RNGD + ATOM); unreadable if any part is."""

    def __init__(self, meters: Sequence[Meter]) -> None:
        self.meters = list(meters)

    def start(self) -> None:
        for m in self.meters:
            m.start()

    def stop(self) -> PowerReading:
        rs = [m.stop() for m in self.meters]
        notes = "; ".join(r.note for r in rs)
        dt = max(r.seconds for r in rs)
        if any(r.watts is None for r in rs):
            return PowerReading(None, None, dt, notes)
        w = sum(r.watts or 0.0 for r in rs)
        return PowerReading(w, w * dt, dt, notes)


def _tool_meter(tool: str, args: Sequence[str], parse: Callable[[str], dict[int, float]],
                indices: Sequence[int]) -> Meter:
    exe = shutil.which(tool)
    if exe is None:
        return Unreadable(f"{tool} is not installed (it comes with the vendor's driver packages)")
    return SampledMeter([exe, *args], parse, indices)


def open_meter(cards: Sequence[Any]) -> Meter:
    """The meter for a configuration's cards (objects with .device and .index)."""
    by_dev: dict[str, list[int]] = {}
    for c in cards:
        by_dev.setdefault(c.device, []).append(c.index)
    meters: list[Meter] = []
    for dev, idx in by_dev.items():
        if dev == "cpu":
            domains, why = rapl_domains(idx)
            meters.append(RaplMeter(domains) if domains else Unreadable(why))
        elif dev == "rngd":
            meters.append(_tool_meter("furiosa-smi", ["info"], parse_furiosa_smi, idx))
        elif dev == "atom":
            meters.append(_tool_meter("rbln-stat", ["-j"], parse_rbln_stat, idx))
        else:
            meters.append(Unreadable(f"no power reader for device {dev!r}"))
    return meters[0] if len(meters) == 1 else SumMeter(meters)
