"""The KV event publisher: vLLM's ZMQ protocol, off the request path.

Wire (as vLLM 0.32's ZmqEventPublisher): a PUB socket sends each batch as three frames, `topic`
(utf-8), `seq` (8 bytes big-endian, increasing by one per batch from 0) and the msgpack payload
(rngd_pd.engine.kv_events.messages). A ROUTER socket on `replay_endpoint` (always bound) answers a
REQ client that sends one frame, the first `seq` it wants, with `(topic, seq, payload)` for every
buffered batch from there, then the end marker `(b"", -1 as 8 signed bytes, b"")`. The last
`buffer_steps` batches are kept for replay. The PUB endpoint is bound or connected to by vLLM's rule
(rngd_pd.config.kv_events.binds); with several instances in one server, instance r publishes on the
port + r (vLLM's data-parallel offset) and stamps `data_parallel_rank` r.

`publish(events)` is what the prefix cache calls, under its own lock, on the prefilling thread: it
stamps the batch's time and sequence number and appends it to a bounded queue, nothing else; it never
blocks on a socket. One sender thread (`kv-events`) encodes, sends and serves replay requests. When
`max_queue_size` batches wait, the oldest is dropped and counted (`dropped`): its sequence number is
then missing on the wire, so a subscriber sees the gap instead of an index that silently diverged.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Protocol

import zmq

from rngd_pd.config.kv_events import KVEventsConfig, binds
from rngd_pd.engine.kv_events import messages

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
POLL_S = 0.02  # how long the idle sender waits before it looks at the replay socket again


class EventSink(Protocol):
    """Where the prefix cache reports its changes."""

    def publish(self, events: list[messages.KVEvent]) -> None:
        """Queue one batch (in order); never blocks, never raises on a slow or absent subscriber."""


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """vLLM's offset_endpoint_port: tcp port + rank, inproc/ipc name + `_dp<rank>`; rank 0 unchanged."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


class ZmqPublisher:
    """PUB + ROUTER replay publisher (module docstring). Sockets are made (and bound) here, so a port
    in use fails the caller's load; after that only the sender thread touches them."""

    def __init__(self, cfg: KVEventsConfig, rank: int = 0, context: zmq.Context | None = None) -> None:
        self.cfg, self.rank = cfg, rank
        self.endpoint = offset_endpoint(cfg.endpoint, rank)
        self.replay_endpoint = offset_endpoint(cfg.replay_endpoint, rank)
        self.topic = cfg.topic.encode()
        self._ctx = context or zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(cfg.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket | None = None
        try:
            assert self.endpoint is not None
            (self._pub.bind if binds(self.endpoint) else self._pub.connect)(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[int, float, list]] = collections.deque()
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=cfg.buffer_steps)
        self._next_seq = 0
        self._closing = False
        self.dropped = self.sent = self.replayed = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    @property
    def published(self) -> int:
        """Batches queued since start (sequence numbers handed out), dropped ones included."""
        return self._next_seq

    def publish(self, events: list[messages.KVEvent]) -> None:
        if not events:
            return
        with self._cond:
            if self._closing:
                return
            if len(self._queue) >= self.cfg.max_queue_size:
                self._queue.popleft()
                self.dropped += 1
            self._queue.append((self._next_seq, time.time(), events))
            self._next_seq += 1
            self._cond.notify()

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (within `timeout`), stop the sender, close the sockets."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    if not self._queue and not self._closing:
                        self._cond.wait(POLL_S)
                    items, closing = list(self._queue), self._closing
                    self._queue.clear()
                for seq, ts, events in items:
                    self._send(seq, ts, events)
                self._serve_replay()
                if closing:
                    return
        finally:
            self._close_sockets()

    def _send(self, seq: int, ts: float, events: list) -> None:
        try:
            payload = messages.ENCODER.encode(messages.batch(events, self.rank, ts))
        except Exception:
            log.exception("kv events: encoding batch %d failed", seq)
            return
        self._buffer.append((seq, payload))  # replay has it even if the PUB socket drops it
        try:  # PUB never blocks: past the high-water mark ZeroMQ drops the message
            self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
            self.sent += 1
        except zmq.ZMQError:
            log.exception("kv events: sending batch %d failed", seq)

    def _serve_replay(self) -> None:
        """Answer every waiting replay request (ROUTER frames: client id, empty, start seq)."""
        sock = self._replay
        while sock is not None and sock.poll(0):
            frames = sock.recv_multipart()
            if len(frames) != 3:
                log.warning("kv events: a replay request of %d frames ignored", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big", signed=True)
            for seq, payload in list(self._buffer):
                if seq >= first:
                    sock.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
                    self.replayed += 1
            sock.send_multipart((client, b"", b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)


class NullPublisher:
    """Events off: publishing does nothing."""

    dropped = sent = published = 0

    def publish(self, events: list[messages.KVEvent]) -> None:
        return

    def close(self, timeout: float = 0.0) -> None:
        return


def open_publisher(cfg: KVEventsConfig, rank: int = 0) -> ZmqPublisher | NullPublisher:
    """The publisher `cfg` asks for (a NullPublisher when events are off)."""
    return ZmqPublisher(cfg, rank) if cfg.enabled else NullPublisher()
