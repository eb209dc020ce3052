"""Publishes nixl-ucx descriptors to the relay from a background thread, in push order.

Why: push is called from prefill's per-layer hook. Once the blob is in the arena the bytes are the
transport's; waiting for the relay's acknowledgement of a ~500-byte descriptor (a round trip through
another process) would stall prefill for every layer. The thread sends descriptors first in, first
out, so a request's handle (pushed last) is still published last. A failed publication frees the
blob's slot and is raised by the next push or flush, naming the blob.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

from rngd_pd.errors import TransportError, TransportTimeoutError
from rngd_pd.kv.relay.tcp import RelayClient

# (key, index, descriptor bytes, slot token)
Item = tuple[str, int, bytes, str]


class Publisher:
    """FIFO of descriptors put into the relay by one daemon thread (started on first use)."""

    def __init__(self, relay: RelayClient, on_failure: Callable[[str], None]) -> None:
        self.relay, self.on_failure = relay, on_failure
        self._queue: collections.deque[Item] = collections.deque()
        self._cond = threading.Condition()
        self._pending = 0
        self._error: TransportError | None = None
        self._thread: threading.Thread | None = None
        self._closing = False

    def submit(self, key: str, index: int, raw: bytes, token: str) -> None:
        """Queue one descriptor; raises an earlier publication's failure first."""
        with self._cond:
            self._raise_error()
            if self._closing:
                raise TransportError("this nixl-ucx transport is closed", key=key)
            self._queue.append((key, index, raw, token))
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="nixl-ucx-publish", daemon=True)
                self._thread.start()
            self._cond.notify()

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every submitted descriptor is in the relay; raise a failed publication."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransportTimeoutError(f"{self._pending} nixl-ucx descriptors still unpublished "
                                                f"after {timeout:g} s; is the relay at "
                                                f"{self.relay.addr[0]}:{self.relay.addr[1]} slow?")
                self._cond.wait(remaining)
            self._raise_error()

    def close(self, timeout: float = 30.0) -> None:
        """Publish what is queued, then stop the thread."""
        try:
            self.flush(timeout)
        finally:
            with self._cond:
                self._closing = True
                self._cond.notify_all()
            if self._thread is not None:
                self._thread.join(timeout)

    def _raise_error(self) -> None:
        err, self._error = self._error, None
        if err is not None:
            try:
                raise err
            finally:
                del err  # a handed-over exception (rngd_pd.errors): no frame may keep it

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                key, index, raw, token = self._queue.popleft()
            try:
                self.relay.put(key, index, raw)
            except Exception as exc:
                if token:
                    self.on_failure(token)
                with self._cond:
                    self._error = self._error or TransportError(
                        f"publishing the descriptor of blob {index} to the relay failed: {exc}", key=key)
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()
