"""What the host CPU can compute natively, and the compute dtype `auto` resolves to.

bf16 compute is the fast path only where the CPU has bf16 instructions: x86-64 with AVX512-BF16 or
AMX-BF16, aarch64 with the Arm BF16 extension. Elsewhere torch emulates bf16 matmuls through fp32
conversions, and a 256-token prompt took 7.1 s to its first token in bf16 against 0.9 s in fp32 on an
AVX2-only CPU. So `choose_compute_dtype("auto")` picks bf16 only where it is native, and says why.

Features come from Linux's /proc/cpuinfo (`flags` on x86-64, `Features` on aarch64); on other systems
(macOS, Windows) nothing is read and `auto` means fp32. Every function takes the features (a
`CpuFeatures`, a set of flags, or cpuinfo text) so tests cover every kind of CPU without the hardware.
torch is imported only for the `cuda` device and for `DtypeChoice.torch_dtype`.
"""

from __future__ import annotations

import functools
import logging
import platform
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rngd_pd.config.dtypes import AUTO, COMPUTE_CHOICES, torch_dtype
from rngd_pd.devices import kernels
from rngd_pd.errors import ConfigError

CPUINFO = Path("/proc/cpuinfo")

# native bf16, in the order they are named in a reason: (flag, arch, human name)
_NATIVE_BF16 = (
    ("amx_bf16", "x86_64", "AMX-BF16"),
    ("avx512_bf16", "x86_64", "AVX512-BF16"),
    ("bf16", "aarch64", "Arm BF16"),
    ("svebf16", "aarch64", "Arm SVE BF16"),
)
# the widest vector unit an x86 CPU without native bf16 has, for the reason
_X86_SIMD = (("avx512f", "AVX-512 without BF16"), ("avx2", "AVX2 only"), ("avx", "AVX only"))


@dataclass(frozen=True)
class CpuFeatures:
    """The flags of one CPU: `arch` x86_64 | aarch64 | other, `source` where they were read."""

    arch: str
    flags: frozenset[str]
    model: str = ""
    source: str = ""

    @property
    def native_bf16(self) -> str | None:
        """Human name of the feature that computes bf16 natively (`AVX512-BF16`), or None."""
        for flag, arch, name in _NATIVE_BF16:
            if flag in self.flags and self.arch in (arch, ""):
                return name
        return None

    @property
    def simd(self) -> str:
        """What the CPU has instead (`AVX2 only`), for the reason when there is no native bf16."""
        if self.arch in ("x86_64", ""):
            for flag, name in _X86_SIMD:
                if flag in self.flags:
                    return name
        if self.arch == "aarch64":
            return "Arm without the BF16 extension"
        return "no CPU flags read" if not self.flags else f"{self.arch or 'unknown'} CPU"


@dataclass(frozen=True)
class DtypeChoice:
    """A resolved compute dtype (`bf16` | `fp32`), what was asked for, and why this one."""

    dtype: str
    reason: str
    requested: str = AUTO
    warning: bool = False  # bf16 forced on a CPU without native bf16 (the load log warns)

    @property
    def torch_dtype(self) -> Any:
        return torch_dtype(self.dtype)


def _normalize_arch(machine: str) -> str:
    machine = machine.lower()
    if machine in ("x86_64", "amd64", "x64"):
        return "x86_64"
    if machine in ("aarch64", "arm64", "armv8", "armv9"):
        return "aarch64"
    return machine


def parse_cpuinfo(text: str, arch: str | None = None) -> CpuFeatures:
    """CpuFeatures from the text of /proc/cpuinfo (x86 `flags`, aarch64 `Features`; first CPU)."""
    flags: frozenset[str] | None = None
    model, seen = "", ""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip().lower()
        if flags is None and key in ("flags", "features"):
            flags, seen = frozenset(value.split()), key
        elif not model and key in ("model name", "cpu model", "hardware"):
            model = value.strip()
    if arch is None:
        arch = {"flags": "x86_64", "features": "aarch64"}.get(seen) or _normalize_arch(platform.machine())
    return CpuFeatures(_normalize_arch(arch), flags or frozenset(), model, "cpuinfo")


@functools.lru_cache(maxsize=1)
def read_cpu_features() -> CpuFeatures:
    """This host's CPU features (Linux /proc/cpuinfo); no flags on other systems or when unreadable."""
    arch = _normalize_arch(platform.machine())
    if not sys.platform.startswith("linux"):
        return CpuFeatures(arch, frozenset(), platform.processor(), f"not read on {sys.platform}")
    try:
        text = CPUINFO.read_text(errors="replace")
    except OSError as exc:
        return CpuFeatures(arch, frozenset(), "", f"{CPUINFO} unreadable: {exc.strerror or exc}")
    features = parse_cpuinfo(text, arch)
    return CpuFeatures(features.arch, features.flags, features.model, str(CPUINFO))


