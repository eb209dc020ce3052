"""One response sender per model instance, as NVIDIA's own decoupled backends do it.

`ResponseLoop` owns one thread that builds and sends every response of its model instance and checks
the live requests' `is_cancelled()` at a bounded rate (one pass every `poll_s`, however many requests
or tokens there are). Request workers and engine threads only put outputs on its queue, so:

* no engine or scheduler thread ever waits on Triton's IPC to send a token;
* each response is built from exactly the receiver's requested outputs (`pbutils.make_response`),
  on one thread that holds the GIL, and every request gets exactly one final response, even when a
  worker sends after it (ignored) or never sends one (`ResponseLoop.close` fails what is left);
* a cancelled request is noticed once per pass: its `Stream.cancelled` event is set and its
  `on_cancel` hook runs on the loop thread (keep it quick: flag work, do not wait for it).

`fence` wraps each cancel pass (a run of blocking round trips to Triton's parent process); pd passes
`clients.RETIRED.fenced` there, which lets finished BLS iterators go only after such a round trip.
`health` is asked once a pass; when it returns an error, every live request ends with it at once (pd:
a model it calls by BLS lost its stub, which Triton 2.51 never reports to a waiting BLS call).
`idle` runs instead when no request is live (pd: `RETIRED.drop_settled`, so the last iterators of a
burst do not wait for the next request: held, they kept Triton from unloading pd).

When the instance has been idle for `GC_SETTLE_S` after a request ended, the loop also runs the
cyclic GC once (at most every `GC_GAP_S`): a request object caught in a reference cycle (an
exception's traceback, rngd_pd.errors) is otherwise freed only whenever allocations next trigger a
collection, which an idle stub never makes, and Triton cannot unload a model while one of its
requests lives. The settle time lets the request's last holders (its worker's frame, this loop's
last item, retired BLS iterators) let go first, so what is left is only what a cycle holds.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from rngd_pd import errors
from rngd_pd.stubs import pbutils
from rngd_pd.wire.tensors import ModelSpec

POLL_S = 0.1  # how often the live requests' cancel flags are read (each read is an IPC round trip)
GC_SETTLE_S = 2.0  # idle this long after a request ended before collecting (module docstring)
GC_GAP_S = 5.0  # at most one idle collection per this long (a full one holds the GIL for ~10-100 ms)
_STOP = object()


class Stream:
    """One decoupled request as its workers see it: send outputs, fail it, see whether it was cancelled.

    Thread-safe: any thread may call `send` / `fail`; the loop sends in call order.
    """

    def __init__(self, loop: ResponseLoop, request: Any, spec: ModelSpec, ident: int) -> None:
        self._loop, self.request, self.spec, self.ident = loop, request, spec, ident
        self.sender = request.get_response_sender()
        self.requested = pbutils.requested_outputs(request)
        self.cancelled = threading.Event()
        self.on_cancel: Callable[[], None] | None = None
        # set when the caller takes errors in band (pd inside llm): the error -> a final response's outputs
        self.in_band: Callable[[BaseException], Mapping[str, Any]] | None = None
        self.done = False  # the final response went out (loop thread only)

    def send(self, outputs: Mapping[str, Any], final: bool = False) -> None:
        """Queue one response carrying `outputs` ({name: value}); `final` closes the request."""
        self._loop.put(self, outputs, final)

    def fail(self, exc: BaseException) -> None:
        """Queue the request's final response: the error for `exc` (in band when `in_band` is set)."""
        self._loop.put(self, exc, True)


