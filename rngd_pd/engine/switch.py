"""Switching prefill and decode to new weights together, with no request served by both (pd's side).

A partial update (rngd_pd.model.delta) must never let one request be prefilled with one generation
of the weights and decoded with another. pd is where every request enters, so pd does it, in the
order SGLang's `/update_weights_from_disk` uses (new requests wait, running ones finish):

1. stage: prefill builds the new generation from the checkpoint (only the changed tensors are read)
   and prepares it beside the serving one; decode maps the same generation and prepares its own
   state from it (packed decode weights). Both keep serving the old weights meanwhile.
2. drain: pd's `Gate` closes: new requests wait at it (they are not failed), the running ones finish.
   A drain that does not end within its timeout aborts the update (both stages are dropped; the
   old weights stay) and reopens the gate.
3. commit: prefill, then decode, switch to the staged generation (and its fingerprint).
4. the gate reopens; the waiting requests run on the new weights.

Requests that reach prefill or decode without pd (a client of those models directly) are not held
by the gate; a KV handle made with the old weights is refused by the new decode by its fingerprint
(rngd_pd.kv.handle), naming both. Triton-free: a test drives it with fake clients.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from rngd_pd import errors
from rngd_pd.engine.orchestrator import ModelClient
from rngd_pd.wire import tensors as T
from rngd_pd.wire.weights import DRAIN_S, op_inputs, state_of

log = logging.getLogger(__name__)


class Gate:
    """Admission of pd's requests: `passage` counts a request in (waiting while the gate is closed);
    `drain` closes it and waits until none is inside. Thread-safe."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = True
        self._inside = 0

    @contextlib.contextmanager
    def passage(self, cancelled: Any = lambda: False) -> Iterator[None]:
        with self._cond:
            while not self._open:
                if cancelled():
                    raise errors.RequestCancelled("cancelled while the weights were being switched")
                self._cond.wait(0.1)
            self._inside += 1
        try:
            yield
        finally:
            with self._cond:
                self._inside -= 1
                self._cond.notify_all()

    def drain(self, timeout_s: float) -> bool:
        """Close the gate and wait until no request is inside; False (gate reopened) on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._open = False
            while self._inside:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._open = True
                    self._cond.notify_all()
                    return False
                self._cond.wait(left)
            return True

    def reopen(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()

    @property
    def inside(self) -> int:
        with self._cond:
            return self._inside


class WeightSwitch:
    """pd's half of a partial update (module docstring); one update at a time."""

    def __init__(self, prefill: ModelClient, decode: ModelClient, gate: Gate, *,
                 prefill_model: str = "prefill", decode_model: str = "decode") -> None:
        self.prefill, self.decode, self.gate = prefill, decode, gate
        self.prefill_model, self.decode_model = prefill_model, decode_model
        self._lock = threading.Lock()
        self._hold: threading.Timer | None = None

    def _prefill_op(self, op: dict[str, Any]) -> dict[str, Any]:
        return state_of(self.prefill.infer(self.prefill_model, op_inputs("prefill", op), (T.WEIGHTS_STATE,)))

    def _decode_op(self, op: dict[str, Any]) -> dict[str, Any]:
        answers = list(self.decode.stream(self.decode_model, op_inputs("decode", op), (T.WEIGHTS_STATE,)))
        return state_of(answers[-1])

    def state(self) -> dict[str, Any]:
        """Both sides' current fingerprint and generation."""
        return {"prefill": self._prefill_op({"op": "state"}), "decode": self._decode_op({"op": "state"})}

    def apply_delta(self, checkpoint: str, drain_s: float = DRAIN_S) -> dict[str, Any]:
        """Update both sides to `checkpoint` (only its changed tensors are read); returns prefill's
        report (rngd_pd.model.delta.DeltaReport) with the seconds each step took."""
        if not self._lock.acquire(blocking=False):
            raise errors.CapacityError("another weight update is running; try again when it is done")
        try:
            return self._apply(checkpoint, drain_s)
        finally:
            self._lock.release()

    def _apply(self, checkpoint: str, drain_s: float) -> dict[str, Any]:
        t0 = time.monotonic()
        staged = self._prefill_op({"op": "stage", "checkpoint": checkpoint})
        report = staged["report"]
        if not report["changed"]:
            return {**report, "switched": False, "steps_s": {"stage": time.monotonic() - t0}}
        fingerprint = staged["fingerprint"]
        steps = {"stage_prefill": time.monotonic() - t0}
        try:
            self._decode_op({"op": "stage", "store": staged["store"], "fingerprint": fingerprint})
            steps["stage_decode"] = time.monotonic() - t0 - sum(steps.values())
            t1 = time.monotonic()
            if not self.gate.drain(drain_s):
                raise errors.CapacityError(f"requests were still running {drain_s:.0f} s into the weight "
                                           "update; it was abandoned and the old weights stay")
            steps["drain"] = time.monotonic() - t1
        except BaseException:
            self._abort()
            raise
        try:
            t2 = time.monotonic()
            # decode first: it refuses while a request (one not through pd) is in flight there; had
            # prefill switched and decode not, its handles would be refused, never decoded mixed
            self._decode_op({"op": "commit", "fingerprint": fingerprint})
            self._prefill_op({"op": "commit", "fingerprint": fingerprint})
            steps["commit"] = time.monotonic() - t2
        finally:
            self.gate.reopen()
        log.info("weights switched to %s: %s", fingerprint, json.dumps(steps))
        return {**report, "switched": True, "steps_s": steps, "seconds_total": time.monotonic() - t0}

    def hold(self, drain_s: float = DRAIN_S, max_hold_s: float = 600.0) -> dict[str, Any]:
        """Close the gate and wait until no request runs (for a variant swap: Triton 2.51 can crash
        reloading a model that has requests in flight, server issue #7723); new requests wait until
        `release`, or `max_hold_s` if the caller never releases."""
        t0 = time.monotonic()
        if self._hold is not None:  # a hold before this one that was never released
            self._hold.cancel()
        if not self.gate.drain(drain_s):
            raise errors.CapacityError(f"requests were still running {drain_s:.0f} s into the hold; "
                                       "nothing was held")
        self._hold = threading.Timer(max_hold_s, self.gate.reopen)
        self._hold.daemon = True
        self._hold.start()
        return {"held": True, "drain_s": time.monotonic() - t0, "max_hold_s": max_hold_s}

    def release(self) -> dict[str, Any]:
        """Reopen the gate after `hold`."""
        if self._hold is not None:
            self._hold.cancel()
            self._hold = None
        self.gate.reopen()
        return {"held": False}

    def _abort(self) -> None:
        for op in (self._prefill_op, self._decode_op):
            try:
                op({"op": "abort"})
            except Exception as exc:  # the stage is dropped at the next stage or when the stub goes
                log.warning("dropping a staged weight generation failed: %s", str(exc))
