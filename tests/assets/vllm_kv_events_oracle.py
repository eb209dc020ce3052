"""The oracle side of tests/test_kv_events_vllm.py: runs in the vLLM environment (.cache/peers/vllm-venv),
imports nothing of rngd_pd. It subscribes to a server's KV events with vLLM's own msgspec classes
(`vllm.distributed.kv_events.KVEventBatch`) and hashes prompts with vLLM's own function
(`hash_block_tokens(sha256_cbor, ...)` after `init_none_hash(sha256_cbor)`, published as
`maybe_convert_block_hash` does).

    python vllm_kv_events_oracle.py --bind tcp://127.0.0.1:P --replay tcp://127.0.0.1:Q

1. binds SUB on --bind (llm-d's global-socket mode: the engine connects), asks the replay socket for
   everything from seq 0 (the batches published before it existed), prints `READY <n>`;
2. receives live batches, filling any gap in the sequence from the replay socket;
3. on one stdin line `{"prompts": [[ids], ...], "block_size": B}` it waits until 1 s passes without a
   batch, asks for a full replay once more (so nothing published is missing at the tail), prints one
   JSON line: every batch decoded (seq, how it came, topic, ts, rank, events) and vLLM's hashes of the
   prompts, then exits.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import msgspec
import zmq
from vllm.distributed.kv_events import KVEventBatch
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core import kv_cache_utils as kcu

END = (-1).to_bytes(8, "big", signed=True)
DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def as_dict(seq: int, how: str, topic: bytes, payload: bytes) -> dict:
    batch = DECODER.decode(payload)  # raises on anything vLLM's classes do not accept
    events = [{"type": type(e).__name__, **msgspec.structs.asdict(e)} for e in batch.events]
    return {"seq": seq, "how": how, "topic": topic.decode(), "ts": batch.ts,
            "rank": batch.data_parallel_rank, "events": events}


def replay(ctx: zmq.Context, endpoint: str, start: int) -> list[tuple[int, bytes, bytes]]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    out = []
    try:
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        while sock.poll(5000):
            _, topic, seq, payload = sock.recv_multipart()
            if seq == END:
                return out
            out.append((int.from_bytes(seq, "big"), topic, payload))
        raise SystemExit("replay: no end marker within 5 s")
    finally:
        sock.close(linger=0)


def vllm_hashes(ids: list[int], block: int) -> list[int]:
    hashes, parent = [], None
    for start in range(0, len(ids) - block + 1, block):
        parent = kcu.hash_block_tokens(sha256_cbor, parent, ids[start:start + block], None)
        hashes.append(kcu.maybe_convert_block_hash(parent))
    return hashes


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bind", required=True)
    ap.add_argument("--replay", required=True)
    args = ap.parse_args()
    kcu.init_none_hash(sha256_cbor)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv@")
    sub.bind(args.bind)
    seen: dict[int, dict] = {}
    for seq, topic, payload in replay(ctx, args.replay, 0):
        seen[seq] = as_dict(seq, "replay", topic, payload)
    print(f"READY {len(seen)}", flush=True)
    request: list[dict] = []
    reader = threading.Thread(target=lambda: request.append(json.loads(sys.stdin.readline())), daemon=True)
    reader.start()
    last = time.monotonic()
    while not request or time.monotonic() - last < 1.0:
        if not sub.poll(50):
            continue
        topic, seq_bytes, payload = sub.recv_multipart()
        seq, last = int.from_bytes(seq_bytes, "big"), time.monotonic()
        top = max(seen, default=-1)
        if seq > top + 1:  # missed some: the replay socket has them
            for s, t, p in replay(ctx, args.replay, top + 1):
                if s < seq and s not in seen:
                    seen[s] = as_dict(s, "gap-replay", t, p)
        seen.setdefault(seq, as_dict(seq, "live", topic, payload))
    tail = replay(ctx, args.replay, 0)
    for seq, topic, payload in tail:
        seen.setdefault(seq, as_dict(seq, "final-replay", topic, payload))
    block = request[0]["block_size"]
    print(json.dumps({"batches": [seen[s] for s in sorted(seen)], "buffered": [s for s, _, _ in tail],
                      "hashes": [vllm_hashes(ids, block) for ids in request[0]["prompts"]]}), flush=True)
    sub.close(linger=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
