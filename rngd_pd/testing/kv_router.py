"""A small event-scored router: the test-side stand-in for llm-d's endpoint picker with its precise
prefix-cache scorer. It knows only what the pods publish (KV events, rngd_pd.engine.kv_events) and the
prompt's tokens: per pod the set of block hashes stored and not removed since its last
AllBlocksCleared; a prompt's score on a pod is the length of the longest run of its leading block
hashes (vLLM's chain, hashed here from the tokens) that the pod holds, as the llm-d indexer's
longest-prefix scorer computes it. The best score wins; ties go round-robin, so a prompt no pod has
seen spreads the load.

With `inflight` (requests running per pod, which the caller counts) the score is llm-d's default
prefill profile instead: 2 x the share of the prompt's blocks the pod holds + 1 x a queue score (1 for
the least busy pod, 0 for the busiest), so a new conversation whose only cached part is a shared
system prompt goes to an idle pod, while a returning one stays with its history.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from rngd_pd.engine.kv_events import hashing, messages
from rngd_pd.engine.kv_events.subscriber import Subscriber


class PodIndex:
    """What one pod holds, from its events alone."""

    def __init__(self) -> None:
        self.blocks: set[int] = set()
        self.batches = 0

    def apply(self, batch: messages.KVEventBatch) -> None:
        self.batches += 1
        for event in batch.events:
            if isinstance(event, messages.AllBlocksCleared):
                self.blocks.clear()
            elif isinstance(event, messages.BlockStored):
                self.blocks.update(event.block_hashes)
            elif isinstance(event, messages.BlockRemoved):
                self.blocks.difference_update(event.block_hashes)

    def score(self, hashes: Sequence[int]) -> int:
        """Leading blocks of the prompt this pod holds (stops at the first it does not)."""
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n


class EventRouter:
    """Routes prompts among pods by their published events; `subscribers[name]` feeds pod `name`."""

    def __init__(self, subscribers: dict[str, Subscriber], block_size: int, seed_env: dict | None = None
                 ) -> None:
        self.subscribers = subscribers
        self.block_size = block_size
        self.root = hashing.none_hash(seed_env)
        self.pods = {name: PodIndex() for name in subscribers}
        self._ties = itertools.count()

    def refresh(self, timeout_ms: int = 0) -> None:
        """Apply every batch that has arrived (waiting up to `timeout_ms` on each pod)."""
        for name, sub in self.subscribers.items():
            for received in sub.poll(timeout_ms):
                self.pods[name].apply(received.batch)

    def scores(self, ids: Sequence[int]) -> dict[str, int]:
        hashes = [hashing.external(h) for h in hashing.block_hashes(list(ids), self.block_size, self.root)]
        return {name: pod.score(hashes) for name, pod in self.pods.items()}

    def route(self, ids: Sequence[int], inflight: Mapping[str, int] | None = None) -> tuple[str, int]:
        """(pod, cached tokens it is expected to hold) for a prompt (module docstring)."""
        self.refresh()
        blocks = self.scores(ids)
        total = max(1, len(ids) // self.block_size)
        if inflight is None:
            scores: dict[str, float] = {name: float(b) for name, b in blocks.items()}
        else:
            low, high = min(inflight.values()), max(inflight.values())
            queue = {n: 1.0 if high == low else 1 - (inflight[n] - low) / (high - low) for n in blocks}
            scores = {n: 2 * blocks[n] / total + queue[n] for n in blocks}
        best = max(scores.values())
        tied = [name for name, s in scores.items() if s == best]
        pod = tied[next(self._ties) % len(tied)]
        return pod, blocks[pod] * self.block_size
