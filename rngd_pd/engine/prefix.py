"""Prefix reuse: a bounded LRU of prompt KV by token block, so a shared prefix is computed once.

A prompt's ids are cut into blocks of `block` tokens; block i is named by a digest of block i-1's name
and its own ids, so a name stands for the whole prefix up to it (two prompts share block i's KV exactly
when they share every token up to its end). The cache maps names to one tensor per block,
[layers, 2 (K, V), kv_heads, block, head_dim] in the KV dtype, in the runtime's memory (host memory on
a CPU). `match` finds the longest cached run of leading blocks, leaving at least one prompt token to
compute (the first token's logits need it); `insert` stores the prompt's full blocks that were not
cached. Eviction is least-recently-used by block; a match refreshes a chain deepest block first, so a
parent always outlives its children and every cached block stays reachable.

Thread-safe: one lock guards the index; the copies in and out run outside it (a block evicted while
a request copies it stays alive until that request lets go of it).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

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


def block_names(ids: np.ndarray, block: int) -> list[bytes]:
    """The name of each full block of `ids` (a digest chained over every earlier block)."""
    names, parent = [], b""
    for start in range(0, len(ids) - block + 1, block):
        parent = hashlib.blake2b(parent + ids[start:start + block].tobytes(), digest_size=16).digest()
        names.append(parent)
    return names


class PrefixCache:
    """LRU of KV blocks by prefix (module docstring); `runtime` allocates the blocks (DeviceRuntime)."""

    def __init__(self, runtime: Any, num_layers: int, kv_heads: int, head_dim: int, kv_dtype: Any,
                 capacity_bytes: int, block: int = 32) -> None:
        if block < 1 or capacity_bytes < 0:
            raise ConfigError(f"prefix cache: block >= 1 and capacity >= 0 needed, got {block}, "
                              f"{capacity_bytes}")
        self.runtime, self.kv_dtype, self.block = runtime, kv_dtype, block
        self.shape = (num_layers, 2, kv_heads, block, head_dim)
        probe = runtime.empty((1,), kv_dtype)
        self.block_bytes = int(np.prod(self.shape)) * probe.element_size()
        self.capacity_bytes = capacity_bytes
        self._blocks: OrderedDict[bytes, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._queried = self._hits = self._evicted = 0

    @property
    def max_blocks(self) -> int:
        return self.capacity_bytes // self.block_bytes

    def match(self, ids: np.ndarray) -> tuple[int, list[Any]]:
        """(cached tokens, their blocks in order) for the longest cached prefix of `ids` that leaves
        at least one token to compute; counts the lookup for the hit rate."""
        names = block_names(ids[:len(ids) - 1], self.block)
        with self._lock:
            found = []
            for name in names:
                tensor = self._blocks.get(name)
                if tensor is None:
                    break
                found.append((name, tensor))
            for name, _ in reversed(found):  # deepest first: parents end up most recent
                self._blocks.move_to_end(name)
            self._queried += len(ids)
            self._hits += len(found) * self.block
        return len(found) * self.block, [t for _, t in found]

    def fill(self, blocks: Sequence[Any], kv: KVList) -> None:
        """Copy cached blocks into positions [0, len(blocks) * block) of per-layer buffers."""
        b = self.block
        for n, tensor in enumerate(blocks):
            for layer, (k, v) in enumerate(kv):
                k[:, n * b:(n + 1) * b].copy_(tensor[layer, 0])
                v[:, n * b:(n + 1) * b].copy_(tensor[layer, 1])

    def insert(self, ids: np.ndarray, kv: KVList, cached_tokens: int = 0) -> int:
        """Store the full blocks of the prompt `ids` whose KV is `kv` ([kv_heads, >= len, head_dim] per
        layer) beyond the first `cached_tokens`; returns how many blocks were added."""
        if self.max_blocks == 0:
            return 0
        names = block_names(ids, self.block)
        first = cached_tokens // self.block
        with self._lock:
            todo = [(n, name) for n, name in enumerate(names) if n >= first and name not in self._blocks]
        todo = todo[:self.max_blocks]
        added = []
        b = self.block
        for n, name in todo:  # copied outside the lock
            tensor = self.runtime.empty(self.shape, self.kv_dtype)
            for layer, (k, v) in enumerate(kv):
                tensor[layer, 0].copy_(k[:, n * b:(n + 1) * b])
                tensor[layer, 1].copy_(v[:, n * b:(n + 1) * b])
            added.append((name, tensor))
        with self._lock:
            for name, tensor in added:
                self._blocks[name] = tensor
            for name in reversed(names):  # the prompt's chain: parents most recent
                if name in self._blocks:
                    self._blocks.move_to_end(name)
            while len(self._blocks) > self.max_blocks:
                self._blocks.popitem(last=False)
                self._evicted += 1
        return len(added)

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()

    def stats(self) -> PrefixStats:
        with self._lock:
            n = len(self._blocks)
            return PrefixStats(self._queried, self._hits, n, n * self.block_bytes, self.capacity_bytes,
                               self._evicted)
