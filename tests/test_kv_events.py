"""KV events without vLLM: the configuration (vLLM's keys and rules), the block hash against a formula
written here from vLLM's documented definition (RFC 8949 canonical CBOR by hand, SHA-256, the
NONE_HASH seed), the prefix cache's events, and the publisher's wire protocol over real ZMQ sockets
(batches in order, drop-oldest that never blocks, replay). The server end to end, decoded by vLLM's
own classes, is tests/test_kv_events_vllm.py."""

from __future__ import annotations

import argparse
import hashlib
import socket
import struct
import tempfile
import threading
import time

import msgspec
import numpy as np
import pytest
import torch
import zmq

from rngd_pd.commands import serve
from rngd_pd.config import kv_events as cfgmod
from rngd_pd.devices.torch_runtime import as_runtime
from rngd_pd.engine.kv_events import hashing, messages
from rngd_pd.engine.kv_events.publisher import END_SEQ, ZmqPublisher, offset_endpoint
from rngd_pd.engine.kv_events.subscriber import Subscriber
from rngd_pd.engine.prefix import PrefixCache
from rngd_pd.errors import ConfigError
from rngd_pd.testing.kv_router import EventRouter

# ---- the block hash, from its definition -------------------------------------------------------


def _cbor_head(major: int, n: int) -> bytes:
    """RFC 8949 §3: the shortest head for argument n (canonical / deterministic encoding)."""
    if n < 24:
        return bytes([major << 5 | n])
    for code, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if n < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | code]) + struct.pack(fmt, n)
    raise ValueError(n)


def _cbor(value: object) -> bytes:
    if value is None:
        return b"\xf6"
    if isinstance(value, int):
        return _cbor_head(0, value) if value >= 0 else _cbor_head(1, -1 - value)
    if isinstance(value, bytes):
        return _cbor_head(2, len(value)) + value
    if isinstance(value, str):
        data = value.encode()
        return _cbor_head(3, len(data)) + data
    if isinstance(value, tuple | list):
        return _cbor_head(4, len(value)) + b"".join(_cbor(v) for v in value)
    raise TypeError(value)


def _vllm_hashes(ids: list[int], block: int, seed: str = "vllm-none-hash") -> list[int]:
    """vLLM's definition: NONE_HASH = sha256(cbor(seed)); block = sha256(cbor((parent, tokens, None)));
    published as the low 64 bits, big-endian."""
    parent = hashlib.sha256(_cbor(seed)).digest()
    out = []
    for start in range(0, len(ids) - block + 1, block):
        parent = hashlib.sha256(_cbor((parent, tuple(ids[start:start + block]), None))).digest()
        out.append(int.from_bytes(parent[-8:], "big"))
    return out


def test_block_hashes_equal_vllms_definition() -> None:
    rng = np.random.default_rng(1)
    ids = [*rng.integers(0, 200_000, size=70).tolist(), 0, 23, 24, 255, 256, 65_535, 65_536]
    got = [hashing.external(h) for h in hashing.block_hashes(ids, 16, hashing.none_hash({}))]
    assert got == _vllm_hashes(ids, 16) and len(got) == len(ids) // 16


def test_the_seed_is_pythonhashseed_when_set() -> None:
    ids = list(range(40))
    assert hashing.hash_seed({}) == "vllm-none-hash"
    assert hashing.hash_seed({"PYTHONHASHSEED": "0"}) == "0"
    seeded = [hashing.external(h) for h in hashing.block_hashes(ids, 16, hashing.none_hash(
        {"PYTHONHASHSEED": "0"}))]
    assert seeded == _vllm_hashes(ids, 16, seed="0") != _vllm_hashes(ids, 16)


# ---- configuration -----------------------------------------------------------------------------


