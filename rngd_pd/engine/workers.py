"""A fixed pool of request workers with an admission bound, for the work that blocks per request.

pd and colocated run each request's orchestration on a worker (it waits on BLS calls, or on the
engine's token events), pd reads each decode stream on another, and the decode engine pulls each
request's KV on one of its loaders. A pool's threads are all started
when the model instance is, and they are the only ones it ever has: the thread count of a stub does
not change with the requests it serves. `workers` requests run at once and `max_queue` wait; past
that a request fails at once with CapacityError (UNAVAILABLE), as a full decode queue does.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from rngd_pd import errors

log = logging.getLogger(__name__)


class RequestPool:
    """`submit(fn, ...)` runs fn on one of `workers` long-lived threads; thread-safe."""

    def __init__(self, name: str, workers: int, max_queue: int) -> None:
        if workers < 1 or max_queue < 0:
            raise errors.ConfigError(f"{name}: max_inflight >= 1 and max_queue >= 0 needed, "
                                     f"got {workers}, {max_queue}")
        self.name, self.workers, self.max_queue = name, workers, max_queue
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._admitted = 0
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> threading.Event:
        """Queue `fn(*args)`; the returned event is set when it has run. CapacityError when
        `workers + max_queue` calls are already admitted and unfinished."""
        with self._lock:
            if self._admitted >= self.workers + self.max_queue:
                raise errors.CapacityError(
                    f"{self.name}: {self._admitted} requests in flight (max_inflight={self.workers}, "
                    f"max_queue={self.max_queue}); retry later or raise those parameters")
            self._admitted += 1
        done = threading.Event()
        self._queue.put((fn, args, done))
        return done

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, args, done = item
            try:
                fn(*args)
            except BaseException:  # the callers end their requests themselves; this is a bug
                log.exception("%s: a request worker raised", self.name)
            finally:
                with self._lock:
                    self._admitted -= 1
                done.set()
                # the idle wait for the next item must not hold this one: its arguments (a Triton
                # request and its response sender) then outlived it, and Triton never unloaded the model
                del item, fn, args, done

    def in_flight(self) -> int:
        with self._lock:
            return self._admitted

    def close(self, wait_s: float = 0.0) -> None:
        """Let the threads end once the queued work is done; wait up to `wait_s` for them (a process
        that exits with them still running can abort in native teardown: "terminate called ...")."""
        for _ in self._threads:
            self._queue.put(None)
        deadline = time.monotonic() + wait_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
