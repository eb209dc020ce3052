"""The request pool (rngd_pd.engine.workers): what it holds once a request has run."""

from __future__ import annotations

import gc
import time
import weakref

from rngd_pd.engine.workers import RequestPool


class _Request:
    """Stands for a Triton request and its response sender, which must not outlive the request."""


def test_an_idle_worker_holds_nothing_of_the_request_it_ran() -> None:
    """A worker waiting for its next request held the last one's arguments: in a stub that kept a
    Triton request (and its response sender) alive after it ended."""
    pool = RequestPool("test", workers=2, max_queue=0)
    try:
        request = _Request()
        alive = weakref.ref(request)
        gc.disable()
        try:
            pool.submit(lambda r: None, request).wait(5)
            del request
            deadline = time.monotonic() + 5
            while alive() is not None and time.monotonic() < deadline:  # its done event is set first
                time.sleep(0.01)
            assert alive() is None
            assert pool.in_flight() == 0
        finally:
            gc.enable()
    finally:
        pool.close(wait_s=5)
