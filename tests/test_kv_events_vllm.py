"""KV events judged by vLLM itself: a real tritonserver whose prefill publishes (connecting, as in
llm-d's global-socket mode, to a subscriber that binds), and a subscriber in the vLLM environment
(tests/assets/vllm_kv_events_oracle.py) built from vLLM 0.32's own msgspec classes and hash function.

Checked: every batch the server published decodes with vLLM's KVEventBatch, with sequence numbers
0, 1, 2, ... and no gap; the batches published before the subscriber existed came from the replay
socket; the first batch is AllBlocksCleared (the cache started); after each prompt is prefilled, the
published block hashes, parents and tokens equal vLLM's hash_block_tokens(sha256_cbor, ...) of the same
tokens and block size; LRU eviction is published as BlockRemoved of blocks stored before; the server's
counter of published batches equals what arrived, and none was dropped.

Needs the vLLM environment (several GB): `make test-vllm` builds it (bench/peers/vllm.py install) and
runs this file; `make test` deselects the `vllm` marker; `.ci/run` runs both.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from bench.peers import vllm as vllm_peer
from rngd_pd.testing import e2e as E
from rngd_pd.wire import tensors as T
from tests.triton_harness import triton_server

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

ORACLE = Path(__file__).parent / "assets" / "vllm_kv_events_oracle.py"
BLOCK = 16
TOPIC = "kv@127.0.0.1@SmolLM2-135M-Instruct"
PROMPTS = (
    "Summarise the plot of a novel about a lighthouse keeper who finds a message in a bottle, in five "
    "sentences, naming the keeper, the sender of the message and the island where both of them live, "
    "and say in one more sentence why the story ends the way it does.",
    "List the steps to repot a fern: the pot size, the soil mix, how much water to give it afterwards, "
    "where to put it for the first week and the mistakes that beginners make most often with ferns, "
    "then add a short note on how often to feed it in winter.",
    "Explain to a ten year old why the sky is blue and why sunsets are red, with one experiment they "
    "can do at home using a glass of water, a few drops of milk and a torch in a dark room tonight, "
    "and what they should expect to see from the side and from the end.",
)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    if not vllm_peer.installed():
        pytest.skip("the vLLM environment is missing: `make test-vllm` builds it "
                    "(bench/peers/vllm.py install)")
    return vllm_peer.venv_python()


@pytest.fixture(scope="module")
def env() -> Iterator[dict[str, str]]:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    shm_root = tempfile.mkdtemp(prefix="rngd-pd-events-shm-", dir=base)
    pub, replay = _port(), _port()
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{pub}",
           "replay_endpoint": f"tcp://127.0.0.1:{replay}", "topic": TOPIC}
    yield {"AIRM_KV_TRANSPORT": "shm", "PD_SHM_ROOT": shm_root, "RNGD_PD_KV_EVENTS_CONFIG": json.dumps(cfg),
           # 2 MiB of bf16 KV = 5 blocks of 16 tokens: the second prompt evicts most of the first
           "RNGD_PD_PARAM_PREFIX_CACHE_MB": "2", "RNGD_PD_PARAM_PREFIX_BLOCK": str(BLOCK),
           "RNGD_PD_KV_DTYPE": "bf16"}
    shutil.rmtree(shm_root, ignore_errors=True)


def _prefill(url: str, key: str, ids: list[int]) -> None:
    values = {T.REQUEST_KEY: np.array([key.encode()], dtype=np.object_), T.INPUT_IDS: np.array(ids, np.int32)}
    client = grpcclient.InferenceServerClient(url)
    try:
        client.infer("prefill", E.grpc_inputs(values), timeout=300)
    finally:
        client.close()


def _oracle(python: Path, env: dict[str, str]) -> subprocess.Popen:
    cfg = json.loads(env["RNGD_PD_KV_EVENTS_CONFIG"])
    return subprocess.Popen([str(python), str(ORACLE), "--bind", cfg["endpoint"], "--replay",
                             cfg["replay_endpoint"]], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=tempfile.gettempdir())


def _stored_by_block(batches: list[dict]) -> dict[int, dict]:
    out = {}
    for b in batches:
        for e in b["events"]:
            if e["type"] == "BlockStored":
                for i, h in enumerate(e["block_hashes"]):
                    parent = e["parent_block_hash"] if i == 0 else e["block_hashes"][i - 1]
                    out[h] = {"parent": parent, "tokens": e["token_ids"][i * BLOCK:(i + 1) * BLOCK],
                              "block_size": e["block_size"], "medium": e["medium"]}
    return out


def test_vllm_decodes_every_batch_and_computes_the_same_block_hashes(vllm_python, env) -> None:
    ids = [E.prompt_ids(p) for p in PROMPTS]
    assert all(len(i) >= 3 * BLOCK for i in ids), [len(i) for i in ids]
    with triton_server(E.subset_repository(["prefill"]), "cpu", env) as server:
        _prefill(server.grpc_url, "before-the-subscriber", ids[0])  # missed: comes from the replay socket
        oracle = _oracle(vllm_python, env)
        try:
            assert oracle.stdout is not None and oracle.stdin is not None
            ready = oracle.stdout.readline()  # vLLM imports take ~30 s here
            assert ready.startswith("READY"), ready
            for n, prompt in enumerate(ids[1:]):
                _prefill(server.grpc_url, f"live-{n}", prompt)
            oracle.stdin.write(json.dumps({"prompts": ids, "block_size": BLOCK}) + "\n")
            oracle.stdin.flush()
            out, _ = oracle.communicate(timeout=120)
            with urllib.request.urlopen(server.metrics_url, timeout=10) as resp:
                metrics = resp.read().decode()
        finally:
            if oracle.poll() is None:
                oracle.kill()
                oracle.wait()
    assert oracle.returncode == 0, out[-2000:]
    result = json.loads(out.strip().splitlines()[-1])
    batches, vllm_hashes = result["batches"], result["hashes"]
    seqs = [b["seq"] for b in batches]
    assert seqs == list(range(len(seqs))) and result["buffered"] == seqs  # every batch, none missing
    assert all(b["topic"] == TOPIC and b["rank"] == 0 for b in batches)
    assert batches[0]["events"] == [{"type": "AllBlocksCleared"}] and batches[0]["how"] == "replay"
    assert any(b["how"] == "replay" and b["events"][0]["type"] == "BlockStored" for b in batches)
    stored = _stored_by_block(batches)
    for prompt, hashes in zip(ids, vllm_hashes, strict=True):
        assert len(hashes) == len(prompt) // BLOCK
        for i, h in enumerate(hashes):  # the engine's published name of each block is vLLM's
            assert h in stored, (i, h)
            assert stored[h]["parent"] == (hashes[i - 1] if i else None)
            assert stored[h]["tokens"] == prompt[i * BLOCK:(i + 1) * BLOCK]
            assert stored[h]["block_size"] == BLOCK and stored[h]["medium"] == "GPU"
    published = re.search(r'rngd_pd_kv_events_batches_total\{model="prefill",outcome="published"\} (\S+)',
                          metrics)
    assert published and float(published.group(1)) == len(seqs), metrics[-2000:]
    assert 'outcome="dropped"' not in metrics
    removed = [h for b in batches for e in b["events"] if e["type"] == "BlockRemoved"
               for h in e["block_hashes"]]
    assert removed and set(removed) <= set(stored)