class ResponseLoop:
    """The sender thread of one model instance (see the module docstring)."""

    def __init__(self, name: str, poll_s: float = POLL_S,
                 fence: Callable[[Callable[[], None]], Any] | None = None,
                 idle: Callable[[], Any] | None = None,
                 health: Callable[[], BaseException | None] | None = None) -> None:
        self.name, self.poll_s = name, poll_s
        self._fence = fence or (lambda probe: probe())
        self._idle = idle
        self._health = health
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._live: dict[int, Stream] = {}
        self._ids = itertools.count()
        self.sent = 0
        self._gc_due = False  # a request ended since the last idle collection
        self._ended_at = self._gc_at = 0.0
        self._thread = threading.Thread(target=self._run, name=f"{name}-sender", daemon=True)
        self._thread.start()

    def open(self, request: Any, spec: ModelSpec) -> Stream:
        """Register a new decoupled request (call from `execute`)."""
        stream = Stream(self, request, spec, next(self._ids))
        with self._lock:
            self._live[stream.ident] = stream
        return stream

    def put(self, stream: Stream, payload: Mapping[str, Any] | BaseException, final: bool) -> None:
        self._queue.put((stream, payload, final))

    def live(self) -> int:
        """Requests registered and not yet finished."""
        with self._lock:
            return len(self._live)

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, fail every request still open, stop the thread."""
        self._queue.put(_STOP)
        self._thread.join(timeout)

    # ---- the loop thread -------------------------------------------------------------------------
    def _run(self) -> None:
        next_poll = time.monotonic() + self.poll_s
        while True:
            try:
                item = self._queue.get(timeout=max(0.0, next_poll - time.monotonic()))
            except queue.Empty:
                item = None
            if item is _STOP:
                self._fail_open()
                return
            if item is not None:
                self._deliver(*item)
            if time.monotonic() >= next_poll:
                self._poll()
                next_poll = time.monotonic() + self.poll_s

    def _deliver(self, stream: Stream, payload: Mapping[str, Any] | BaseException, final: bool) -> None:
        if stream.done:
            return  # one final response per request; later sends (a cancel race) are dropped
        try:
            if isinstance(payload, BaseException) and stream.in_band is not None:
                response = pbutils.make_response(stream.spec, stream.in_band(payload), stream.requested)
            elif isinstance(payload, BaseException):
                response = pbutils.error_response(payload)
            else:
                response = pbutils.make_response(stream.spec, payload, stream.requested)
            pbutils.send(stream.sender, response, final=final)
            self.sent += 1
        except Exception as exc:  # the client is gone or Triton refused: stop the request's work
            pbutils.log(f"{self.name}: sending a response failed ({exc}); ending the request", "verbose")
            if not final:
                # the final flag alone: without it the backend never releases the request, and
                # Triton then waits on this model's unload for ever (seen after a client cancel)
                with contextlib.suppress(Exception):
                    pbutils.send(stream.sender, None, final=True)
            final = True
            self._cancel(stream)
        if final:
            stream.done = True
            with self._lock:
                self._live.pop(stream.ident, None)
            self._gc_due, self._ended_at = True, time.monotonic()

    def _poll(self) -> None:
        failure = self._health() if self._health is not None else None
        if failure is not None:  # what these requests wait on is gone: end them now, naming it
            with self._lock:
                dying = list(self._live.values())
            for s in dying:
                self._deliver(s, failure, True)
                self._cancel(s)
        with self._lock:
            streams = [s for s in self._live.values() if not s.cancelled.is_set()]

        def probe() -> None:
            for s in streams:
                if s.request.is_cancelled():
                    self._cancel(s)

        try:
            if streams:
                self._fence(probe)
            elif self._idle is not None:
                self._idle()
        except Exception as exc:
            pbutils.log(f"{self.name}: reading cancel flags failed: {exc}", "warn")
        if not streams:
            self._collect_when_idle()

    def _collect_when_idle(self) -> None:
        """Free reference cycles that still hold finished requests (module docstring)."""
        now = time.monotonic()
        if (not self._gc_due or now - self._ended_at < GC_SETTLE_S or now - self._gc_at < GC_GAP_S
                or self.live()):
            return
        self._gc_due, self._gc_at = False, now
        found = gc.collect()
        if found:
            pbutils.log(f"{self.name}: idle: freed {found} objects held in reference cycles", "verbose")

    def _cancel(self, stream: Stream) -> None:
        if stream.cancelled.is_set():
            return
        stream.cancelled.set()
        if stream.on_cancel is not None:
            try:
                stream.on_cancel()
            except Exception as exc:
                pbutils.log(f"{self.name}: cancelling a request failed: {exc}", "warn")

    def _fail_open(self) -> None:
        while True:  # what workers queued before close still goes out, in order
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                self._deliver(*item)
        with self._lock:
            left = list(self._live.values())
        for s in left:
            self._deliver(s, errors.RngdPdError("the model is shutting down; retry the request"), True)
