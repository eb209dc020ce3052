"""e2e: a partial update while serving. A tritonserver serves a Hugging Face export of the embedded
model; `apply_delta` (HTTP, Triton's generate extension, as `rngd-pd apply-delta` does) switches it to
a copy in which three tensors changed, under 8 streams: no request fails, each request's tokens are
those of one weight generation, the tokens after it are a fresh load's of the new checkpoint, only the
changed tensors were read, and KV prefilled before the update is refused by decode, naming both
fingerprints."""

from __future__ import annotations

import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient

from rngd_pd.engine.colocated import ColocatedEngine
from rngd_pd.host.shm_refs import Root
from rngd_pd.model.sampling import SamplingParams
from rngd_pd.model.weights import load_model
from rngd_pd.testing import e2e as E
from rngd_pd.testing.checkpoints import changed_copy, export_embedded
from rngd_pd.wire.weights import apply_delta
from tests.triton_harness import triton_server

pytestmark = [pytest.mark.e2e, pytest.mark.long]
CHANGED = ["model.layers.3.self_attn.k_proj.weight", "model.layers.7.mlp.up_proj.weight",
           "model.layers.20.self_attn.o_proj.weight"]
TOKENS = 24
PD_OUT = ("output_ids", "finish_reason")


@pytest.fixture(scope="module")
def checkpoints() -> Iterator[tuple[Path, Path]]:
    d = Path(tempfile.mkdtemp(prefix="rngd-pd-delta-"))
    base = export_embedded(d / "base", torch.bfloat16)
    yield base, changed_copy(base, d / "new", CHANGED)
    shutil.rmtree(d, ignore_errors=True)


def _reference(path: Path) -> dict[str, list[int]]:
    """Greedy tokens of every prompt from a fresh in-process load of `path` (fp32, as the server)."""
    with ColocatedEngine(load_model(str(path), progress=False), num_slots=1, max_len=512) as engine:
        return {t: list(engine.generate(E.prompt_ids(t), SamplingParams(max_tokens=TOKENS)).token_ids)
                for t in E.PROMPTS}


def _pd(server, text: str) -> list[int]:
    return E.ids_of(E.stream_infer(server.grpc_url, "pd", E.pd_inputs(E.prompt_ids(text), TOKENS), PD_OUT))


def _prefill_only(server, key: str, ids: list[int]) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.infer("prefill", E.grpc_inputs({"request_key": np.array([key.encode()], np.object_),
                                               "input_ids": np.array(ids, np.int32)}))
    finally:
        client.close()


def test_a_delta_under_8_streams_switches_both_sides_together(checkpoints) -> None:
    base, new = checkpoints
    old_ref, new_ref = _reference(base), _reference(new)
    assert old_ref != new_ref  # the three tensors change the answers
    store = f"/dev/shm/rngd-pd-e2e-weights-{uuid.uuid4().hex[:8]}"
    kv = tempfile.mkdtemp(prefix="rngd-pd-e2e-shm-", dir="/dev/shm")
    env = {"AIRM_KV_TRANSPORT": "shm", "PD_SHM_ROOT": kv, "RNGD_PD_WEIGHT_STORE": store,
           "RNGD_PD_MODEL": str(base)}
    try:
        with triton_server(E.subset_repository(("prefill", "decode", "pd")), "cpu", env) as server:
            text = E.PROMPTS[0]
            assert _pd(server, text) == old_ref[text]
            early = E.prompt_ids(E.PROMPTS[1])
            _prefill_only(server, "before-the-delta", early)  # its KV waits under the old fingerprint

            results: dict[int, list[tuple[str, list[int]]]] = {}
            failures: list[BaseException] = []

            def client(i: int) -> None:
                try:
                    for k in range(3):
                        t = E.PROMPTS[(i + k) % len(E.PROMPTS)]
                        results.setdefault(i, []).append((t, _pd(server, t)))
                except BaseException as exc:
                    failures.append(exc)

            threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
            for t in threads:
                t.start()
            report = apply_delta(server.http_url, str(new), drain_s=300)
            for t in threads:
                t.join(600)
            assert not failures, failures
            assert report["switched"] and report["changed"] == sorted(CHANGED)
            assert report["bytes_read"] < report["bytes_hashed"] / 20  # only the changed tensors were read
            generations = {"old": 0, "new": 0}
            for runs in results.values():
                for t, ids in runs:
                    assert ids in (old_ref[t], new_ref[t]), (t, ids)  # one generation per request
                    generations["old" if ids == old_ref[t] else "new"] += 1
            assert generations["new"] > 0, generations  # requests after the switch ran on the new weights
            for t in E.PROMPTS:
                assert _pd(server, t) == new_ref[t]
            with pytest.raises(RuntimeError) as refused:
                E.stream_infer(server.grpc_url, "decode",
                               {"request_key": np.array([b"before-the-delta"], np.object_),
                                "prompt_len": np.array([len(early)], np.int32),
                                "max_tokens": np.array([4], np.int32)}, PD_OUT)
            msg = str(refused.value)
            assert report["old_fingerprint"] in msg and report["new_fingerprint"] in msg, msg
            assert "other model weights" in msg
            live = [p.name for p in Path(store).iterdir() if p.is_dir()]
            assert live == [f"{report['new_fingerprint']}-fp32"], live  # the old generation went
        assert not Path(store).exists()
    finally:
        shutil.rmtree(kv, ignore_errors=True)
        Root(store).sweep()
