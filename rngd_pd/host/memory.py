"""This process's memory: the host's, capped by its memory cgroup (a Kubernetes pod's limit).

In a pod with an 8 GiB limit on a 256 GiB node, /proc/meminfo's MemAvailable says ~200 GiB, and a KV
cache sized from it is OOM-killed. So what is free is the smaller of MemAvailable and the cgroup's
limit less its working set, which is usage less inactive file pages: the page cache the kernel
reclaims before it kills (the kubelet's `container_memory_working_set_bytes`). cgroup v2 (`memory.max`,
`memory.current`, `memory.stat`'s `inactive_file`) and v1 (`memory.limit_in_bytes`,
`memory.usage_in_bytes`, `total_inactive_file`); every cgroup from this process's up to the mount's
root is read and the tightest wins, as the kernel enforces each of them.

Stdlib only.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
UNLIMITED = 1 << 60  # v1 writes "no limit" as a page-rounded 2**63-1


@dataclass(frozen=True)
class Memory:
    """Bytes: the total this process may use and what of it is free now; `limit` names the cgroup that
    set them (empty: the host's /proc/meminfo)."""

    total: int
    free: int
    limit: str = ""


def _read_int(path: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        text = path.read_text().strip()
        return UNLIMITED if text == "max" else int(text)
    return None


def _stat(path: Path, key: str) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    return 0


def _cgroup_dirs(proc_cgroup: str, root: Path) -> list[tuple[Path, str, str, str]]:
    """(directory, limit file, usage file, inactive-file key) of each memory cgroup from this
    process's up to the root, for whichever hierarchy (v2 unified, v1 memory) /proc/self/cgroup names."""
    found: list[tuple[Path, str, str, str]] = []
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "":  # v2
            base, files = root, ("memory.max", "memory.current", "inactive_file")
            if not (root / "memory.max").exists() and (root / "unified").is_dir():
                base = root / "unified"
        elif "memory" in controllers.split(","):
            base, files = root / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                            "total_inactive_file")
        else:
            continue
        rel_path = Path(rel.lstrip("/"))
        for p in (rel_path, *rel_path.parents):
            d = base / p
            if (d / files[0]).exists():
                found.append((d, *files))
    return found


def process_memory(meminfo: Path = Path("/proc/meminfo"), proc_cgroup: Path = Path("/proc/self/cgroup"),
                   root: Path = CGROUP_ROOT) -> Memory:
    """MemTotal / MemAvailable, each capped by the tightest memory cgroup over this process."""
    fields: dict[str, int] = {}
    with contextlib.suppress(OSError, ValueError), meminfo.open() as f:
        for line in f:
            name, _, rest = line.partition(":")
            fields[name] = int(rest.split()[0]) * 1024
    total = fields.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    best = Memory(total, fields.get("MemAvailable", 0))
    text = ""
    with contextlib.suppress(OSError):
        text = proc_cgroup.read_text()
    for d, limit_file, usage_file, inactive_key in _cgroup_dirs(text, root):
        limit = _read_int(d / limit_file)
        usage = _read_int(d / usage_file)
        if limit is None or limit >= UNLIMITED or usage is None:
            continue
        working_set = max(0, usage - _stat(d / "memory.stat", inactive_key))
        free = max(0, limit - working_set)
        if free < best.free or limit < best.total:
            best = Memory(min(best.total, limit), min(best.free, free), str(d))
    return best
