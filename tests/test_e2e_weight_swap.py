"""e2e: `rngd-pd swap` reloads decode as another variant (num_slots sized at load -> 16) on a running
server in explicit model-control mode, under 8 streams: pd holds new requests while running ones finish and
Triton reloads (2.51 can crash reloading a model with requests in flight, server issue #7723), no
request fails, every request's tokens are the reference's (a fresh server's: decode is
batch-invariant, so any variant gives them), the new instance maps the weights from the store instead
of reading the checkpoint, and the old one lets go of it when it unloads."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from rngd_pd.host.shm_refs import HOLDERS, Root
from rngd_pd.serve.model_control import model_config, swap
from rngd_pd.testing import e2e as E
from tests.triton_harness import triton_server

pytestmark = [pytest.mark.e2e, pytest.mark.long]
TOKENS = E.MAX_TOKENS
PROMPTS = E.PROMPTS[:3]
PD_OUT = ("output_ids", "finish_reason")
EXPLICIT = ("--model-control-mode=explicit", "--load-model=*")


def _pd(server, text: str) -> list[int]:
    return E.ids_of(E.stream_infer(server.grpc_url, "pd", E.pd_inputs(E.prompt_ids(text), TOKENS), PD_OUT))


def _one_new_stub(server_pid: int, model: str, old: int, timeout_s: float = 120.0) -> bool:
    """Whether `model` comes to have exactly one stub, not `old` (Triton unloads the old instance
    once its requests are done)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if E.stub_pid(server_pid, model) != old:
                return True
        except AssertionError:  # both, while the old one unloads
            pass
        time.sleep(0.5)
    return False


# A swap starts two stub processes one after the other (Triton's config completion, then the
# instance): on this 2-core host under other sessions' load (load average 17-47) that took 6 min.
@pytest.mark.timeout(1800)
def test_a_decode_swap_under_8_streams_fails_nothing(monkeypatch) -> None:
    monkeypatch.delenv("RNGD_PD_PARAM_NUM_SLOTS", raising=False)  # conftest's pin would beat the variant's
    refs = {t: list(E.reference(t, TOKENS)[0]) for t in PROMPTS}
    store = f"/dev/shm/rngd-pd-e2e-weights-{uuid.uuid4().hex[:8]}"
    kv = tempfile.mkdtemp(prefix="rngd-pd-e2e-shm-", dir="/dev/shm")
    env = {"AIRM_KV_TRANSPORT": "shm", "PD_SHM_ROOT": kv, "RNGD_PD_WEIGHT_STORE": store}
    try:
        with triton_server(E.subset_repository(("prefill", "decode", "pd")), "cpu", env,
                           extra_args=EXPLICIT) as server:
            old_decode = E.stub_pid(server.proc.pid, "decode")
            assert _pd(server, PROMPTS[0]) == refs[PROMPTS[0]]
            results: list[tuple[str, list[int]]] = []
            failures: list[BaseException] = []

            def client(i: int) -> None:
                try:
                    for k in range(2):
                        t = PROMPTS[(i + k) % len(PROMPTS)]
                        results.append((t, _pd(server, t)))
                except BaseException as exc:
                    failures.append(exc)

            threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
            for t in threads:
                t.start()
            time.sleep(1.0)  # streams are running
            report = swap(server.http_url, "decode", {"num_slots": "16"})
            for t in threads:
                t.join(600)
            assert not failures, failures
            assert len(results) == 16 and all(ids == refs[t] for t, ids in results)
            assert model_config(server.http_url, "decode")["parameters"]["num_slots"]["string_value"] == "16"
            assert _one_new_stub(server.proc.pid, "decode", old_decode)  # the old one unloaded
            assert report.first_token_s is not None and report.first_token_s >= report.load_s
            for t in PROMPTS:
                assert _pd(server, t) == refs[t]
            (generation,) = [p for p in Path(store).iterdir() if p.is_dir()]
            deadline = time.monotonic() + 60
            while len(list((generation / HOLDERS).iterdir())) != 2 and time.monotonic() < deadline:
                time.sleep(0.5)  # the old decode lets go when Triton has unloaded it
            assert len(list((generation / HOLDERS).iterdir())) == 2  # prefill and the new decode
            print(f"swap: {report.to_json()}")
        assert not Path(store).exists()
    finally:
        shutil.rmtree(kv, ignore_errors=True)
        Root(store).sweep()
