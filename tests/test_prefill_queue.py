"""pd's prefill queue (rngd_pd.engine.prefill_queue): shortest remaining prefill first, aging, one
prompt per server at a time, cancellation; threads are real, every wait bounded."""

from __future__ import annotations

import threading
import time

import pytest

from rngd_pd import errors
from rngd_pd.engine.prefill_queue import PrefillQueue

WAIT_S = 5.0


def _order(queue: PrefillQueue, prompts: list[tuple[str, int, float]]) -> list[str]:
    """Hold server "s", let `prompts` (name, tokens left, arrived) line up behind it, release it;
    the names in the order they got their turn."""
    got: list[str] = []
    lock = threading.Lock()
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with queue.turn("s", 1, time.monotonic()):
            holding.set()
            release.wait(WAIT_S)

    def wait(name: str, tokens: int, arrived: float) -> None:
        with queue.turn("s", tokens, arrived), lock:
            got.append(name)

    threads = [threading.Thread(target=hold)]
    threads[0].start()
    assert holding.wait(WAIT_S)
    for name, tokens, arrived in prompts:
        threads.append(threading.Thread(target=wait, args=(name, tokens, arrived)))
        threads[-1].start()
    deadline = time.monotonic() + WAIT_S
    while queue.depth().get("s", (0, 0))[1] < len(prompts) and time.monotonic() < deadline:
        time.sleep(0.01)
    release.set()
    for t in threads:
        t.join(WAIT_S)
    assert queue.depth() == {}
    return got


def test_the_shortest_waiting_prompt_goes_first() -> None:
    now = time.monotonic()
    got = _order(PrefillQueue(slots=1, aging=1000.0), [("long", 1536, now), ("short", 128, now + 0.001),
                                                      ("mid", 512, now + 0.002)])
    assert got == ["short", "mid", "long"]


def test_a_long_prompt_that_waited_long_enough_goes_before_a_fresh_short_one() -> None:
    now = time.monotonic()
    # 1536 - 1000 x 2 s < 128: the long prompt's two seconds of waiting outweigh its length
    got = _order(PrefillQueue(slots=1, aging=1000.0), [("short", 128, now), ("long", 1536, now - 2.0)])
    assert got == ["long", "short"]
    got = _order(PrefillQueue(slots=1, aging=0.0), [("short", 128, now), ("long", 1536, now - 2.0)])
    assert got == ["short", "long"]


def test_slots_bound_the_prompts_in_one_server_not_in_others() -> None:
    queue = PrefillQueue(slots=2)
    inside = threading.Semaphore(0)
    release = threading.Event()
    peak = [0]

    def run(server: str) -> None:
        with queue.turn(server, 10, time.monotonic()):
            peak[0] = max(peak[0], queue.depth()[server][0])
            inside.release()
            release.wait(WAIT_S)

    threads = [threading.Thread(target=run, args=(s,)) for s in ("a", "a", "a", "b")]
    for t in threads:
        t.start()
    for _ in range(3):  # two of "a" and the one of "b" get in; the third of "a" waits
        assert inside.acquire(timeout=WAIT_S)
    assert not inside.acquire(timeout=0.2)
    assert queue.depth() == {"a": (2, 1), "b": (1, 0)}
    release.set()
    assert inside.acquire(timeout=WAIT_S)
    for t in threads:
        t.join(WAIT_S)
    assert peak[0] == 2 and queue.depth() == {}


def test_a_cancelled_waiter_leaves_the_queue_and_the_others_go_on() -> None:
    queue = PrefillQueue(slots=1)
    holding, release, cancel = threading.Event(), threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def hold() -> None:
        with queue.turn("s", 1, time.monotonic()):
            holding.set()
            release.wait(WAIT_S)

    def wait(name: str, cancelled) -> None:
        try:
            with queue.turn("s", 100, time.monotonic(), cancelled):
                outcome[name] = "ran"
        except errors.RequestCancelled as exc:
            outcome[name] = exc

    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(WAIT_S)
    doomed = threading.Thread(target=wait, args=("doomed", cancel.is_set))
    other = threading.Thread(target=wait, args=("other", lambda: False))
    doomed.start()
    other.start()
    cancel.set()
    doomed.join(WAIT_S)
    assert isinstance(outcome["doomed"], errors.RequestCancelled)
    assert queue.depth() == {"s": (1, 1)}
    release.set()
    for t in (holder, other):
        t.join(WAIT_S)
    assert outcome["other"] == "ran" and queue.depth() == {}


def test_an_error_inside_the_turn_gives_it_back() -> None:
    queue = PrefillQueue(slots=1)
    with pytest.raises(RuntimeError), queue.turn("s", 5, time.monotonic()):
        raise RuntimeError("prefill failed")
    assert queue.depth() == {}
    with queue.turn("s", 5, time.monotonic()):
        assert queue.depth() == {"s": (1, 0)}


def test_no_slots_means_no_queue() -> None:
    queue = PrefillQueue(slots=0)
    with queue.turn("s", 5, time.monotonic()), queue.turn("s", 5, time.monotonic()):
        assert queue.depth() == {}
    with pytest.raises(errors.ConfigError, match="aging"):
        PrefillQueue(aging=-1)
