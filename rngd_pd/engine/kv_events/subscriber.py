"""A subscriber for the KV event protocol (rngd_pd.engine.kv_events.publisher): SUB on the
publisher's endpoint, DEALER on its replay endpoint (a REQ socket, as in vLLM's old example, keeps
only the first of the many replies: vLLM's own test switched to DEALER, vllm-project/vllm#45177).
It fills gaps in the sequence from the replay socket, so its caller sees every buffered batch once
and in order. The benches' event-scored router and the tests use it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import zmq

from rngd_pd.engine.kv_events import messages
from rngd_pd.engine.kv_events.publisher import END_SEQ


@dataclass
class Received:
    topic: str
    seq: int
    batch: messages.KVEventBatch
    replayed: bool


class Subscriber:
    """Connects to one publisher (or binds `endpoint` when `bind`, as llm-d's global-socket indexer
    does and every engine connects). Not thread-safe: one thread polls it."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 bind: bool = False, context: zmq.Context | None = None) -> None:
        self._ctx = context or zmq.Context.instance()
        self.sub = self._ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        (self.sub.bind if bind else self.sub.connect)(endpoint)
        self.replay_endpoint = replay_endpoint
        self.last_seq = -1
        self.gaps = 0  # sequence numbers neither the stream nor the replay buffer had

    def poll(self, timeout_ms: int = 100) -> Iterator[Received]:
        """Batches that arrived within `timeout_ms`, gaps filled from the replay socket first."""
        while self.sub.poll(timeout_ms):
            timeout_ms = 0
            topic, seq_bytes, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq <= self.last_seq:
                continue
            if self.last_seq >= 0 and seq > self.last_seq + 1 and self.replay_endpoint:
                yield from self.replay(self.last_seq + 1, until=seq)
            if seq > self.last_seq + 1 and self.last_seq >= 0:
                self.gaps += seq - self.last_seq - 1
            self.last_seq = seq
            yield Received(topic.decode(), seq, messages.DECODER.decode(payload), False)

    def replay(self, start: int, until: int | None = None, timeout_ms: int = 2000) -> Iterator[Received]:
        """Ask the replay socket for batches from `start` (up to `until`, exclusive)."""
        if not self.replay_endpoint:
            return
        req = self._ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(self.replay_endpoint)
        try:
            req.send_multipart((b"", start.to_bytes(8, "big")))  # the empty frame REQ would add
            while req.poll(timeout_ms):
                _, topic, seq_bytes, payload = req.recv_multipart()
                if seq_bytes == END_SEQ:
                    return
                seq = int.from_bytes(seq_bytes, "big")
                if seq <= self.last_seq or (until is not None and seq >= until):
                    continue
                if seq > self.last_seq + 1 and self.last_seq >= 0:
                    self.gaps += seq - self.last_seq - 1
                self.last_seq = seq
                yield Received(topic.decode(), seq, messages.DECODER.decode(payload), True)
        finally:
            req.close(linger=0)

    def close(self) -> None:
        self.sub.close(linger=0)
