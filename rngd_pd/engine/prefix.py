"""Prefix reuse: a bounded LRU of prompt KV by token block, so a shared prefix is computed once.

A prompt's ids are cut into blocks of `block` tokens (16 by default, vLLM's and llm-d's size); block i
is named by vLLM's sha256_cbor block hash, chained over block i-1's (rngd_pd.engine.kv_events.hashing),
so a name stands for the whole prefix up to it (two prompts share block i's KV exactly when they share
every token up to its end) and a router computes the same names from the prompt's tokens. The cache
maps names to one tensor per block, [layers, 2 (K, V), kv_heads, block, head_dim] in the KV dtype, in
the runtime's memory (host memory on a CPU). `match` finds the longest cached run of leading blocks,
leaving at least one prompt token to compute (the first token's logits need it); `insert` stores the
prompt's full blocks that were not cached. Eviction is least-recently-used by block; a match refreshes
a chain deepest block first, so a parent always outlives its children and every cached block stays reachable.

Every change is reported to `events` (a KV event publisher, rngd_pd.engine.kv_events.publisher), in
the order it happens, under the index lock: AllBlocksCleared when the cache starts and on `clear`
(a model reload or weight update must call it), BlockStored for each run of blocks `insert` adds,
BlockRemoved for the blocks the LRU evicts.

Thread-safe: one lock guards the index; the copies in and out run outside it (a block evicted while
a request copies it stays alive until that request lets go of it).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rngd_pd.devices.runtime import cat_into
from rngd_pd.engine.kv_events import hashing, messages
from rngd_pd.engine.kv_events.publisher import EventSink
from rngd_pd.errors import ConfigError

KVList = list[tuple[Any, Any]]  # per layer (K, V) [kv_heads, T, head_dim]


@dataclass(frozen=True)
class PrefixStats:
    """Counters since start (tokens), and what the cache holds now."""

    queried_tokens: int
    hit_tokens: int
    blocks: int
    bytes: int
    capacity_bytes: int
    evicted_blocks: int

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from the cache over prompt tokens looked up (0 before any)."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


def _runs(numbers: Sequence[int]) -> list[list[int]]:
    """Consecutive runs of increasing block numbers ([0, 1, 2, 5, 6] -> [[0, 1, 2], [5, 6]])."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and runs[-1][-1] == n - 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return runs


