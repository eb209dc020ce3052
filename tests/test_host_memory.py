"""rngd_pd.host.memory: the memory a process may use is capped by its memory cgroup.

The real check puts a child process into a memory cgroup the test makes (the kernel's own files and
limit); it needs to write the cgroup tree (root, or a delegated subtree), the allow-list's "no root".
The file-tree checks cover the hierarchy this host does not mount, in the formats the kernel's
cgroup-v1/memory.rst and cgroup-v2.rst give.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from rngd_pd.host.memory import CGROUP_ROOT, Memory, process_memory
from tests import skips

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20


def _meminfo(tmp: Path, total_kib: int, available_kib: int) -> Path:
    p = tmp / "meminfo"
    p.write_text(f"MemTotal:       {total_kib} kB\nMemFree:         1000 kB\n"
                 f"MemAvailable:   {available_kib} kB\n")
    return p


def test_no_cgroup_limit_is_the_hosts_meminfo(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    (root / "memory").mkdir(parents=True)
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (root / "memory" / "memory.usage_in_bytes").write_text(f"{100 * MIB}\n")
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/\n0::/\n")
    got = process_memory(_meminfo(tmp_path, 16 << 20, 12 << 20), proc, root)
    assert got == Memory(16 << 30, 12 << 30)


def test_v2_limit_less_working_set(tmp_path: Path) -> None:
    pod = tmp_path / "cg" / "kubepods.slice" / "pod1"
    pod.mkdir(parents=True)
    (pod / "memory.max").write_text(f"{8192 * MIB}\n")
    (pod / "memory.current").write_text(f"{3000 * MIB}\n")
    (pod / "memory.stat").write_text(f"anon {1500 * MIB}\nfile {1500 * MIB}\ninactive_file {1000 * MIB}\n")
    (tmp_path / "cg" / "kubepods.slice" / "memory.max").write_text("max\n")
    (tmp_path / "cg" / "kubepods.slice" / "memory.current").write_text(f"{9000 * MIB}\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/kubepods.slice/pod1\n")
    got = process_memory(_meminfo(tmp_path, 256 << 20, 200 << 20), proc, tmp_path / "cg")
    # 8192 MiB limit; working set 3000 - 1000 (inactive file pages are reclaimed before an OOM kill)
    assert (got.total, got.free) == (8192 * MIB, 6192 * MIB)
    assert got.limit.endswith("pod1")


def test_the_tightest_cgroup_on_the_path_wins(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    for rel, limit, usage in (("a", 4096, 1000), ("a/b", 8192, 500)):
        d = root / "memory" / rel
        d.mkdir(parents=True)
        (d / "memory.limit_in_bytes").write_text(f"{limit * MIB}\n")
        (d / "memory.usage_in_bytes").write_text(f"{usage * MIB}\n")
        (d / "memory.stat").write_text(f"cache 0\ntotal_inactive_file {100 * MIB}\n")
    proc = tmp_path / "cgroup"
    proc.write_text("7:memory:/a/b\n")
    got = process_memory(_meminfo(tmp_path, 64 << 20, 60 << 20), proc, root)
    assert (got.total, got.free) == (4096 * MIB, 3196 * MIB)  # the parent's limit binds the child


def test_cgroups_never_raise_what_meminfo_says_is_free(tmp_path: Path) -> None:
    d = tmp_path / "cg"
    d.mkdir()
    (d / "memory.max").write_text(f"{64 << 30}\n")  # larger than the host
    (d / "memory.current").write_text("0\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/\n")
    got = process_memory(_meminfo(tmp_path, 16 << 20, 2 << 20), proc, d)
    assert (got.total, got.free) == (16 << 30, 2 << 30)


def _own_memory_cgroup() -> Path | None:
    """The directory of this process's memory cgroup (v1 memory controller, or v2 with memory on)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, rel = line.split(":", 2)
        if "memory" in controllers.split(","):
            return CGROUP_ROOT / "memory" / rel.lstrip("/")
        if controllers == "" and (CGROUP_ROOT / rel.lstrip("/") / "cgroup.subtree_control").exists():
            d = CGROUP_ROOT / rel.lstrip("/")
            if "memory" in (d / "cgroup.subtree_control").read_text().split():
                return d
    return None


def test_a_real_cgroup_limit_caps_what_a_child_process_sees() -> None:
    parent = _own_memory_cgroup()
    if parent is None or not os.access(parent, os.W_OK):
        pytest.skip(f"{skips.NO_CGROUP} (needs root or a delegated cgroup subtree, mounted read-write)")
    child = parent / f"rngd-pd-test-{uuid.uuid4().hex[:8]}"
    limit = 768 * MIB
    child.mkdir()
    try:
        v1 = (child / "memory.limit_in_bytes").exists()
        (child / ("memory.limit_in_bytes" if v1 else "memory.max")).write_text(str(limit))
        script = (f"import json, os; open({str(child / 'cgroup.procs')!r}, 'w').write(str(os.getpid()))\n"
                  "from rngd_pd.host.memory import process_memory\n"
                  "m = process_memory(); print(json.dumps([m.total, m.free, m.limit]))")
        out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                             timeout=60, check=True)
        total, free, where = json.loads(out.stdout)
        assert total == limit
        assert 0 < free <= limit
        assert where == str(child)
    finally:
        child.rmdir()
