"""e2e: prefill and decode in one tritonserver map one copy of the weights from the host's weight
store (PSS: each pays for half), serve the reference tokens through pd, and leave nothing in
/dev/shm when the server stops, when a stub was SIGKILLed before, and when the whole server was
SIGKILLed (the next start removes what it left)."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rngd_pd.host.shm_refs import HOLDERS, Root
from rngd_pd.testing import e2e as E
from tests.triton_harness import triton_server

pytestmark = pytest.mark.e2e
MODELS = ("prefill", "decode", "pd")
PD_OUT = ("output_ids", "finish_reason")


@pytest.fixture
def env() -> Iterator[dict[str, str]]:
    kv = tempfile.mkdtemp(prefix="rngd-pd-e2e-shm-", dir="/dev/shm")
    store = f"/dev/shm/rngd-pd-e2e-weights-{uuid.uuid4().hex[:8]}"
    yield {"AIRM_KV_TRANSPORT": "shm", "PD_SHM_ROOT": kv, "RNGD_PD_WEIGHT_STORE": store}
    shutil.rmtree(kv, ignore_errors=True)
    Root(store).sweep()


def _stores(root: Path) -> list[Path]:
    return [p for p in root.iterdir() if p.is_dir()] if root.exists() else []


def _store_kb(pid: int, root: Path) -> tuple[int, int]:
    """(Rss, Pss) in kB of process `pid`'s mappings of files under the store root."""
    rss = pss = 0
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        first = line.split(maxsplit=1)[0]
        if "-" in first and not first.endswith(":"):
            inside = str(root) in line
        elif inside and first in ("Rss:", "Pss:"):
            if first == "Rss:":
                rss += int(line.split()[1])
            else:
                pss += int(line.split()[1])
    return rss, pss


def _pd_tokens(server, text: str) -> list[int]:
    return E.ids_of(E.stream_infer(server.grpc_url, "pd", E.pd_inputs(E.prompt_ids(text)), PD_OUT))


def _alive(pid: int) -> bool:
    """Running (a zombie its parent has not reaped yet holds no locks and no mappings)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _wait_gone(pids: list[int], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), f"processes {pids} still run"


def test_prefill_and_decode_share_one_copy_and_it_goes_with_the_server(env) -> None:
    root = Path(env["RNGD_PD_WEIGHT_STORE"])
    with triton_server(E.subset_repository(MODELS), "cpu", env) as server:
        (store,) = _stores(root)
        assert len(list((store / HOLDERS).iterdir())) == 2  # prefill and decode hold it
        size_kb = sum(f.stat().st_size for f in (store / "t").iterdir()) >> 10
        for model in ("prefill", "decode"):
            rss, pss = _store_kb(E.stub_pid(server.proc.pid, model), root)
            assert rss >= 0.95 * size_kb, (model, rss, size_kb)  # each maps the whole model ...
            assert pss <= 0.55 * size_kb, (model, pss, size_kb)  # ... and one copy is split between them
        text = E.PROMPTS[0]
        assert _pd_tokens(server, text) == list(E.reference(text)[0])
    assert not root.exists()  # the last holder removed the store, and the root with it


@pytest.mark.long  # SIGKILLs a stub or the server: make test-long
def test_a_killed_stub_leaves_nothing_after_the_server_stops(env) -> None:
    root = Path(env["RNGD_PD_WEIGHT_STORE"])
    with triton_server(E.subset_repository(MODELS), "cpu", env) as server:
        (store,) = _stores(root)
        decode = E.stub_pid(server.proc.pid, "decode")
        os.kill(decode, signal.SIGKILL)
        _wait_gone([decode])
        assert store.is_dir()  # prefill still holds it
    assert not root.exists()


@pytest.mark.long  # SIGKILLs a stub or the server: make test-long
def test_a_killed_server_leaves_a_store_the_next_start_removes(env) -> None:
    root = Path(env["RNGD_PD_WEIGHT_STORE"])
    repo = E.subset_repository(("prefill", "decode"))
    with triton_server(repo, "cpu", env) as server:
        (store,) = _stores(root)
        stale = store.stat().st_ino
        stubs = [E.stub_pid(server.proc.pid, m) for m in ("prefill", "decode")]
        os.kill(server.proc.pid, signal.SIGKILL)  # the stubs' orphan watchers kill them (SIGKILL)
        _wait_gone(stubs)
        assert store.is_dir()  # killed, nobody released it: stale until the next start
        with triton_server(repo, "cpu", env):
            (fresh,) = _stores(root)
            assert fresh.stat().st_ino != stale  # the stale one was removed, this one built anew
            assert len(list((fresh / HOLDERS).iterdir())) == 2
    assert not root.exists()
