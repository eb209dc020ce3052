"""shm transport specifics: permissions, key names, visibility, capacity, slot reuse, sweeping."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from rngd_pd.errors import TransportCapacityError, TransportIntegrityError, TransportTimeoutError
from rngd_pd.kv.shm import pool as shmpool
from rngd_pd.kv.shm import transport as shm
from rngd_pd.kv.shm.transport import ShmTransport, linked_bytes, safe_name


@pytest.fixture
def root(tmp_path):
    base = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    path = os.path.join(base, f"rngd_kv_test_{os.getpid()}_{time.monotonic_ns()}")
    yield path
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_dirs_0700_files_0600(root):
    with ShmTransport(root=root) as t:
        t.push("req-1", 0, b"abc")
        blob = os.path.join(root, "keys", "req-1", "0")
        assert mode(root) == mode(os.path.join(root, "keys", "req-1")) == 0o700
        assert mode(blob) == 0o600
        assert all(mode(os.path.join(p, f)) == 0o600 for p, _, fs in os.walk(os.path.join(root, "pool"))
                   for f in fs)


def test_env_root(monkeypatch, root):
    monkeypatch.setenv("PD_SHM_ROOT", root)
    with ShmTransport() as t:
        assert t.root == root


@pytest.mark.parametrize("key", ["../../etc/passwd", "/abs", "a/b", ".hidden", "..", "", "x" * 300,
                                 "é-unicode", "nul\0byte"])
def test_keys_never_escape_the_root(root, key):
    name = safe_name(key)
    assert "/" not in name and not name.startswith(".") and 0 < len(name) <= 128
    with ShmTransport(root=root) as t:
        t.push(key, 3, b"payload")
        out = bytearray(7)
        assert t.pull(key, 3, out, 1.0) == 7 and out == b"payload"
        assert os.listdir(os.path.join(root, "keys")) == [name]
        t.release(key)
        assert os.listdir(os.path.join(root, "keys")) == []


def test_plain_keys_keep_their_name_and_distinct_keys_differ():
    assert safe_name("req-12_a.b") == "req-12_a.b"
    assert safe_name("a/b") != safe_name("a_b") and safe_name("a/b") != safe_name("a\\b")


def test_a_blob_gets_its_name_only_once_complete(root, monkeypatch):
    seen = []
    real_link = os.link
    data = np.arange(1000, dtype=np.uint16).view(np.uint8)

    def spy(src, dst):  # what a reader could open the instant the name appears
        with open(src, "rb") as f:
            seen.append((os.path.basename(dst), f.read()))
        real_link(src, dst)

    monkeypatch.setattr(shm.os, "link", spy)
    with ShmTransport(root=root) as t:
        t.push("k", 5, data)
        out = np.zeros_like(data)
        assert t.pull("k", 5, out, 1.0) == data.size and np.array_equal(out, data)
    name, content = seen[0]
    assert name == "5" and content[:data.size] == data.tobytes()
    magic, _, has_crc, _, _, size = shm.TRAILER.unpack(content[data.size:])
    assert (magic, has_crc, size) == (shm.MAGIC, 1, data.size)  # the trailer is written before the link


def test_pushing_a_blob_again_replaces_it_atomically(root, monkeypatch):
    renames = []
    real_rename = os.rename

    def spy(src, dst):
        renames.append(os.path.basename(src))
        real_rename(src, dst)

    monkeypatch.setattr(shm.os, "rename", spy)
    with ShmTransport(root=root) as t:
        t.push("k", 0, b"first")
        t.push("k", 0, b"again")
        out = bytearray(5)
        assert t.pull("k", 0, out, 1.0) == 5 and bytes(out) == b"again"
        assert t.stored_blobs("k") == 1
    assert len(renames) == 1 and renames[0].startswith(".0.")  # a hidden temp name, renamed over


def test_enospc_is_a_capacity_error_leaving_nothing(root, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    with ShmTransport(root=root) as t:
        monkeypatch.setattr(shmpool.os, "posix_fallocate", full)
        with pytest.raises(TransportCapacityError, match="/dev/shm is full"):
            t.push("k", 0, b"x" * 4096)
        pool_dir = t._pool.dir
        assert sorted(os.listdir(pool_dir)) == ["lock"]  # no half-made slot
        assert t.stored_blobs("k") == 0


def test_slots_are_reused_after_release(root):
    data = np.random.default_rng(0).integers(0, 256, (4, 65536), np.uint8)
    with ShmTransport(root=root) as t:
        for rep in range(3):
            for i in range(4):
                t.push(f"r{rep}", i, data[i])
            out = np.empty(65536, np.uint8)
            for i in range(4):
                t.pull(f"r{rep}", i, out, 1.0)
                assert np.array_equal(out, data[i])
            t.release(f"r{rep}")
        assert t._pool.count == 4  # three requests, four slot files in all
        assert t.held_bytes()[0] == 0 and linked_bytes(root) == 0


def test_idle_slots_of_another_size_make_room_for_the_size_in_use(root):
    """With the idle pool full of small slots, larger blobs still get reused slots (a pool that kept
    only the old size would create, fault and destroy a slot file per blob)."""
    small, big = 65536, 4 * 65536
    trailer = shm.TRAILER.size
    with ShmTransport(root=root, pool_mb=1) as t:  # 1 MiB of idle slots
        for i in range(16):
            t.push("small", i, bytes(small))
        t.release("small")
        t.held_bytes()  # reclaims released slots into the idle pool
        pool = t._pool
        assert len(pool.idle[small + trailer]) >= 8
        counts = []
        for rep in range(4):
            for i in range(3):
                t.push(f"big{rep}", i, bytes(big))
            t.release(f"big{rep}")
            t.held_bytes()
            counts.append(pool.count)
        assert counts[1:] == counts[:1] * 3, f"big blobs kept getting fresh slot files: {counts}"
        assert pool.idle_bytes <= 1 << 20


def test_trailer_checksum_catches_a_flipped_byte(root):
    with ShmTransport(root=root) as t:
        t.push("k", 0, b"\x01" * 1000)
        with open(os.path.join(root, "keys", "k", "0"), "r+b") as f:
            f.seek(500)
            f.write(b"\x02")
        with pytest.raises(TransportIntegrityError, match="xxh3 mismatch"):
            t.pull("k", 0, bytearray(1000), 1.0)


def test_pull_timeout_is_bounded(root):
    with ShmTransport(root=root) as t:
        t0 = time.monotonic()
        with pytest.raises(TransportTimeoutError, match=r"did not appear within 0\.3 s"):
            t.pull("never", 0, bytearray(8), 0.3)
        assert 0.29 <= time.monotonic() - t0 < 1.0


def test_ttl_sweep_removes_old_keys(root):
    with ShmTransport(root=root, ttl_s=0.2) as t:
        t.push("old", 0, b"x")
        time.sleep(0.3)
        t.push("new", 0, b"y")
        t.sweep()
        assert t.stored_blobs("old") == 0 and t.stored_blobs("new") == 1


def test_dead_writer_pool_is_swept_but_its_blobs_stay_readable(root):
    code = (f"from rngd_pd.kv.shm.transport import ShmTransport; t = ShmTransport(root={root!r}); "
            "t.push('k', 0, b'survives'); import os; os._exit(0)")
    subprocess.run([sys.executable, "-c", code], check=True)
    pools = os.listdir(os.path.join(root, "pool"))
    assert len(pools) == 1
    with ShmTransport(root=root) as t:
        t.sweep()
        assert os.listdir(os.path.join(root, "pool")) == []  # the dead writer's pool is gone
        out = bytearray(8)
        assert t.pull("k", 0, out, 1.0) == 8 and out == b"survives"
        assert linked_bytes(root) > 0
        t.release("k")
        assert linked_bytes(root) == 0


def test_close_removes_the_pool(root):
    t = ShmTransport(root=root)
    t.push("k", 0, b"x" * 10)
    t.release("k")
    t.close()
    t.close()
    assert os.listdir(os.path.join(root, "pool")) == []


def test_reader_mappings_of_dead_slots_are_dropped(root, monkeypatch):
    monkeypatch.setattr(shmpool.MapCache, "PRUNE_EVERY_S", 0.0)
    with ShmTransport(root=root) as reader:
        writer = ShmTransport(root=root)
        writer.push("k", 0, b"x" * 4096)
        reader.pull("k", 0, bytearray(4096), 1.0)
        assert len(reader._maps.maps) == 1
        reader.release("k")
        writer.close()  # its slot files lose their last name
        writer2 = ShmTransport(root=root)
        writer2.push("k2", 0, b"y")
        reader.pull("k2", 0, bytearray(1), 1.0)  # a new mapping triggers the prune
        assert len(reader._maps.maps) == 1 and reader._maps.total == 1 + shm.TRAILER.size
        writer2.close()


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_a_slot_and_a_mapping_cost_one_and_two_files_and_are_given_back_when_idle(root):
    with ShmTransport(root=root) as writer, ShmTransport(root=root) as reader:
        writer.push("warm", 0, b"w")  # the pool's lock file and its keeper thread exist from here
        reader.pull("warm", 0, bytearray(1), 1.0)
        base = open_files()
        for i in range(20):
            writer.push("k", i, bytes([i]) * (1000 + i))  # 20 sizes: 20 slots
        assert open_files() - base == 20  # the mapping's own descriptor only
        for i in range(20):
            reader.pull("k", i, bytearray(1000 + i), 1.0)
        assert open_files() - base == 20 + 40
        reader.release("k")
        writer.housekeep()
        assert writer._pool.idle_count == 20  # freed, kept for reuse for now
        writer._pool.trim(idle_s=0.0)
        reader._maps.idle_s = 0.0
        reader.housekeep()
        assert writer._pool.idle_count == 0 and len(reader._maps) == 0
        assert open_files() - base <= 0


def test_idle_slots_are_capped_by_count_as_well_as_bytes(root):
    with ShmTransport(root=root) as t:
        t._writer_pool().max_idle_slots = 5
        for i in range(12):
            t.push("k", i, b"x" * 100)
        t.release("k")
        t.push("k2", 0, b"x" * 100)  # reclaims the freed slots: at most 5 stay idle
        assert t._pool.idle_count <= 5
        assert len([n for n in os.listdir(t._pool.dir) if n != "lock"]) <= 6


def test_the_keeper_trims_without_any_request(root, monkeypatch):
    monkeypatch.setattr(shmpool.MapCache, "PRUNE_EVERY_S", 0.05)
    with ShmTransport(root=root) as t:
        t._writer_pool().idle_s = 0.0
        t.push("k", 0, b"x" * 100)
        t.release("k")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and [n for n in os.listdir(t._pool.dir) if n != "lock"]:
            time.sleep(0.05)
        assert [n for n in os.listdir(t._pool.dir) if n != "lock"] == []
    assert not any(th.name == "shm-keeper" for th in threading.enumerate())


def test_out_of_files_is_a_capacity_error_naming_ulimit(root):
    """In a child whose hard limit is 64 files, blobs in flight run out of descriptors."""
    code = f"""
import resource
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
from rngd_pd.errors import TransportCapacityError
from rngd_pd.kv.shm.transport import ShmTransport
t = ShmTransport(root={root!r})
try:
    for i in range(200):
        t.push("k", i, b"x" * 100)
except TransportCapacityError as e:
    print("CAPACITY", i, e)
t.close()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "CAPACITY" in out.stdout and "ulimit -n" in out.stdout, out.stdout


def test_the_soft_file_limit_is_raised_towards_the_hard_one():
    code = """
import resource
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 4096))
from rngd_pd.kv.shm.pool import raise_fd_limit
print(raise_fd_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["4096", "4096"]
