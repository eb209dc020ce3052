"""e2e: conditional disaggregation. Short prompts are prefilled by decode itself (no hand-off), long ones
by prefill; both give the colocated engine's greedy tokens, concurrently, and Triton's metrics count
both paths. Also the threshold measurement itself (rngd_pd.engine.local_prefill)."""

from __future__ import annotations

import os
import shutil
import tempfile
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from rngd_pd.testing import e2e as E
from tests.triton_harness import triton_server

LOCAL = 24  # prompts up to 24 tokens are prefilled by decode
OUT = ("output_ids", "finish_reason")
SHORT = E.PROMPTS[:3]
LONG = tuple(" ".join([p] * 6) for p in E.PROMPTS[:2])


def _metric(server, name: str) -> float:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name))


@pytest.fixture(scope="module")
def server():
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    shm_root = tempfile.mkdtemp(prefix="rngd-pd-local-", dir=base)
    env = {"AIRM_KV_TRANSPORT": "shm", "PD_SHM_ROOT": shm_root,
           "RNGD_PD_PARAM_LOCAL_PREFILL_TOKENS": str(LOCAL), "RNGD_PD_PARAM_LOCAL_PREFILL_WHEN": "always"}
    try:
        with triton_server(E.subset_repository(["pd", "prefill", "decode", "colocated"]), "cpu", env) as s:
            yield s
    finally:
        shutil.rmtree(shm_root, ignore_errors=True)


@pytest.mark.e2e
def test_short_prompts_skip_the_hand_off_long_ones_take_it_same_tokens(server) -> None:
    assert all(len(E.prompt_ids(t)) <= LOCAL for t in SHORT)
    assert all(len(E.prompt_ids(t)) > LOCAL for t in LONG)
    texts = [*SHORT, *LONG, *SHORT]
    refs = {t: E.reference(t) for t in set(texts)}
    label = 'rngd_pd_prefill_requests_total{model="pd",path="%s"}'
    before = {p: _metric(server, label % p) for p in ("local", "remote")}
    prefills = _metric(server, 'nv_inference_request_success{model="prefill"')

    def run(text: str) -> tuple[list[int], str]:
        got = E.stream_infer(server.grpc_url, "pd", E.pd_inputs(E.prompt_ids(text)), OUT)
        return E.ids_of(got), E.reason_of(got)

    with ThreadPoolExecutor(len(texts)) as pool:
        results = list(pool.map(run, texts))
    for text, (ids, reason) in zip(texts, results, strict=True):
        assert (tuple(ids), reason) == (refs[text][0], refs[text][2]), text
    assert _metric(server, label % "local") - before["local"] == 2 * len(SHORT)
    assert _metric(server, label % "remote") - before["remote"] == len(LONG)
    assert _metric(server, 'nv_inference_request_success{model="prefill"') - prefills == len(LONG)


@pytest.mark.e2e
def test_decode_says_its_threshold_and_prefills_what_it_is_sent(server) -> None:
    got = E.stream_infer(server.grpc_url, "decode", {"request_key": np.array([b"d"], dtype=np.object_),
                                                     "describe": np.array([True])}, ("local_prefill_tokens",))
    assert int(got[-1]["local_prefill_tokens"][0]) == LOCAL
    # a direct client may send decode any prompt with its ids: the stream starts with the first token
    text = LONG[0]
    ids, _, reason = E.reference(text)
    inputs = {"request_key": np.array([b"direct-1"], dtype=np.object_),
              "input_ids": np.array(E.prompt_ids(text), np.int32),
              "max_tokens": np.array([E.MAX_TOKENS], np.int32)}
    got = E.stream_infer(server.grpc_url, "decode", inputs, OUT)
    assert E.ids_of(got) == list(ids) and E.reason_of(got) == reason


def test_the_measured_threshold_fits_the_step_budget(smollm) -> None:
    from rngd_pd.engine.decode import DecodeEngine
    from rngd_pd.engine.local_prefill import measure
    from rngd_pd.engine.prefill import PrefillEngine

    decode = DecodeEngine(smollm, num_slots=4, max_len=128, buckets=[128])
    prefill = PrefillEngine(smollm, chunk_size=None, max_context=128)
    generous = measure(prefill, decode, budget_steps=1000.0, lengths=(4, 8))
    assert generous.tokens == 8 and set(generous.prefill_s) == {4, 8} and generous.step_s > 0
    assert "measured" in generous.reason
    never = measure(prefill, decode, budget_steps=1e-9, lengths=(4, 8))
    assert never.tokens == 0 and "more than" in never.reason
    # the engine still starts and serves after being timed
    decode.start()
    decode.stop()


def test_a_decode_only_device_hands_everything_off(smollm) -> None:
    """A runtime that cannot prefill (ATOM runs decode only): decode still loads, says 0, refuses ids."""
    from rngd_pd import errors
    from rngd_pd.devices import select_device
    from rngd_pd.devices.torch_runtime import TorchRuntime
    from rngd_pd.kv import load_transport
    from rngd_pd.model.sampling import SamplingParams
    from rngd_pd.stubs.decode_model import DecodeService

    class DecodeOnly(TorchRuntime):  # as rngd_pd.devices.atom answers a prefill
        def prefill(self, *args, **kwargs):
            raise errors.DeviceUnavailableError("the ATOM runtime runs decode only in this system")

    runtime = DecodeOnly(select_device("cpu", -1), smollm)
    root = tempfile.mkdtemp(prefix="rngd-pd-decode-only-")
    service = DecodeService(runtime, load_transport("shm", root=root), "fp32", num_slots=2, max_len=64,
                            local_prefill_tokens=-1)
    try:
        assert service.threshold.tokens == 0 and "cannot prefill" in service.threshold.reason
        with pytest.raises(errors.ConfigError, match="hand the KV off"):
            service.start("k", 3, SamplingParams(max_tokens=2), lambda *a: None, token_ids=[1, 2, 3])
    finally:
        service.close()
        shutil.rmtree(root, ignore_errors=True)
