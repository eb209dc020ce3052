"""pd's half of a partial update (rngd_pd.engine.switch), driven with fake prefill/decode clients:
the order of the operations, new requests waiting at the gate (not failing) while the running ones
finish, and an update abandoned (both stages dropped, the gate reopened) when they do not."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from rngd_pd import errors
from rngd_pd.engine.switch import Gate, WeightSwitch
from rngd_pd.wire import tensors as T


class FakeSide:
    """prefill or decode answering weight operations; records them (with the gate's count inside)."""

    def __init__(self, log: list, gate: Gate, changed: list[str]) -> None:
        self.log, self.gate, self.changed = log, gate, changed

    def _answer(self, model: str, inputs: dict) -> dict:
        op = json.loads(inputs[T.WEIGHTS_OP][0])
        self.log.append((model, op["op"], self.gate.inside))
        state = {"fingerprint": "new", "store": "new-fp32",
                 "report": {"changed": self.changed, "old_fingerprint": "old", "new_fingerprint": "new"}}
        return {T.WEIGHTS_STATE: np.array([json.dumps(state).encode()], dtype=np.object_)}

    def infer(self, model, inputs, outputs):
        return self._answer(model, inputs)

    def stream(self, model, inputs, outputs):
        yield self._answer(model, inputs)


def _switch(changed=("model.norm.weight",)):
    gate, log = Gate(), []
    side = FakeSide(log, gate, list(changed))
    return WeightSwitch(side, side, gate), gate, log


def test_stage_both_drain_then_commit_decode_first():
    switch, _, log = _switch()
    result = switch.apply_delta("/ckpt", drain_s=5)
    assert [(m, op) for m, op, _ in log] == [("prefill", "stage"), ("decode", "stage"), ("decode", "commit"),
                                            ("prefill", "commit")]
    assert all(inside == 0 for m, op, inside in log if op == "commit")  # nothing ran across the switch
    assert result["switched"]
    assert set(result["steps_s"]) == {"stage_prefill", "stage_decode", "drain", "commit"}


def test_a_request_arriving_during_the_drain_waits_and_then_runs():
    switch, gate, log = _switch()
    running = threading.Event()
    release = threading.Event()
    order = []

    def old_request():
        with gate.passage():
            running.set()
            release.wait(10)
            order.append("old done")

    def new_request():
        while not any(op == "stage" and m == "decode" for m, op, _ in log):
            time.sleep(0.01)
        time.sleep(0.1)  # the gate is closing or closed now
        with gate.passage():
            order.append("new ran")

    threads = [threading.Thread(target=old_request), threading.Thread(target=new_request)]
    threads[0].start()
    running.wait(5)
    threads[1].start()
    def update():
        order.append(("switched", switch.apply_delta("/c", 10)["switched"]))

    updater = threading.Thread(target=update)
    updater.start()
    time.sleep(0.5)
    assert order == []  # the update waits for the old request; the new one waits at the gate
    release.set()
    for t in (*threads, updater):
        t.join(10)
    assert order[0] == "old done" and order[1] == ("switched", True) and order[2] == "new ran"


def test_an_undrained_update_is_abandoned_and_the_gate_reopens():
    switch, gate, log = _switch()
    with gate.passage():  # a request that does not finish in time
        with pytest.raises(errors.CapacityError, match="abandoned"):
            switch.apply_delta("/ckpt", drain_s=0.3)
        assert [op for _, op, _ in log] == ["stage", "stage", "abort", "abort"]
        with gate.passage():  # open again
            pass


def test_an_unchanged_checkpoint_switches_nothing():
    switch, _, log = _switch(changed=())
    result = switch.apply_delta("/ckpt", drain_s=5)
    assert not result["switched"] and [op for _, op, _ in log] == ["stage"]


def test_one_update_at_a_time():
    switch, _, _ = _switch()
    assert switch._lock.acquire()
    try:
        with pytest.raises(errors.CapacityError, match="another weight update"):
            switch.apply_delta("/ckpt")
    finally:
        switch._lock.release()


def test_a_hold_drains_and_keeps_new_requests_waiting_until_released():
    switch, gate, _ = _switch()
    entered = threading.Event()

    def late_request():
        with gate.passage():
            entered.set()

    state = switch.hold(drain_s=5, max_hold_s=30)
    assert state["held"]
    t = threading.Thread(target=late_request)
    t.start()
    assert not entered.wait(0.5)  # held
    switch.release()
    assert entered.wait(5)
    t.join(5)


def test_a_hold_nobody_releases_ends_by_itself():
    switch, gate, _ = _switch()
    switch.hold(drain_s=5, max_hold_s=0.3)
    with gate.passage():  # waits at most max_hold_s
        pass