def as_features(features: CpuFeatures | str | Iterable[str] | None) -> CpuFeatures:
    """CpuFeatures from what a caller has: None (this host), cpuinfo text, or a set of flags."""
    if features is None:
        return read_cpu_features()
    if isinstance(features, CpuFeatures):
        return features
    if isinstance(features, str):
        return parse_cpuinfo(features)
    return CpuFeatures("", frozenset(features), "", "flags")


def _cuda_bf16() -> tuple[bool, str]:
    import torch

    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device"
    name = torch.cuda.get_device_name()
    if torch.cuda.is_bf16_supported():
        return True, f"{name} supports bf16"
    return False, f"{name} has no bf16 support"


def choose_compute_dtype(requested: str | None, features: CpuFeatures | str | Iterable[str] | None = None,
                         *, device: str = "cpu", source: str = "--dtype", phase: str | None = None,
                         config: Any = None) -> DtypeChoice:
    """The compute dtype for `requested` (auto | bf16 | fp32; None or "" = auto) on `device`.

    bf16 and fp32 are used as given ("forced by --dtype"; `source` names where they came from).
    auto on cpu with a `phase` (prefill | decode | both) and the model's `config`: the faster of the
    two for that phase, measured on this host (rngd_pd.devices.kernels, cached). Without them, and on
    atom (whose torch graphs run on the host CPU here): bf16 where the CPU computes bf16 natively,
    else fp32. auto on cuda: bf16 where torch.cuda.is_bf16_supported(); on rngd: bf16, the card's
    dtype, whatever the host CPU (the graphs `rngd-pd compile` and CI build are bf16).
    """
    value = (requested or AUTO).strip().lower()
    if value not in COMPUTE_CHOICES:
        raise ConfigError(f"compute dtype {requested!r} is not one of {', '.join(COMPUTE_CHOICES)}")
    if value != AUTO and (value == "fp32" or device in ("cuda", "rngd")):
        return DtypeChoice(value, f"forced by {source}", value)
    if device == "rngd":  # the card computes; the host CPU's flags say nothing about it
        return DtypeChoice("bf16", "auto: an RNGD card computes in bf16 (its graphs are compiled and checked "
                                   "in bf16), whatever the host CPU")
    if device == "cuda":
        ok, why = _cuda_bf16()
        return DtypeChoice("bf16" if ok else "fp32", f"auto: {why}" if ok else f"auto: {why}; fp32")
    cpu = as_features(features)
    host = "" if device == "cpu" else f" (the {device} models' torch graphs run on the host CPU)"
    native = cpu.native_bf16
    if value != AUTO:  # bf16 forced on a CPU: say so when the CPU only emulates it
        slow = "" if native or not cpu.flags else f" (this CPU has no native bf16, {cpu.simd}: slow)"
        return DtypeChoice(value, f"forced by {source}{slow}", value, warning=bool(slow))
    if device == "cpu" and phase is not None and config is not None:
        measured = _measured_choice(phase, config, cpu)
        if measured is not None:
            return measured
    if native:
        return DtypeChoice("bf16", f"auto: this CPU has {native} (native bf16){host}")
    if not cpu.flags:
        return DtypeChoice("fp32", f"auto: CPU features unknown ({cpu.source or 'none given'}); "
                                   f"fp32, the safe choice{host}")
    cost = "~8x slower" if cpu.simd == "AVX2 only" else "emulated, several times slower than fp32"
    return DtypeChoice("fp32", f"auto: no native bf16 on this CPU ({cpu.simd}); bf16 would be {cost}{host}")


def _measured_choice(phase: str, config: Any, cpu: CpuFeatures) -> DtypeChoice | None:
    """auto by measurement (rngd_pd.devices.kernels); None when it cannot run (then the flags decide)."""
    kernels.check_phase(phase)
    try:
        times, cached = kernels.measured(config, cpu)
    except Exception as exc:  # a kernel that fails here fails in serving too; the flags still choose

        logging.getLogger(__name__).warning("could not time the kernels (%r); choosing by CPU flags", exc)
        return None
    has = cpu.native_bf16 or cpu.simd
    when = "cached measurement" if cached else "measured now"
    return DtypeChoice(times.best(phase), f"auto ({phase}, {when} on this CPU: {has}): "
                                          f"{times.describe(phase)}")
