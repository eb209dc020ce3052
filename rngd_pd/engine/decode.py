"""Decode engine: B slots, one scheduler thread, continuous batching over sequence buckets.

Each scheduler iteration admits requests whose KV has been loaded, runs one batched decode step
over the active slots of every bucket (`Llama.decode_step_parts`: the weights are read once for all
rows, each bucket's attention over its own rows), samples every row with its request's own
sampler, emits each token to its request's callback and retires finished or cancelled requests at
once. KV arrives on loader threads (`load_kv` may block on a transport) straight into the slot the
request will decode in, so a slow transfer never stalls the running streams.

Buckets: a request takes the smallest bucket (max length) with a free slot that holds
prompt_len + max_tokens. Each bucket's KVCache is allocated once at construction:
bytes = sum over buckets of slots_b * len_b * num_layers * 2 * kv_heads * head_dim * dtype size
(SmolLM2-135M, bf16: 23,040 bytes per token; 16 slots x (512 + 2048) = 944 MB).
"""

from __future__ import annotations

import enum
import heapq
import logging
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rngd_pd.devices.runtime import DeviceRuntime, decode_shapes, plan_buckets
from rngd_pd.devices.torch_runtime import as_runtime
from rngd_pd.engine.request import (
    DecodeRequest,
    RequestState,
    TokenEvent,
    check_request,
    choice_key,
    first_tokens,
)
from rngd_pd.engine.workers import RequestPool
from rngd_pd.errors import CapacityError, ConfigError, RequestCancelled, RngdPdError
from rngd_pd.model.grammar import TokenConstraint, grammars_for
from rngd_pd.model.params import MAX_N
from rngd_pd.model.sampling import FinishReason, Sampled, Sampler

log = logging.getLogger(__name__)

CANCEL_MEMORY_S = 120.0  # how long a cancel of a key not (yet) submitted is remembered
MAX_TOMBSTONES = 4096


class Phase(enum.IntEnum):
    """Where a request is; it only moves forward (QUEUED -> LOADING -> ACTIVE -> DONE, or straight
    to DONE from any phase when it is cancelled or fails)."""

    QUEUED = 1   # waiting for a slot
    LOADING = 2  # has a slot; a loader thread is filling it with the prompt's KV
    ACTIVE = 3   # in the batch
    DONE = 4     # its final event went out; the slot is free


@dataclass(eq=False)
class _Entry:
    """The one record of a request inside the engine, from submit to its final event."""

    req: DecodeRequest
    state: RequestState
    sampler: Sampler
    need: int  # prompt_len + max_tokens
    phase: Phase = Phase.QUEUED
    bucket: _Bucket | None = None
    slot: int = -1
    position: int = 0  # where the next fed token goes (= tokens cached so far)
    last_token: int = 0
    cancel_asked: bool = False
    loaded: bool = False  # the loader is done with it (KV in the slot, or load_error)
    load_error: BaseException | None = None
    constraint: TokenConstraint | None = None  # structured outputs: the grammar of the reply
    key: str = ""  # the request's key; choice i > 0 of n: `choice_key(key, i)`
    first: Sampled | None = None  # this choice's first token, once known
    children: list[_Entry] = field(default_factory=list)  # choices 1.. of n: loaded with this one

    def __post_init__(self) -> None:
        self.key = self.key or self.req.key

    def advance(self, phase: Phase) -> None:
        if phase <= self.phase:
            raise AssertionError(f"request {self.req.key}: phase {self.phase.name} -> {phase.name}")
        self.phase = phase


class _Bucket:
    """One preallocated KVCache of `slots` sequences of up to `max_len` tokens, plus step buffers."""

    def __init__(self, runtime: DeviceRuntime, slots: int, max_len: int, dtype: Any) -> None:
        self.max_len, self.slots = max_len, slots
        self.cache = runtime.new_cache(slots, max_len, dtype)
        self.free = list(range(slots))  # a heap: the lowest free slot first, so active slots stay
        # mostly contiguous and the step reads the cache as one view instead of a gather
        self.active: dict[int, _Entry] = {}