class PrefixCache:
    """LRU of KV blocks by prefix (module docstring); `runtime` allocates the blocks (DeviceRuntime)."""

    def __init__(self, runtime: Any, num_layers: int, kv_heads: int, head_dim: int, kv_dtype: Any,
                 capacity_bytes: int, block: int = 16, events: EventSink | None = None) -> None:
        if block < 1 or capacity_bytes < 0:
            raise ConfigError(f"prefix cache: block >= 1 and capacity >= 0 needed, got {block}, "
                              f"{capacity_bytes}")
        self.runtime, self.kv_dtype, self.block = runtime, kv_dtype, block
        self.shape = (num_layers, 2, kv_heads, block, head_dim)
        probe = runtime.empty((1,), kv_dtype)
        self.block_bytes = int(np.prod(self.shape)) * probe.element_size()
        self.capacity_bytes = capacity_bytes
        self.root = hashing.none_hash()
        self.events = events
        self._blocks: OrderedDict[bytes, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._queried = self._hits = self._evicted = 0
        self._publish([messages.AllBlocksCleared()])

    @property
    def max_blocks(self) -> int:
        return self.capacity_bytes // self.block_bytes

    def hashes(self, ids: np.ndarray) -> list[bytes]:
        """The names of the full blocks of `ids` (vLLM's block hashes); pass them to match and
        insert so a prompt is hashed once."""
        return hashing.block_hashes(np.asarray(ids).tolist(), self.block, self.root)

    def match(self, ids: np.ndarray, names: Sequence[bytes] | None = None, own_tokens: int = 0,
              leave: int = 1) -> tuple[int, list[Any]]:
        """(cached tokens, their blocks in order) for the longest cached prefix of `ids` that leaves
        at least `leave` tokens to compute (a prompt's first token needs its last position's logits);
        counts the lookup for the hit rate except its first `own_tokens`, which earlier chunks of the
        same request looked up (PrefillEngine.cache_prefix)."""
        names = (self.hashes(ids) if names is None else names)[:(len(ids) - leave) // self.block]
        with self._lock:
            found = []
            for name in names:
                tensor = self._blocks.get(name)
                if tensor is None:
                    break
                found.append((name, tensor))
            for name, _ in reversed(found):  # deepest first: parents end up most recent
                self._blocks.move_to_end(name)
            self._queried += len(ids) - min(own_tokens, len(ids))
            self._hits += max(0, len(found) * self.block - own_tokens)
        return len(found) * self.block, [t for _, t in found]

    def present(self, names: Sequence[bytes]) -> int:
        """Tokens of the leading blocks `names` that are cached now (no lookup counted, no LRU refresh)."""
        with self._lock:
            n = next((i for i, name in enumerate(names) if name not in self._blocks), len(names))
        return n * self.block

    def fill(self, blocks: Sequence[Any], kv: KVList) -> None:
        """Copy cached blocks into positions [0, len(blocks) * block) of per-layer buffers: one
        concatenation per layer and K/V straight into the buffer (a copy per block and layer took
        twice the CPU: 38 against 20 ms for 2,048 tokens in 16-token blocks of SmolLM2 here)."""
        if not blocks:
            return
        end = len(blocks) * self.block
        for layer, (k, v) in enumerate(kv):
            cat_into([t[layer, 0] for t in blocks], 1, k[:, :end])
            cat_into([t[layer, 1] for t in blocks], 1, v[:, :end])

    def insert(self, ids: np.ndarray, kv: KVList, cached_tokens: int = 0,
               names: Sequence[bytes] | None = None) -> int:
        """Store the full blocks of the prompt `ids` whose KV is `kv` ([kv_heads, >= len, head_dim] per
        layer) beyond the first `cached_tokens`; returns how many blocks were added."""
        if self.max_blocks == 0:
            return 0
        names = self.hashes(ids) if names is None else names
        first = cached_tokens // self.block
        with self._lock:
            todo = [(n, name) for n, name in enumerate(names) if n >= first and name not in self._blocks]
        todo = todo[:self.max_blocks]
        tensors = self._copy_out(kv, [n for n, _ in todo])
        added = [(n, name, tensor) for (n, name), tensor in zip(todo, tensors, strict=True)]
        with self._lock:
            stored = []
            for n, name, tensor in added:
                if name not in self._blocks:  # another prefill may have stored it meanwhile
                    self._blocks[name] = tensor
                    stored.append(n)
            for name in reversed(names):  # the prompt's chain: parents most recent
                if name in self._blocks:
                    self._blocks.move_to_end(name)
            evicted = []
            while len(self._blocks) > self.max_blocks:
                evicted.append(self._blocks.popitem(last=False)[0])
                self._evicted += 1
            self._publish(self._stored_events(ids, names, stored) +
                          ([messages.removed([hashing.external(h) for h in evicted])] if evicted else []))
        return len(stored)

    def _copy_out(self, kv: KVList, numbers: list[int]) -> list[Any]:
        """One tensor per block `numbers` of `kv` (outside the lock): per run of consecutive blocks,
        one copy per layer and K/V into a staging tensor, then a clone per block (each block owns its
        memory, so evicting one frees it)."""
        out, b = [], self.block
        for run in _runs(numbers):
            m, start = len(run), run[0] * b
            heads, dim = self.shape[2], self.shape[4]
            staging = self.runtime.empty((m, *self.shape), self.kv_dtype)
            for layer, (k, v) in enumerate(kv):  # [H, m*b, D] -> [m, H, b, D]
                for kind, src in ((0, k), (1, v)):
                    run_kv = src[:, start:start + m * b].reshape(heads, m, b, dim)
                    staging[:, layer, kind].copy_(run_kv.transpose(0, 1))
            out.extend(t.clone() for t in staging.unbind(0))
        return out

    def _stored_events(self, ids: np.ndarray, names: Sequence[bytes], stored: list[int]) -> list:
        """One BlockStored per run of consecutive new blocks, with the block before it as parent."""
        events, b = [], self.block
        for run in _runs(stored):
            parent = hashing.external(names[run[0] - 1]) if run[0] else None
            tokens = np.asarray(ids[run[0] * b:(run[-1] + 1) * b]).tolist()
            events.append(messages.stored([hashing.external(names[n]) for n in run], parent, tokens, b))
        return events

    def _publish(self, events: list) -> None:
        if self.events is not None and events:
            self.events.publish(events)

    def clear(self) -> None:
        """Drop every block (a model reload or a weight update makes them stale)."""
        with self._lock:
            self._blocks.clear()
            self._publish([messages.AllBlocksCleared()])

    def stats(self) -> PrefixStats:
        with self._lock:
            n = len(self._blocks)
            return PrefixStats(self._queried, self._hits, n, n * self.block_bytes, self.capacity_bytes,
                               self._evicted)
