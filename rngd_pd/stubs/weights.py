"""Weight operations inside the prefill and decode stubs (the instance's half of a partial update;
pd drives them, rngd_pd.engine.switch).

* `stage` with `checkpoint`: make the next generation of the weight store from that checkpoint (only
  the changed tensors are read, rngd_pd.model.delta) and prepare it beside the serving weights
  (this instance's own state: packed decode weights, a GPU copy). With `store`: map a generation
  another instance made (decode maps the one prefill staged).
* `commit` with the staged `fingerprint`: serve the staged generation from now on; the KV handles
  this instance makes or accepts carry the new fingerprint; the old generation is let go (the
  store removes it with its last holder), and instances started later map the new one.
* `abort`: drop the staged generation. `state`: what is served and staged.

Every answer is a JSON document (the weights_state output).
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable
from typing import Any

from rngd_pd import errors
from rngd_pd.host.shm_refs import store_root
from rngd_pd.host.stubs import UNLOADING_LINE
from rngd_pd.model.delta import apply_delta
from rngd_pd.model.store import WeightStore, map_store
from rngd_pd.model.weights import LoadedModel, from_store
from rngd_pd.stubs import pbutils

OPS = ("stage", "commit", "abort", "state")


def parse_op(text: str, ops: tuple[str, ...]) -> tuple[str, dict[str, Any]]:
    """The `weights_op` input (a JSON object with "op") as (op, object); ConfigError naming `ops`."""
    try:
        op = json.loads(text)
        return op["op"], op
    except (ValueError, KeyError, TypeError):
        raise errors.ConfigError(f"weights_op must be a JSON object with \"op\" one of {', '.join(ops)}, "
                                 f"got {text[:200]!r}") from None
UNLOADING = UNLOADING_LINE


class WeightsControl:
    """One instance's weight operations; `handle` is called on the stub's thread, one at a time."""

    def __init__(self, runtime: Any, install: Callable[[LoadedModel], None], name: str,
                 busy: Callable[[], int] = lambda: 0) -> None:
        """install: point the instance's services at a committed LoadedModel (fingerprints, caches);
        busy: requests in flight here, which a commit refuses to switch under."""
        self.runtime, self.install, self.name, self.busy = runtime, install, name, busy
        self.staged: LoadedModel | None = None
        self._lock = threading.Lock()

    def handle(self, text: str) -> dict[str, Any]:
        kind, op = parse_op(text, OPS)
        with self._lock:
            if kind == "state":
                return self.state()
            if kind == "stage":
                return self._stage(op)
            if kind == "commit":
                return self._commit(str(op.get("fingerprint", "")))
            if kind == "abort":
                self._drop()
                return self.state()
        raise errors.ConfigError(f"unknown weights op {kind!r}; known: {', '.join(OPS)}")

    def state(self) -> dict[str, Any]:
        cur = self.runtime.loaded
        store = cur.store
        return {"fingerprint": cur.fingerprint, "store": store.key if store else None,
                "generation": store.generation if store else None, "source": cur.source,
                "staged": self.staged.fingerprint if self.staged else None}

    def _current_store(self) -> WeightStore:
        store = self.runtime.loaded.store
        if store is None:
            raise errors.ConfigError(f"{self.name} reads its weights from the checkpoint "
                                     "(weight_store=false); partial updates need the weight store")
        return store

    def _stage(self, op: dict[str, Any]) -> dict[str, Any]:
        self._drop()
        cur = self.runtime.loaded
        report = None
        if op.get("checkpoint"):
            new, report = apply_delta(self._current_store(), str(op["checkpoint"]),
                                      progress=lambda text: pbutils.log(f"{self.name}: {text}"))
            if new is None:
                return {**self.state(), "report": dataclasses.asdict(report)}
        elif op.get("store"):
            self._current_store()
            hold = store_root().hold(str(op["store"]))
            if hold is None:
                raise errors.ConfigError(f"no weight store generation {op['store']!r} on this host")
            try:
                new = map_store(hold)
            except BaseException:
                hold.release()
                raise
            if op.get("fingerprint") and new.fingerprint != op["fingerprint"]:
                new.close()
                raise errors.ConfigError(f"weight store {op['store']} has fingerprint {new.fingerprint}, "
                                         f"not {op['fingerprint']}")
        else:
            raise errors.ConfigError("stage needs \"checkpoint\" (a directory) or \"store\" (a generation)")
        staged = from_store(new, cur.config, cur.tokenizer, new.manifest["source"])
        try:
            prepare = getattr(self.runtime, "prepare_weights", None)
            if prepare is None:
                raise errors.ConfigError(f"{self.name}: partial updates are not supported on "
                                         f"{type(self.runtime).__name__} yet (cpu and cuda are)")
            prepare(staged)
        except BaseException:
            staged.close()
            raise
        self.staged = staged
        pbutils.log(f"{self.name}: staged weights {staged.fingerprint} (generation {new.generation})")
        return {"fingerprint": staged.fingerprint, "store": new.key, "generation": new.generation,
                "report": dataclasses.asdict(report) if report else None}

    def _commit(self, fingerprint: str) -> dict[str, Any]:
        staged = self.staged
        if staged is None or staged.fingerprint != fingerprint:
            raise errors.ConfigError(f"{self.name}: nothing staged with fingerprint {fingerprint!r} "
                                     f"(staged: {staged.fingerprint if staged else 'nothing'})")
        if busy := self.busy():
            raise errors.CapacityError(f"{self.name}: {busy} requests are in flight; weights switch only "
                                       "between requests")
        old = self.runtime.loaded
        self.runtime.loaded = staged
        self.install(staged)
        self.staged = None
        assert staged.store is not None
        store_root().point(staged.store.base, staged.store.key)
        old.close()
        pbutils.log(f"{self.name}: serving weights {staged.fingerprint} (generation "
                    f"{staged.store.generation}) instead of {old.fingerprint}")
        return self.state()

    def _drop(self) -> None:
        if self.staged is not None:
            self.staged.close()
            self.staged = None

    def close(self) -> None:
        """At finalize: drop a staged generation, and say in the log that this instance unloads (serve's
        stub watch reads it: a model unloaded on request, `rngd-pd swap`, is not a crash)."""
        pbutils.log(f"{self.name}: {UNLOADING}")
        with self._lock:
            self._drop()
