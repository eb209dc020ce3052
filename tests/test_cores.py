"""Idle cores lent between instances (rngd_pd.devices.cores): the board, the rule, its failure modes.

Two CoreShares in one process are two records, i.e. two instances, as two stubs would be.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from rngd_pd.devices.cores import RECORD, RECORDS, CoreShare, host_cores


def share(board: Path, n: int = 1, cores: int = 4, **kw) -> tuple[CoreShare, list[int]]:
    applied: list[int] = []
    return CoreShare(n, applied.append, cores=cores, board=board, **kw), applied


def test_a_lone_instance_uses_every_core_and_a_busy_peer_keeps_its_share(tmp_path: Path) -> None:
    board = tmp_path / "board"
    prefill, set_prefill = share(board, 1, grace_s=0.05)
    decode, _ = share(board, 2, grace_s=0.05)
    assert prefill.enabled and decode.enabled
    prefill.bind()
    decode.bind()
    with prefill.working():
        assert set_prefill == [4]  # decode idle: all 4 cores
        with decode.working():
            assert prefill.fit() == 1 and set_prefill == [4, 1]  # 4 cores split 1:2
            assert decode.fit() == 2
        assert prefill.fit() == 1  # decode finished a moment ago: still counted (grace)
        time.sleep(0.1)
        assert prefill.fit() == 4 and set_prefill == [4, 1, 4]
    prefill.close()
    decode.close()
    assert not np.frombuffer(board.read_bytes(), dtype=RECORD)["pid"].any()


def test_only_the_bound_thread_computes_on_lent_cores(tmp_path: Path) -> None:
    """decode's scheduler (bound) and a local prefill on a loader thread: the loader always computes
    on the share (no second OpenMP team), and while it works the scheduler does too."""
    cores, applied = share(tmp_path / "board", 1, cores=2)
    cores.bind()  # this thread is the scheduler
    inside, leave = threading.Event(), threading.Event()
    got: list[int] = []

    def local_prefill() -> None:
        with cores.working():
            got.append(cores.fit())  # never more than the share off the bound thread
            inside.set()
            leave.wait(5)

    with cores.working():
        assert cores.fit() == 2
    t = threading.Thread(target=local_prefill)
    t.start()
    assert inside.wait(5)
    with cores.working():
        assert cores.fit() == 1  # the loader thread's unit holds the other core
    leave.set()
    t.join(5)
    assert got == [1] and applied == [2, 1, 1]
    with cores.working():
        assert cores.fit() == 2


def test_busy_instances_split_a_big_host_instead_of_keeping_their_small_shares(tmp_path: Path) -> None:
    board = tmp_path / "board"
    prefill, _ = share(board, 1, cores=64)
    decode, _ = share(board, 1, cores=64)
    prefill.bind()
    decode.bind()
    with prefill.working(), decode.working():
        assert prefill.fit() == 32 and decode.fit() == 32


def test_without_lending_an_instance_keeps_its_share_but_still_counts(tmp_path: Path) -> None:
    board = tmp_path / "board"
    fixed, applied = share(board, 1, lend=False)
    other, _ = share(board, 1)
    fixed.bind()
    with fixed.working():
        assert applied == [1]
        assert other.threads_now() == 2  # 4 cores split 1:1 while the fixed one works


def test_a_dead_peers_record_is_ignored_and_reused(tmp_path: Path) -> None:
    board = tmp_path / "board"
    first, _ = share(board, 3)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead = int(gone.stdout)
    records = np.memmap(board, dtype=RECORD, mode="r+")
    records[5] = (dead, 3, 1, time.monotonic())  # died while computing
    records.flush()
    first._checked = 0.0  # look for dead peers now
    assert first.threads_now() == 4
    for _ in range(RECORDS - 1):
        share(board)  # fills every free record, then the dead one's
    records = np.memmap(board, dtype=RECORD, mode="r")
    assert dead not in set(records["pid"].tolist())
    late, _ = share(board)
    assert not late.enabled and late.threads_now() == 1  # a full board lends nothing to newcomers


@pytest.mark.parametrize("problem", ["missing directory", "another version"])
def test_a_board_that_cannot_be_used_turns_lending_off(tmp_path: Path, problem: str) -> None:
    board = tmp_path / "no" / "board" if problem == "missing directory" else tmp_path / "board"
    if problem == "another version":
        board.write_bytes(b"\0" * 100)
    cores, applied = share(board, 2)
    assert not cores.enabled
    with cores.working():
        assert applied == [2]


def test_host_cores_is_what_this_process_may_run_on() -> None:
    import os

    assert 1 <= host_cores() <= len(os.sched_getaffinity(0))


def test_the_runtime_lends_only_where_the_bits_stay_the_same(tmp_path: Path, monkeypatch) -> None:
    from rngd_pd.devices import cores as cores_module
    from rngd_pd.devices.torch_runtime import as_runtime
    from rngd_pd.model import load_model

    monkeypatch.setattr(cores_module, "BOARD", tmp_path / "board")
    monkeypatch.setattr(cores_module, "host_cores", lambda: 2)
    torch.set_num_threads(1)
    runtime = as_runtime(load_model(dtype=torch.float32, progress=False))
    try:
        said = runtime.share_cores("both")
        if runtime.cores.lend:
            assert said.startswith("1 threads, up to 2")
        else:  # this CPU gives other bits on 2 threads (an AMX-BF16 Xeon): keep the share, say why
            assert said.startswith("1 threads always: ") and len(said) > len("1 threads always: ")
        runtime.compute_thread()
        ids = runtime.tokens(list(range(3, 40)))
        alone, kv = runtime.prefill(ids)  # on 2 threads: nothing else is computing
        torch.set_num_threads(1)
        from rngd_pd.model.llama import Llama

        ref, ref_kv = Llama.prefill(runtime.loaded.model, ids)
        assert torch.equal(alone, ref)
        assert all(torch.equal(a[0], b[0]) for a, b in zip(kv, ref_kv, strict=True))
    finally:
        torch.set_num_threads(1)
        if runtime.cores is not None:
            runtime.cores.close()


def test_a_lent_thread_count_reaches_mkl_too() -> None:
    """MKL runs fp32 prefill's GEMMs and keeps its own count, which torch.set_num_threads sets on the
    calling thread: the lender's count must reach MKL too, read back by MKL's own getter."""
    code = """
import ctypes, os, threading, torch
from rngd_pd.devices.torch_runtime import _OpenMP, _mkl_local_setter
lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
if not torch.backends.mkl.is_available():
    assert _mkl_local_setter(lib) is None
    print("no mkl")
    raise SystemExit
get = ctypes.CDLL(lib).MKL_Get_Max_Threads
seen = {}
def lender():  # as a stub's execute thread: torch_threads applied on it at load, then lent a core
    torch.set_num_threads(1)
    _OpenMP().set_threads(2)
    seen["lender"] = get()
    _OpenMP().set_threads(1)
    seen["back"] = get()
torch.set_num_threads(1)
t = threading.Thread(target=lender); t.start(); t.join()
seen["other"] = get()
print(seen)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True, cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    if torch.backends.mkl.is_available():
        assert out == "{'lender': 2, 'back': 1, 'other': 1}"
    else:
        assert out == "no mkl"