def test_config_has_vllms_keys_defaults_and_publisher_rule() -> None:
    off = cfgmod.parse(None)
    assert not off.enabled and off.resolved_publisher == "null" and off.endpoint == "tcp://*:5557"
    on = cfgmod.parse('{"enable_kv_cache_events": true, "topic": "kv@10.0.0.1@m"}')
    assert on.enabled and on.resolved_publisher == "zmq" and on.buffer_steps == 10_000
    assert not cfgmod.parse({"enable_kv_cache_events": True, "publisher": "null"}).enabled
    assert cfgmod.from_env({"RNGD_PD_KV_EVENTS_CONFIG": '{"enable_kv_cache_events": true}'}).enabled
    for bad, match in (('{"enable_kv_events": true}', "unknown key"), ("[1]", "JSON object"),
                       ('{"hwm": "10"}', "hwm must be a int"), ('{"publisher": "kafka"}', "publisher"),
                       ('{"endpoint": "localhost:5557"}', "must start with"), ("{", "not JSON")):
        with pytest.raises(ConfigError, match=match):
            cfgmod.parse(bad)


def test_serve_passes_the_flag_to_the_models_as_the_variable() -> None:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    text = '{"enable_kv_cache_events": true, "topic": "kv@pod@m"}'
    env = serve.model_env(parser.parse_args(["--kv-events-config", text]))
    assert env["RNGD_PD_KV_EVENTS_CONFIG"] == text
    assert "RNGD_PD_KV_EVENTS_CONFIG" not in serve.model_env(parser.parse_args([]))


def test_bind_or_connect_follows_vllms_rule() -> None:
    assert cfgmod.binds("tcp://*:5557") and cfgmod.binds("tcp://[::]:5557") and cfgmod.binds("ipc:///tmp/x")
    assert not cfgmod.binds("tcp://indexer.llm-d:5557") and not cfgmod.binds("tcp://127.0.0.1:5557")
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559" and offset_endpoint("tcp://*:5557", 0) == \
        "tcp://*:5557" and offset_endpoint("ipc:///tmp/e", 1) == "ipc:///tmp/e_dp1"


# ---- the prefix cache's events -----------------------------------------------------------------


class Recorder:
    def __init__(self) -> None:
        self.batches: list[list] = []

    def publish(self, events: list) -> None:
        self.batches.append(list(events))


def test_prefix_cache_reports_start_store_evict_and_clear(smollm) -> None:
    c, rec = smollm.config, Recorder()
    runtime = as_runtime(smollm)
    probe = PrefixCache(runtime, c.num_layers, c.num_kv_heads, c.head_dim, torch.float32, 0, block=4)
    cache = PrefixCache(runtime, c.num_layers, c.num_kv_heads, c.head_dim, torch.float32,
                        capacity_bytes=3 * probe.block_bytes, block=4, events=rec)
    assert [type(e) for e in rec.batches.pop()] == [messages.AllBlocksCleared]

    def kv(n: int) -> list:
        return [(torch.zeros(c.num_kv_heads, n, c.head_dim), torch.zeros(c.num_kv_heads, n, c.head_dim))
                for _ in range(c.num_layers)]

    a = np.arange(13, dtype=np.int64)
    ha = _vllm_hashes(a.tolist(), 4)
    cache.insert(a, kv(13))
    [stored] = rec.batches.pop()
    assert stored.block_hashes == ha and stored.parent_block_hash is None
    assert stored.token_ids == list(range(12)) and stored.block_size == 4 and stored.medium == "GPU"
    b = np.concatenate([a[:8], np.arange(100, 105)])
    cache.insert(b, kv(13), cached_tokens=8)
    new, gone = rec.batches.pop()  # b's third block, child of a's second; a's leaf evicted (LRU)
    assert new.block_hashes == _vllm_hashes(b.tolist(), 4)[2:] and new.parent_block_hash == ha[1]
    assert new.token_ids == [100, 101, 102, 103] and gone.block_hashes == [ha[2]]
    cache.clear()
    assert [type(e) for e in rec.batches.pop()] == [messages.AllBlocksCleared] and not rec.batches


# ---- the publisher over real sockets -----------------------------------------------------------


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def endpoints():
    """A subscriber bound on 127.0.0.1 (llm-d's global-socket mode: the engine connects to it) and
    the publisher's replay endpoint."""
    pub_ep, replay_ep = f"tcp://127.0.0.1:{_port()}", f"tcp://127.0.0.1:{_port()}"
    sub = Subscriber(pub_ep, replay_ep, topic="kv@", bind=True)
    yield pub_ep, replay_ep, sub
    sub.close()


