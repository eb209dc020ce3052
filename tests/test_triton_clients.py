"""RetiredIterators: a finished BLS stream is released only after a fence proves the stub let go of it."""

from __future__ import annotations

import gc
import time
import weakref

import pytest

from rngd_pd.triton.clients import RetiredIterators


class _Iterator:  # stands in for the stub's ResponseIterator: we only care when the last reference goes
    pass


def _retire_one(retired: RetiredIterators) -> weakref.ref:
    """Retire an iterator nobody else holds; the weak reference tells when its last reference went."""
    it = _Iterator()
    ref = weakref.ref(it)
    retired.retire(it)
    return ref


def test_a_retired_iterator_lives_until_a_fence_that_started_after_it() -> None:
    retired = RetiredIterators()
    ref = _retire_one(retired)
    gc.collect()
    assert ref() is not None and len(retired) == 1

    seen_during_probe = []

    def probe() -> bool:
        seen_during_probe.append(ref() is not None)  # still alive while the round trip runs
        return True

    assert retired.fenced(probe) is True
    gc.collect()
    assert seen_during_probe == [True]
    assert ref() is None and len(retired) == 0


def test_an_iterator_retired_during_the_probe_waits_for_the_next_fence() -> None:
    retired = RetiredIterators()
    late = [_Iterator()]
    ref = weakref.ref(late[0])

    def probe() -> bool:
        retired.retire(late.pop())  # its cleanup may be queued behind this probe: not proven yet
        return False

    assert retired.fenced(probe) is False
    gc.collect()
    assert ref() is not None and len(retired) == 1
    retired.fenced(lambda: False)
    gc.collect()
    assert ref() is None


def test_a_failed_probe_keeps_the_iterators_for_the_next_fence() -> None:
    retired = RetiredIterators()
    retired.retire(_Iterator())

    def probe() -> bool:
        raise RuntimeError("stub gone")

    with pytest.raises(RuntimeError, match="stub gone"):
        retired.fenced(probe)
    assert len(retired) == 1


def test_drain_waits_for_the_newest_to_settle_then_drops_all() -> None:
    import time

    retired = RetiredIterators()
    ref = _retire_one(retired)
    t0 = time.monotonic()
    retired.drain(settle_s=0.2)
    gc.collect()
    assert time.monotonic() - t0 >= 0.15 and ref() is None and len(retired) == 0
    t0 = time.monotonic()
    retired.drain(settle_s=0.2)  # nothing newer: no wait beyond what has passed
    assert time.monotonic() - t0 < 0.15


def test_drop_settled_lets_go_only_of_those_retired_long_enough_ago() -> None:
    retired = RetiredIterators()
    old = _retire_one(retired)
    time.sleep(0.3)
    new = _retire_one(retired)
    assert retired.drop_settled(0.2) == 1 and len(retired) == 1
    gc.collect()
    assert old() is None and new() is not None
    assert retired.fenced(lambda: None) is None and len(retired) == 0
