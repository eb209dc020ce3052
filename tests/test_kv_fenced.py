"""FencedTransport over a copy-only transport, and the nixl (HETERO_NPU) adapter's route logic."""

from __future__ import annotations

import threading
import time

import pytest

from rngd_pd.errors import DeviceUnavailableError, TransportError, TransportTimeoutError
from rngd_pd.kv.fenced import FencedTransport, is_copy_only
from rngd_pd.kv.nixl.hetero import ROUTES, NixlBinding, NixlTransport, Tier, plan_route


class FakeCopy:
    """A copy-only transport whose fence opens when the test says so (tests the adapter above it)."""

    name = "fake-copy"

    def __init__(self, ok: bool = True) -> None:
        self.ok, self.fence, self.events = ok, threading.Event(), []

    def plan(self, key, index, src, dst=None):
        self.events.append(("plan", key, index))
        return (key, index)

    def submit(self, plan):
        self.events.append(("submit", *plan))

    def wait(self, plan, timeout):
        return self.fence.wait(timeout) and self.ok

    def close(self):
        self.events.append(("close",))


def test_pull_returns_only_after_the_fence():
    inner = FakeCopy()
    t = FencedTransport(inner)
    assert is_copy_only(inner) and not is_copy_only(t)
    t.push("k", 0, b"kv-bytes")
    assert inner.events == [("plan", "k", 0), ("submit", "k", 0)]
    threading.Timer(0.3, inner.fence.set).start()
    out, t0 = bytearray(16), time.monotonic()
    assert t.pull("k", 0, out, 5.0) == 8 and out[:8] == b"kv-bytes"
    assert time.monotonic() - t0 >= 0.25
    t.release("k")
    with pytest.raises(TransportTimeoutError, match="share one process"):
        t.pull("k", 0, out, 0.1)
    t.close()
    assert inner.events[-1] == ("close",)


def test_failed_fence_is_an_error_not_a_fallback():
    inner = FakeCopy(ok=False)
    inner.fence.set()
    t = FencedTransport(inner)
    t.push("k", 1, b"x")
    with pytest.raises(TransportError, match="completion fence"):
        t.pull("k", 1, bytearray(1), 1.0)


def test_pull_waits_for_a_later_push():
    inner = FakeCopy()
    inner.fence.set()
    t = FencedTransport(inner)
    threading.Timer(0.2, t.push, args=("k", 0, b"late")).start()
    out = bytearray(4)
    assert t.pull("k", 0, out, 5.0) == 4 and out == b"late"


@pytest.mark.parametrize(("src", "dst", "route"), [
    ("rngd", "dmabuf", "direct"), ("rngd", "host", "staging-download"), ("host", "rngd", "staging-upload")])
def test_supported_routes(src, dst, route):
    assert plan_route(src, dst) == route


@pytest.mark.parametrize(("src", "dst", "why"), [
    ("rngd", "rngd", "two legs"), ("atom", "host", "only ever a destination"),
    ("dmabuf", "rngd", "only ever a destination"), ("atom", "atom", "only ever a destination"),
    ("host", "host", "use the shm transport"), ("host", "dmabuf", "no such route")])
def test_refused_routes(src, dst, why):
    with pytest.raises(TransportError, match=why):
        plan_route(src, dst)


def test_every_route_pair_is_decided():
    for s in Tier:
        for d in Tier:
            try:
                plan_route(s, d)
                assert (s, d) in ROUTES
            except TransportError:
                assert (s, d) not in ROUTES


def test_plan_refuses_before_touching_nixl():
    t = NixlTransport.__new__(NixlTransport)  # route checks need no agent
    t._bindings, t._lock = {}, threading.Lock()
    with pytest.raises(TransportError, match="host-tier push is not supported"):
        t.plan("k", 0, b"host bytes")
    with pytest.raises(TransportError, match="two legs"):
        t.bind("k", NixlBinding(src=None, dst=None, src_tier=Tier.RNGD, dst_tier=Tier.RNGD))


def test_missing_plugin_fails_at_construction_with_a_hint():
    with pytest.raises(DeviceUnavailableError, match=r"HETERO_NPU.*NIXL_PLUGIN_DIR"):
        NixlTransport()
