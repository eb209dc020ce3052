"""Both ends of the KV hand-off (rngd_pd.kv.handoff) over the real shm transport, without Triton."""

from __future__ import annotations

import dataclasses
import json
import tempfile
import threading

import numpy as np
import pytest
import torch

from rngd_pd import errors
from rngd_pd.config.env import RNGD_PD_KV_DEBUG_LOG
from rngd_pd.kv import load_transport
from rngd_pd.kv.handle import KVSpec, handle_index
from rngd_pd.kv.handoff import KVReceiver, KVSender
from rngd_pd.model.cache import KVCache
from rngd_pd.model.config import ModelConfig

SPEC = KVSpec("fp-test", num_layers=3, num_kv_heads=2, head_dim=4, dtype="bf16")
CONFIG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=SPEC.num_layers,
                     num_heads=4, num_kv_heads=SPEC.num_kv_heads, head_dim=SPEC.head_dim, rope_theta=1e4,
                     rope_scaling=None, rms_norm_eps=1e-5, max_context=64, tie_word_embeddings=True,
                     bos_token_id=None, eos_token_ids=(0,))
T = 5


@pytest.fixture()
def shm():
    with tempfile.TemporaryDirectory(prefix="rngd-kv-io-") as root:
        transport = load_transport("shm", root=root)
        yield transport
        transport.close()


def _layers(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (SPEC.num_kv_heads, T, SPEC.head_dim)
    return [(torch.randn(shape, generator=g).bfloat16(), torch.randn(shape, generator=g).bfloat16())
            for _ in range(SPEC.num_layers)]


def _receive(receiver: KVReceiver, key: str, t: int, **kw):
    """Pull into slot 1 of a small cache laid out as decode's KVCache; returns (handle, per-layer K/V)."""
    cache = KVCache(CONFIG, 3, T + 2, torch.bfloat16)
    handle = receiver.receive_into(key, t, cache, 1, **kw)
    assert all(not k[[0, 2]].any() and not k[1, :, t:].any() for k in cache.k + cache.v), "wrote outside"
    return handle, [(k[1, :, :t], v[1, :, :t]) for k, v in zip(cache.k, cache.v, strict=True)]


def _send(transport, key: str, layers) -> None:
    sender = KVSender(transport, key, SPEC)
    for i, (k, v) in enumerate(layers):
        sender.on_layer(i, k, v)
    sender.finish(first_token=11, num_tokens=T)


def test_receiver_gets_the_same_bytes_while_the_sender_is_still_pushing(shm, monkeypatch, tmp_path) -> None:
    log = tmp_path / "kv.jsonl"
    monkeypatch.setenv(RNGD_PD_KV_DEBUG_LOG.name, str(log))
    layers = _layers()
    result = {}
    receiver = threading.Thread(target=lambda: result.update(
        zip(("handle", "kv"), _receive(KVReceiver(shm, SPEC, timeout_s=10), "k1", T), strict=True)))
    receiver.start()  # pulls start before anything was pushed: they wait for each blob
    _send(shm, "k1", layers)
    receiver.join(20)
    assert result["handle"].first_token == 11
    for (k, v), (rk, rv) in zip(layers, result["kv"], strict=True):
        assert torch.equal(k, rk) and torch.equal(v, rv)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    sides = {s: {r["index"]: r["crc32c"] for r in rows if r["side"] == s} for s in ("prefill", "decode")}
    assert {i: c for i, c in sides["prefill"].items() if i < 2 * SPEC.num_layers} == sides["decode"]


def test_a_flipped_byte_is_refused_naming_the_transport(shm) -> None:
    _send(shm, "k2", _layers())
    blob = np.zeros(1024, np.uint8)
    n = shm.pull("k2", 1, blob, timeout=1)
    blob[0] ^= 1
    shm.push("k2", 1, blob[:n])
    with pytest.raises(errors.TransportIntegrityError, match=r"'shm'.*crc32c of blob 1"):
        _receive(KVReceiver(shm, SPEC, timeout_s=5), "k2", T)


def test_kv_of_another_model_or_length_is_refused(shm) -> None:
    _send(shm, "k3", _layers())
    other = dataclasses.replace(SPEC, fingerprint="another-model")
    with pytest.raises(errors.TransportIntegrityError, match="fingerprint"):
        _receive(KVReceiver(shm, other, timeout_s=5), "k3", T)
    with pytest.raises(errors.TransportIntegrityError, match="bytes"):
        _receive(KVReceiver(shm, SPEC, timeout_s=5), "k3", T + 1)


def test_missing_kv_times_out_and_cancel_stops_the_wait(shm) -> None:
    with pytest.raises(errors.TransportTimeoutError, match=r"'shm'.*did not arrive"):
        _receive(KVReceiver(shm, SPEC, timeout_s=0.5, poll_s=0.1), "nobody", T)
    with pytest.raises(errors.RequestCancelled):
        _receive(KVReceiver(shm, SPEC, timeout_s=30, poll_s=0.1), "nobody", T, cancelled=lambda: True)


def test_a_failing_push_names_the_transport() -> None:
    class Broken:
        name = "tcp"

        def push(self, key, index, data):
            raise errors.TransportError("connection reset", key=key)

    with pytest.raises(errors.TransportError, match="'tcp' failed to push blob 0"):
        KVSender(Broken(), "k4", SPEC).on_layer(0, *_layers()[0])
    assert handle_index(SPEC.num_layers) == 6