class _StepInputs:
    """The step's index input for every slot of every bucket: a numpy view the engine fills with one
    vectorised write per row kind, and the same memory as the runtime's tensor (nothing allocated)."""

    def __init__(self, runtime: DeviceRuntime, rows: int) -> None:
        self._np, self._t = runtime.step_buffers(rows)

    def fill(self, tokens: list[int], positions: list[int], slots: list[int],
             sizes: list[tuple[Any, int]]) -> tuple[Any, Any, list[tuple[Any, Any]]]:
        """(tokens, positions, parts) of one step; sizes[i] = (cache, rows) groups the rows in order,
        parts[i] = (that cache, its rows' slots)."""
        n = len(tokens)
        self._np[0, :n], self._np[1, :n], self._np[2, :n] = tokens, positions, slots
        parts, start = [], 0
        for cache, k in sizes:
            parts.append((cache, self._t[2, start : start + k]))
            start += k
        return self._t[0, :n], self._t[1, :n], parts


class DecodeEngine:
    """Continuous-batching decode over `num_slots` concurrent streams.

    Every request has one `_Entry` in `_requests` from submit to its final event, with a forward-only
    `Phase`; `_queue` only orders the QUEUED ones. A request whose first token is not known at submit
    (the disaggregated path: it comes with the KV's handle) gets it from `load_kv`.

    Thread-safety: submit/cancel/stats may be called from any thread. emit callbacks run on the
    scheduler thread (the first token's event on the submitting thread when it is known there) and
    must be quick: they queue, they never wait on I/O.
    """

    def __init__(
        self,
        loaded: DeviceRuntime | Any,
        num_slots: int,
        max_len: int,
        kv_dtype: Any = "bf16",
        max_queue: int = 64,
        buckets: Sequence[int] | Mapping[int, int] | None = None,
        loader_threads: int = 2,
    ) -> None:
        if num_slots < 1 or max_queue < 0 or loader_threads < 1:
            raise ConfigError(
                f"num_slots >= 1, max_queue >= 0, loader_threads >= 1 needed; got {num_slots}, "
                f"{max_queue}, {loader_threads}"
            )
        self.runtime = as_runtime(loaded)
        self.loaded, self.config = self.runtime.loaded, self.runtime.loaded.config
        self.max_len = min(max_len, self.config.max_context)
        self.num_slots, self.max_queue = num_slots, max_queue
        self.kv_dtype = self.runtime.dtype(kv_dtype)
        plan = plan_buckets(num_slots, self.max_len, buckets)
        # every graph built now (decode weights packed, compiled), not in the first request's step
        self.runtime.prepare(decode_shapes(num_slots, self.max_len, self.kv_dtype, buckets))
        self.buckets = [_Bucket(self.runtime, s, n, self.kv_dtype) for n, s in plan.items()]
        self._inputs = _StepInputs(self.runtime, sum(b.slots for b in self.buckets))
        self._loader_threads = loader_threads
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._requests: dict[str, _Entry | None] = {}  # every request in flight (None: being submitted)
        self._queue: deque[_Entry] = deque()  # the QUEUED ones, in arrival order
        self._tombstones: dict[str, float] = {}  # keys cancelled before they were submitted -> when
        self._running = False
        self._thread: threading.Thread | None = None
        self._pool: RequestPool | None = None
        self._masker: ThreadPoolExecutor | None = None  # grammar masks, computed while a step runs
        self._counters = {"steps": 0, "tokens": 0, "finished": 0, "rejected": 0}
        self._times = {"model_s": 0.0, "host_s": 0.0}  # in decode_step / sampling + emitting

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the scheduler thread (idempotent)."""
        with self._lock:
            if self._running:
                return
            self._running = True
        self._pool = RequestPool("decode-kv-loader", self._loader_threads, self.num_slots)
        self._masker = ThreadPoolExecutor(1, thread_name_prefix="decode-grammar")
        self._thread = threading.Thread(target=self._run, name="decode-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the scheduler; every request still in flight gets its final event ("error")."""
        with self._lock:
            if not self._running:
                return
            self._running = False
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
        if self._pool is not None:
            self._pool.close(wait_s=2.0)  # idle loaders end at once; one still pulling KV is let go
        if self._masker is not None:
            self._masker.shutdown(wait=True)
        leftovers = [e for e in self._requests.values() if e is not None]
        for e in leftovers:
            err = RngdPdError("the decode engine stopped before the request finished; retry it",
                              key=e.req.key)
            self._retire(e, e.state.final(FinishReason.ERROR, err))

    def __enter__(self) -> DecodeEngine:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- API ---------------------------------------------------------------------------------------
    def submit(self, req: DecodeRequest) -> None:
        """Queue a prefilled request. Emits the first token's event on this thread when it is known.

        Raises ConfigError / ContextLengthError for a bad request, CapacityError when the queue is
        full, RequestCancelled when its key was cancelled before, RngdPdError when the engine is not
        running. Nothing is emitted when it raises.
        """
        check_request(req.prompt_len, req.params, self.buckets[-1].max_len, key=req.key)
        n = req.params.n
        firsts = first_tokens(req.first_token, n, req.key)
        if firsts is not None:
            for f in firsts:
                self._check_token(req.key, f.token)
        # each choice its own grammar state, built before anything is reserved (a bad grammar raises)
        grammars = grammars_for(self.loaded.tokenizer)
        constraints = [grammars.constraint(req.params.structured) for _ in range(n)]
        keys = [choice_key(req.key, i) for i in range(n)]
        for i, key in enumerate(keys):
            try:
                self._reserve(key)
            except BaseException:
                for done in keys[:i]:
                    self._unreserve(done)
                raise
        entries = [self._entry(req, i, key, constraints[i]) for i, key in enumerate(keys)]
        live = entries
        if firsts is not None:
            try:
                events = [self._first(e, f) for e, f in zip(entries, firsts, strict=True)]
            except BaseException:
                for key in keys:
                    self._unreserve(key)
                raise
            for e, ev in zip(entries[1:], events[1:], strict=True):
                if ev.finished:
                    self._unreserve(e.key, finished=True)
            live = [entries[0], *(e for e, ev in zip(entries[1:], events[1:], strict=True)
                                  if not ev.finished)]
            if len(live) == 1 and events[0].finished:  # every choice ended at its first token
                self._unreserve(req.key, finished=True)
                return
        leader = live[0]  # loads the KV (even when its own choice has ended) and copies it to the rest
        leader.children = live[1:]
        with self._lock:
            for e in live:
                self._requests[e.key] = e
            self._queue.append(leader)
            self._wake.notify()

    def _entry(self, req: DecodeRequest, index: int, key: str, constraint: TokenConstraint | None) -> _Entry:
        state = RequestState(req.key, req.params, self.loaded.tokenizer, self.config.eos_token_ids, index)
        sampler = Sampler(req.params, first_step=1, choice=index, prompt_ids=req.prompt_ids,
                          eos_ids=self.config.eos_token_ids)
        return _Entry(req, state, sampler, req.prompt_len + req.params.max_tokens, position=req.prompt_len,
                      constraint=constraint, key=key)

    def cancel(self, key: str) -> bool:
        """Ask for a request to end (final event finish_reason "cancelled"); False if unknown, and
        then a submit of that key within CANCEL_MEMORY_S is refused (the cancel overtook it)."""
        with self._lock:
            entry = self._requests.get(key)
            choices = [c for c in (self._requests.get(choice_key(key, i)) for i in range(1, MAX_N))
                       if c is not None]
            for c in choices:  # the other choices of n, also those that outlive the first
                c.cancel_asked = True
            if key not in self._requests:
                self._remember_locked(key)
                return bool(choices)
            if entry is not None:
                entry.cancel_asked = True
            else:
                self._remember_locked(key)  # mid-submit: submit sees the tombstone
            self._wake.notify()
            return True

    def is_cancelled(self, key: str) -> bool:
        """Whether a cancel was asked for `key` (loaders poll it while they wait for KV)."""
        with self._lock:
            entry = self._requests.get(key)
            return key in self._tombstones or (entry is not None and entry.cancel_asked)

    def time_step(self, repeat: int = 5, position: int = 64, rows: int | None = None) -> float:
        """Median seconds of one decode step over `rows` slots (default: every slot) of the first
        bucket, each at `position` (calibration; only before start(): it writes scratch K/V that
        requests overwrite)."""
        if self._running:
            raise RngdPdError("time_step measures an idle engine; call it before start()")
        b = self.buckets[0]
        rows = b.slots if rows is None else max(1, min(rows, b.slots))
        at = min(position, b.max_len - 1)
        tokens, positions, parts = self._inputs.fill([1] * rows, [at] * rows, list(range(rows)),
                                                     [(b.cache, rows)])
        times = []
        with self.runtime.inference():
            for i in range(repeat + 1):  # the first one warms up
                t0 = time.perf_counter()
                self.runtime.decode_step_parts(tokens, positions, parts)
                if i:
                    times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    def stats(self) -> dict:
        with self._lock:
            phases = [e.phase for e in self._requests.values() if e is not None]
            return {
                "num_slots": self.num_slots,
                "active": phases.count(Phase.ACTIVE),
                "loading": phases.count(Phase.LOADING),
                "queued": phases.count(Phase.QUEUED),
                "free_slots": self.num_slots - phases.count(Phase.LOADING) - phases.count(Phase.ACTIVE),
                "buckets": {b.max_len: len(b.active) for b in self.buckets},
                "kv_cache_bytes": sum(b.cache.nbytes for b in self.buckets),
                **self._counters,
                **{k: round(v, 4) for k, v in self._times.items()},
            }

    # ---- submission bookkeeping ----------------------------------------------------------------
    def _check_token(self, key: str, token: int) -> None:
        if not 0 <= token < self.config.vocab_size:
            raise ConfigError(f"first_token {token} outside the vocabulary", key=key)

    def _first(self, e: _Entry, first: Sampled) -> TokenEvent:
        """Account for the first token (sampled by prefill, under the same grammar) and emit its event."""
        e.first = first
        e.last_token = first.token
        e.sampler.record(first.token)
        ev = e.state.advance(first.token, first.logprobs, end=self._accept(e, first.token))
        e.req.emit(ev)
        return ev

    @staticmethod
    def _accept(e: _Entry, token: int) -> bool:
        """Advance the request's grammar past `token`; True when the grammar is finished."""
        if e.constraint is None:
            return False
        e.constraint.accept(token)
        return e.constraint.is_terminated()

    def _in_slots_locked(self) -> int:
        """Requests holding a slot (LOADING or ACTIVE)."""
        return sum(1 for e in self._requests.values()
                   if e is not None and Phase.QUEUED < e.phase < Phase.DONE)

    def _remember_locked(self, key: str) -> None:
        now = time.monotonic()
        oldest = next(iter(self._tombstones.values()), now)
        if len(self._tombstones) >= MAX_TOMBSTONES or now - oldest > CANCEL_MEMORY_S:
            self._tombstones = {k: t for k, t in self._tombstones.items() if now - t < CANCEL_MEMORY_S}
            while len(self._tombstones) >= MAX_TOMBSTONES:
                self._tombstones.pop(next(iter(self._tombstones)))
        self._tombstones[key] = now

    def _reserve(self, key: str) -> None:
        with self._lock:
            if not self._running:
                raise RngdPdError("the decode engine is not running; call start() first", key=key)
            if self._tombstones.pop(key, None) is not None:
                raise RequestCancelled("cancelled before decode started", key=key)
            if key in self._requests:
                raise ConfigError("a request with this key is already in flight", key=key)
            waiting = len(self._queue) + sum(1 for e in self._requests.values() if e is None)
            if waiting >= self.max_queue + max(0, self.num_slots - self._in_slots_locked()):
                self._counters["rejected"] += 1
                raise CapacityError(
                    f"decode queue full ({len(self._queue)} waiting, max_queue={self.max_queue}, "
                    f"all {self.num_slots} slots busy); retry later or raise max_queue/num_slots",
                    key=key,
                )
            self._requests[key] = None

    def _unreserve(self, key: str, finished: bool = False) -> None:
        with self._lock:
            self._requests.pop(key, None)
            self._tombstones.pop(key, None)
            if finished:
                self._counters["finished"] += 1

    # ---- scheduler thread ----------------------------------------------------------------------
    def _run(self) -> None:
        self.runtime.compute_thread()
        with self.runtime.inference():
            while True:
                with self._lock:
                    if not self._running:
                        return
                    self._start_loads_locked()
                    entries = [e for e in self._requests.values() if e is not None]
                    # a loading request is ended only once its loader let go of the slot
                    settled = [e for e in entries if e.phase != Phase.LOADING or e.loaded]
                    cancelled = [e for e in settled if e.cancel_asked]
                    ready = [e for e in settled if e.phase == Phase.LOADING and not e.cancel_asked]
                    busy = any(b.active for b in self.buckets)
                    if not (cancelled or ready or busy):
                        self._wake.wait()
                        continue
                    for e in cancelled:
                        if e.phase == Phase.QUEUED and e in self._queue:  # choices > 0 wait in theirs
                            self._queue.remove(e)
                for e in cancelled:
                    self._retire(e, e.state.final(FinishReason.CANCELLED))
                for e in ready:
                    self._admit(e)
                if busy or ready:
                    self._step()

    def _start_loads_locked(self) -> None:
        """FIFO: give the head of the queue a slot (one per live choice of its n) and start loading
        its KV, while slots last."""
        while self._queue and self._in_slots_locked() < self.num_slots:
            e = self._queue[0]
            group = [e, *(c for c in e.children if c.phase == Phase.QUEUED and not c.cancel_asked)]
            if self._in_slots_locked() + len(group) > self.num_slots:
                return
            taken: list[tuple[_Bucket, int]] = []
            for member in group:
                bucket = next((b for b in self.buckets if b.max_len >= member.need and b.free), None)
                if bucket is None:
                    for b, slot in taken:  # not all of them fit now: wait, keeping nothing
                        heapq.heappush(b.free, slot)
                    return
                taken.append((bucket, heapq.heappop(bucket.free)))
            self._queue.popleft()
            for member, (bucket, slot) in zip(group, taken, strict=True):
                member.bucket, member.slot = bucket, slot
                member.advance(Phase.LOADING)
            e.children = group[1:]
            assert self._pool is not None
            self._pool.submit(self._load, e)

    def _load(self, e: _Entry) -> None:
        """Loader thread: fill the entry's slot, then copy the prompt's KV into its other choices'
        slots (n > 1: one transfer, n rows); a failure fails only this request."""
        try:
            assert e.bucket is not None
            with self.runtime.inference():
                got = e.req.load_kv(e.bucket.cache, e.slot)
                for child in e.children:
                    assert child.bucket is not None
                    for layer in range(self.config.num_layers):
                        k, v = e.bucket.cache.read(e.slot, layer, 0, e.req.prompt_len)
                        child.bucket.cache.load(child.slot, layer, k, v)
            if e.first is None:
                firsts = first_tokens(got, e.req.params.n, e.req.key)
                if firsts is None:
                    raise RngdPdError("load_kv returned no first token", key=e.req.key)
                for f in firsts:
                    self._check_token(e.req.key, f.token)
                for member in (e, *e.children):
                    member.first = firsts[member.state.index]
        except BaseException as ex:
            e.load_error = ex
        with self._lock:
            for member in (e, *e.children):
                member.load_error = e.load_error
                member.loaded = True
            self._wake.notify()

    def _admit(self, e: _Entry) -> None:
        if e.load_error is not None:
            err = e.load_error
            if not isinstance(err, RngdPdError):
                err = RngdPdError(f"loading the KV failed: {err!r}", key=e.req.key)
            reason = FinishReason.CANCELLED if isinstance(err, RequestCancelled) else FinishReason.ERROR
            self._retire(e, e.state.final(reason, None if reason == FinishReason.CANCELLED else err))
            return
        assert e.bucket is not None
        if e.state.finished:  # a leader whose own choice ended at its first token: it only loaded
            self._retire(e, None)
            return
        if not e.state.token_ids:  # the first token came with the KV
            try:
                assert e.first is not None
                ev = self._first(e, e.first)
            except Exception as ex:
                err = RngdPdError(f"first token: {ex!r}", key=e.req.key)
                self._retire(e, e.state.final(FinishReason.ERROR, err))
                return
            if ev.finished:
                self._retire(e, None)
                return
        with self._lock:
            e.advance(Phase.ACTIVE)
            e.bucket.active[e.slot] = e

    def _step(self) -> None:
        """One batched decode step over the active slots of every bucket (the weights read once for
        all rows), then sample, emit, retire."""
        groups = [(b, [b.active[s] for s in sorted(b.active)]) for b in self.buckets if b.active]
        if not groups:
            return
        rows = [e for _, es in groups for e in es]
        t0 = time.perf_counter()
        tokens, positions, parts = self._inputs.fill(
            [e.last_token for e in rows], [e.position for e in rows], [e.slot for e in rows],
            [(b.cache, len(es)) for b, es in groups])
        masks = self._prepare_masks(rows)
        try:
            logits = self.runtime.decode_step_parts(tokens, positions, parts)
            greedy = logits.argmax(dim=-1).tolist()  # the plain rows' answer, all at once
            if masks is not None:
                masks.result()
        except Exception as ex:
            log.exception("decode step failed for %d requests", len(rows))
            for e in rows:
                err = RngdPdError(f"decode step failed: {ex!r}", key=e.req.key)
                self._retire(e, e.state.final(FinishReason.ERROR, err))
            return
        t1 = time.perf_counter()
        for i, e in enumerate(rows):
            try:
                if e.sampler.plain and (e.constraint is None or e.constraint.allows(greedy[i])):
                    chosen = Sampled(greedy[i])  # the row's argmax, which its grammar (if any) admits
                else:
                    chosen = e.sampler.choose(logits[i], e.constraint)
                e.position += 1
                e.last_token = chosen.token
                ev = e.state.advance(chosen.token, chosen.logprobs, end=self._accept(e, chosen.token))
            except Exception as ex:
                log.exception("sampling failed")
                self._retire(e, e.state.final(FinishReason.ERROR, RngdPdError(f"sampling failed: {ex!r}")))
                continue
            if ev.finished:
                self._retire(e, ev)
            else:
                self._emit(e, ev)
        with self._lock:
            self._counters["steps"] += 1
            self._counters["tokens"] += len(rows)
            self._times["model_s"] += t1 - t0
            self._times["host_s"] += time.perf_counter() - t1

    def _prepare_masks(self, rows: list[_Entry]) -> Future | None:
        """Start computing the grammar masks of the constrained rows on the masker thread, so they
        are ready when the step's forward (which drops the GIL) returns; None when no row has one."""
        constraints = [e.constraint for e in rows if e.constraint is not None]
        if not constraints or self._masker is None:
            return None
        return self._masker.submit(lambda: [c.prepare() for c in constraints])

    def _retire(self, e: _Entry, ev: TokenEvent | None) -> None:
        """Free the slot at once, then send the request's one final event (None: already sent)."""
        with self._lock:
            if e.phase == Phase.DONE:
                return
            if e.bucket is not None and e.slot >= 0:
                e.bucket.active.pop(e.slot, None)
                heapq.heappush(e.bucket.free, e.slot)
                e.slot = -1
            e.advance(Phase.DONE)
            self._requests.pop(e.key, None)
            self._counters["finished"] += 1
            self._wake.notify()
        if ev is not None:
            self._emit(e, ev)

    def _emit(self, e: _Entry, ev: TokenEvent) -> None:
        try:
            e.req.emit(ev)
        except Exception:
            log.exception("emit failed for request %s; cancelling it", e.req.key)
            if not ev.finished:
                self.cancel(e.req.key)