def _publisher(pub_ep: str, replay_ep: str, **over) -> ZmqPublisher:
    return ZmqPublisher(cfgmod.parse({"enable_kv_cache_events": True, "endpoint": pub_ep,
                                      "replay_endpoint": replay_ep, "topic": "kv@pod@m", **over}))


def _collect(sub: Subscriber, want: int, timeout: float = 10.0) -> list:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        got.extend(sub.poll(100))
    return got


def _connected(pub: ZmqPublisher, sub: Subscriber) -> None:
    """Wait until the connect-mode PUB reaches the subscriber (ZMQ's slow joiner), with probe
    batches a fresh subscriber catches up on from the replay socket."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pub.publish([messages.AllBlocksCleared()])
        if list(sub.poll(100)):
            return
    raise AssertionError("the publisher never reached the subscriber")


def test_batches_arrive_in_order_with_increasing_seq_and_timestamps(endpoints) -> None:
    pub_ep, replay_ep, sub = endpoints
    pub = _publisher(pub_ep, replay_ep)
    try:
        _connected(pub, sub)
        first = sub.last_seq + 1
        t0 = time.time()
        for i in range(20):
            pub.publish([messages.stored([i], i - 1 if i else None, [i] * 4, 4), messages.removed([i])])
        got = _collect(sub, 20)
    finally:
        pub.close()
    assert [r.seq for r in got] == list(range(first, first + 20)) and sub.gaps == 0
    assert all(r.topic == "kv@pod@m" and r.batch.data_parallel_rank == 0 for r in got)
    ts = [r.batch.ts for r in got]
    assert ts == sorted(ts) and t0 <= ts[0] <= time.time()
    assert [r.batch.events[0].block_hashes for r in got] == [[i] for i in range(20)]


def test_a_full_queue_drops_the_oldest_counts_it_and_never_blocks(endpoints) -> None:
    pub_ep, replay_ep, sub = endpoints
    entered, release = threading.Event(), threading.Event()

    class Slow(ZmqPublisher):
        def _send(self, seq, ts, events):
            if not entered.is_set():
                entered.set()
                release.wait(10)
            super()._send(seq, ts, events)

    pub = Slow(cfgmod.parse({"enable_kv_cache_events": True, "endpoint": pub_ep,
                             "replay_endpoint": replay_ep, "topic": "kv@pod@m", "max_queue_size": 3}))
    try:
        pub.publish([messages.AllBlocksCleared()])  # seq 0: the sender holds it
        assert entered.wait(10)
        t0 = time.perf_counter()
        for i in range(1, 10):
            pub.publish([messages.removed([i])])
        took = time.perf_counter() - t0
        assert pub.dropped == 6 and took < 0.05, (pub.dropped, took)
        release.set()
        time.sleep(0.5)
        got = list(sub.replay(0))
    finally:
        pub.close()
    assert [r.seq for r in got] == [0, 7, 8, 9]  # seq 1-6 dropped: a visible gap, not a silent one


def test_a_subscriber_that_missed_batches_gets_them_from_the_replay_socket(endpoints) -> None:
    pub_ep, replay_ep, sub = endpoints
    pub = _publisher(pub_ep, replay_ep)
    try:
        _connected(pub, sub)
        sub.sub.setsockopt_string(zmq.UNSUBSCRIBE, "kv@")  # deaf for a while
        time.sleep(0.3)
        last = sub.last_seq
        for i in range(5):
            pub.publish([messages.removed([i])])
        time.sleep(0.3)
        sub.sub.setsockopt_string(zmq.SUBSCRIBE, "kv@")
        deadline = time.monotonic() + 10
        got: list = []
        while not got and time.monotonic() < deadline:  # until the subscription is back
            pub.publish([messages.removed([99])])
            got = [r for r in sub.poll(200)]
    finally:
        pub.close()
    replayed = [r for r in got if r.replayed]
    assert [r.seq for r in replayed][:5] == list(range(last + 1, last + 6))
    assert [r.batch.events[0].block_hashes for r in replayed][:5] == [[i] for i in range(5)]
    assert [r.seq for r in got] == list(range(last + 1, got[-1].seq + 1)) and sub.gaps == 0


def test_replay_protocol_frames_are_vllms(endpoints) -> None:
    """A bare DEALER client, as vLLM's own test: (topic, seq, payload) per batch after the empty
    delimiter frame, then the end marker (b"", -1, b"")."""
    pub_ep, replay_ep, _ = endpoints
    pub = _publisher(pub_ep, replay_ep)
    ctx = zmq.Context.instance()
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    try:
        for i in range(3):
            pub.publish([messages.removed([i])])
        time.sleep(0.3)
        req.connect(replay_ep)
        req.send_multipart((b"", (1).to_bytes(8, "big")))
        frames = []
        while req.poll(2000):
            empty, *rest = req.recv_multipart()
            assert empty == b""
            frames.append(rest)
            if frames[-1][1] == END_SEQ:
                break
    finally:
        req.close(linger=0)
        pub.close()
    assert [f[0] for f in frames] == [b"kv@pod@m", b"kv@pod@m", b""]
    assert [int.from_bytes(f[1], "big", signed=True) for f in frames] == [1, 2, -1] and frames[-1][2] == b""
    decoded = msgspec.msgpack.decode(frames[0][2])  # the raw msgpack: [ts, [{"type": ...}], rank]
    assert decoded[1] == [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": 0}]
    assert decoded[2] == 0 and isinstance(decoded[0], float)


def test_ipc_endpoints_are_bound() -> None:
    with tempfile.TemporaryDirectory() as d:
        pub = ZmqPublisher(cfgmod.parse({"enable_kv_cache_events": True, "endpoint": f"ipc://{d}/ev"}))
        sub = Subscriber(f"ipc://{d}/ev")
        try:
            _connected(pub, sub)
        finally:
            sub.close()
            pub.close()


# ---- the event-scored router (the benches' stand-in for llm-d's precise prefix-cache scorer) -------


class Silent:
    """A subscriber with nothing new (the router's pods are fed directly)."""

    def poll(self, timeout_ms: int = 0) -> list:
        return []


def test_router_scores_pods_by_the_longest_published_prefix() -> None:
    router = EventRouter({"a": Silent(), "b": Silent()}, block_size=4, seed_env={})  # type: ignore[dict-item]
    prompt = list(range(20))  # 5 blocks
    h = _vllm_hashes(prompt, 4)
    router.pods["a"].apply(messages.batch([messages.stored(h[:2], None, prompt[:8], 4)]))
    router.pods["b"].apply(messages.batch([messages.stored(h[:4], None, prompt[:16], 4),
                                           messages.removed([h[1]])]))
    assert router.scores(prompt) == {"a": 2, "b": 1}  # b lost block 1: its blocks 2, 3 no longer count
    router.pods["a"].apply(messages.batch([messages.AllBlocksCleared()]))
    assert router.scores(prompt) == {"a": 0, "b": 1}
    assert router.scores([7] * 20) == {"a": 0, "b": 0}


def test_router_with_load_sends_new_chats_to_an_idle_pod_and_keeps_returning_ones() -> None:
    router = EventRouter({"a": Silent(), "b": Silent()}, block_size=4, seed_env={})  # type: ignore[dict-item]
    system, chat = list(range(8)), list(range(8)) + list(range(100, 124))  # 2 shared blocks + 6 of its own
    new = list(range(8)) + list(range(200, 224))
    h = _vllm_hashes(chat, 4)
    router.pods["a"].apply(messages.batch([messages.stored(h, None, chat[:32], 4)]))
    assert router.route(new, {"a": 1, "b": 0})[0] == "b"  # only the system prompt on a: the idle pod wins
    assert router.route([*chat, 1, 2, 3, 4], {"a": 1, "b": 0}) == ("a", 32)  # its history outweighs a's load
    assert router.route(system + [9] * 8)[0] == "a"  # without load: the longest prefix alone
