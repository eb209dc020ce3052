"""The messages, field for field as vLLM 0.32 defines them (`vllm/distributed/kv_events.py`), so
vLLM's own decoder (and llm-d's, Dynamo's) reads them.

A batch is a msgspec struct encoded as a msgpack array `[ts, events, data_parallel_rank]`; each event
is a msgpack map tagged with its class name (`{"type": "BlockStored", ...}`); fields with a default
are left out when they hold it. Only the fields this engine fills are declared beyond vLLM's
required ones; a decoder ignores what it does not know and defaults what is missing.
"""

from __future__ import annotations

import time

import msgspec

MEDIUM = "GPU"  # vLLM's name for the engine's own KV pool (vLLM on CPU reports it too); see docs


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three events (tagged with the class name, as vLLM's are)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[KVEvent]


def stored(hashes: list[int], parent: int | None, token_ids: list[int], block_size: int) -> BlockStored:
    """A run of consecutive blocks now cached; `parent` is the block before the first (None at the
    start of a prompt), `token_ids` their tokens (len(hashes) * block_size)."""
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=token_ids,
                       block_size=block_size, lora_id=None, medium=MEDIUM, lora_name=None, group_idx=0)


def removed(hashes: list[int]) -> BlockRemoved:
    return BlockRemoved(block_hashes=hashes, medium=MEDIUM, group_idx=0)


def batch(events: list, rank: int = 0, ts: float | None = None) -> KVEventBatch:
    return KVEventBatch(ts=time.time() if ts is None else ts, events=events, data_parallel_rank=rank)


ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
