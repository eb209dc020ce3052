"""Which waiting prompt a prefill server takes next: shortest remaining prefill first, with aging.

A prefill instance runs one prompt at a time and Triton's queue in front of it is first come, first
served, so a 128-token prompt that arrives behind a 1536-token one waited for all of it (head-of-line
blocking: TTFT p50 of short prompts 2-7x their prefill under mixed open-loop traffic, issue 31).
pd holds its prompts here instead and lets `slots` of them into each prefill server at once (its
instance count); the next one is the waiting prompt with the fewest tokens left to prefill, where
each second of waiting counts as `aging` tokens less, so a long prompt is not starved. The
orchestrator sends a long prompt in chunks, each chunk a turn of its own
(`rngd_pd.engine.orchestrator`), so a short prompt waits for one chunk at most, not a whole prompt.

Score = tokens left - aging x seconds waited = tokens left + aging x arrival - aging x now; the last
term is the same for every waiter, so the order is fixed at arrival and a heap keeps it.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from rngd_pd import errors

POLL_S = 0.05  # how often a waiting prompt looks at its client's cancel flag


@dataclass
class _Server:
    running: int = 0
    waiting: list[tuple[float, int]] = field(default_factory=list)  # heap of (score, ticket)


class PrefillQueue:
    """Turns at the prefill servers, by server name (thread-safe); slots <= 0 lets every prompt in
    at once (Triton's own first-come order)."""

    def __init__(self, slots: int = 1, aging: float = 1000.0) -> None:
        """slots: prompts in one prefill server at once; aging: prompt tokens a second of waiting is
        worth (1000: a 1536-token prompt goes before a fresh 128-token one after 1.4 s)."""
        if aging < 0:
            raise errors.ConfigError(f"prefill aging must be >= 0 tokens per second, got {aging}")
        self.slots, self.aging = slots, aging
        self._servers: dict[str, _Server] = {}
        self._cond = threading.Condition()
        self._tickets = itertools.count()

    @contextmanager
    def turn(self, server: str, tokens_left: int, arrived: float,
             cancelled: Callable[[], bool] = lambda: False) -> Iterator[None]:
        """Wait until this prompt may use `server`, hold the turn for the `with` body.

        arrived: when the request came (time.monotonic()), the same for each of its chunks, so a
        prompt's later chunks keep its age. Raises RequestCancelled once `cancelled()` is true."""
        if self.slots <= 0:
            yield
            return
        entry = (tokens_left + self.aging * (arrived - _EPOCH), next(self._tickets))
        with self._cond:
            state = self._servers.setdefault(server, _Server())
            heapq.heappush(state.waiting, entry)
            try:
                while state.running >= self.slots or state.waiting[0] != entry:
                    if cancelled():
                        raise errors.RequestCancelled("the client cancelled the request while its prompt "
                                                      "waited for prefill")
                    self._cond.wait(POLL_S)
            except BaseException:
                state.waiting.remove(entry)
                heapq.heapify(state.waiting)
                self._changed(server, state)
                raise
            heapq.heappop(state.waiting)
            state.running += 1
        try:
            yield
        finally:
            with self._cond:
                state.running -= 1
                self._changed(server, state)

    def _changed(self, server: str, state: _Server) -> None:
        """A prompt left `server`'s queue or turn (under the condition): forget an idle server, wake
        the waiters."""
        if not state.running and not state.waiting:
            del self._servers[server]
        self._cond.notify_all()

    def depth(self) -> dict[str, tuple[int, int]]:
        """{server: (prompts running, prompts waiting)}, for metrics and tests."""
        with self._cond:
            return {name: (s.running, len(s.waiting)) for name, s in self._servers.items()}


_EPOCH = time.monotonic()  # keeps scores small (aging x seconds since start, not since boot)
