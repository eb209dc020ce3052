"""Decode engine: B slots, one scheduler thread, continuous batching over sequence buckets.

Each scheduler iteration admits requests whose KV has been loaded, runs one batched
`Llama.decode_step` per bucket that has active slots, samples every row with its request's own
sampler, emits each token to its request's callback and retires finished or cancelled requests at
once. KV arrives on loader threads (`load_kv` may block on a transport) straight into the slot the
request will decode in, so a slow transfer never stalls the running streams.

Buckets: a request takes the smallest bucket (max length) with a free slot that holds
prompt_len + max_tokens. Each bucket's KVCache is allocated once at construction:
bytes = sum over buckets of slots_b * len_b * num_layers * 2 * kv_heads * head_dim * dtype size
(SmolLM2-135M, bf16: 23,040 bytes per token; 16 slots x (512 + 2048) = 944 MB).
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from rngd_pd.engine.request import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    DecodeRequest,
    RequestState,
    TokenEvent,
    check_request,
)
from rngd_pd.errors import CapacityError, ConfigError, RngdPdError
from rngd_pd.model.cache import KVCache
from rngd_pd.model.sampling import Sampler

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (512, 2048, 8192)


@dataclass(eq=False)
class _Entry:
    """One request inside the engine; touched only by the scheduler thread once queued."""

    req: DecodeRequest
    state: RequestState
    sampler: Sampler
    need: int  # prompt_len + max_tokens
    bucket: _Bucket | None = None
    slot: int = -1
    position: int = 0  # where the next fed token goes (= tokens cached so far)
    last_token: int = 0
    phase: str = "queued"  # queued -> loading -> active
    load_error: BaseException | None = None
    load_future: Future | None = field(default=None, repr=False)


class _Bucket:
    """One preallocated KVCache of `slots` sequences of up to `max_len` tokens, plus step buffers."""

    def __init__(self, config, slots: int, max_len: int, dtype: torch.dtype) -> None:
        self.max_len = max_len
        self.cache = KVCache(config, slots, max_len, dtype)
        self.free = list(range(slots))  # a heap: the lowest free slot first, so active slots stay
        # mostly contiguous and the step reads the cache as one view instead of a gather
        self.active: dict[int, _Entry] = {}
        # numpy views of torch tensors: one vectorised fill per step, nothing allocated
        self._np = np.zeros((3, slots), dtype=np.int64)
        self._t = torch.from_numpy(self._np)

    def step_inputs(self, rows: list[_Entry]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = len(rows)
        self._np[0, :n] = [e.last_token for e in rows]
        self._np[1, :n] = [e.position for e in rows]
        self._np[2, :n] = [e.slot for e in rows]
        return self._t[0, :n], self._t[1, :n], self._t[2, :n]


def plan_buckets(
    num_slots: int, max_len: int, buckets: Sequence[int] | Mapping[int, int] | None
) -> dict[int, int]:
    """{bucket length: slots}. A sequence gives every bucket num_slots slots; max_len caps them."""
    if isinstance(buckets, Mapping):
        plan = {int(k): int(v) for k, v in buckets.items()}
    else:
        lengths = [b for b in (buckets or DEFAULT_BUCKETS) if b < max_len] + [max_len]
        plan = {int(b): num_slots for b in lengths}
    bad = {k: v for k, v in plan.items() if k < 2 or k > max_len or v < 1}
    if bad or not plan:
        raise ConfigError(f"buckets {plan} invalid: lengths must be in [2, {max_len}], slots >= 1")
    return dict(sorted(plan.items()))


class DecodeEngine:
    """Continuous-batching decode over `num_slots` concurrent streams.

    Thread-safety: submit/cancel/stats may be called from any thread. emit callbacks run on the
    scheduler thread (the first token's event on the submitting thread) and must be quick.
    """

    def __init__(
        self,
        loaded,
        num_slots: int,
        max_len: int,
        kv_dtype: torch.dtype = torch.bfloat16,
        max_queue: int = 64,
        buckets: Sequence[int] | Mapping[int, int] | None = None,
        loader_threads: int = 2,
    ) -> None:
        if num_slots < 1 or max_queue < 0 or loader_threads < 1:
            raise ConfigError(
                f"num_slots >= 1, max_queue >= 0, loader_threads >= 1 needed; got {num_slots}, "
                f"{max_queue}, {loader_threads}"
            )
        self.loaded, self.config, self.model = loaded, loaded.config, loaded.model
        self.model.prepare_decode()  # pack decode weights now, not in the first request's step
        self.max_len = min(max_len, self.config.max_context)
        self.num_slots, self.max_queue, self.kv_dtype = num_slots, max_queue, kv_dtype
        plan = plan_buckets(num_slots, self.max_len, buckets)
        self.buckets = [_Bucket(self.config, s, n, kv_dtype) for n, s in plan.items()]
        self._loader_threads = loader_threads
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: deque[_Entry] = deque()
        self._ready: list[_Entry] = []  # KV loaded (or failed), waiting for the scheduler
        self._keys: dict[str, _Entry | None] = {}  # every request in flight (None: being submitted)
        self._cancelled: set[str] = set()
        self._in_slots = 0  # loading + active
        self._running = False
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._counters = {"steps": 0, "tokens": 0, "finished": 0, "rejected": 0}
        self._times = {"model_s": 0.0, "host_s": 0.0}  # in decode_step / sampling + emitting

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the scheduler thread (idempotent)."""
        with self._lock:
            if self._running:
                return
            self._running = True
        self._pool = ThreadPoolExecutor(self._loader_threads, thread_name_prefix="decode-kv-loader")
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
            self._pool.shutdown(wait=False, cancel_futures=True)
        leftovers = [e for e in self._keys.values() if e is not None]
        for e in leftovers:
            err = RngdPdError("the decode engine stopped before the request finished; retry it",
                              key=e.req.key)
            self._retire(e, e.state.final(FINISH_ERROR, err))

    def __enter__(self) -> DecodeEngine:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- API ---------------------------------------------------------------------------------------
    def submit(self, req: DecodeRequest) -> None:
        """Queue a prefilled request. Emits the first token's event on this thread.

        Raises ConfigError / ContextLengthError for a bad request, CapacityError when the queue is
        full, RngdPdError when the engine is not running. Nothing is emitted when it raises.
        """
        check_request(req.prompt_len, req.params, self.buckets[-1].max_len, key=req.key)
        if not 0 <= req.first_token < self.config.vocab_size:
            raise ConfigError(f"first_token {req.first_token} outside the vocabulary", key=req.key)
        self._reserve(req.key)
        state = RequestState(req.key, req.params, self.loaded.tokenizer, self.config.eos_token_ids)
        try:
            ev = state.advance(req.first_token)
            req.emit(ev)
        except BaseException:
            self._unreserve(req.key)
            raise
        if ev.finished:
            self._unreserve(req.key, finished=True)
            return
        entry = _Entry(req, state, Sampler(req.params, first_step=1), req.prompt_len + req.params.max_tokens,
                       position=req.prompt_len, last_token=req.first_token)
        with self._lock:
            self._keys[req.key] = entry
            self._queue.append(entry)
            self._wake.notify()

    def cancel(self, key: str) -> bool:
        """Ask for a request to end (final event finish_reason "cancelled"); False if unknown."""
        with self._lock:
            if key not in self._keys:
                return False
            self._cancelled.add(key)
            self._wake.notify()
            return True

    def stats(self) -> dict:
        with self._lock:
            active = sum(len(b.active) for b in self.buckets)
            return {
                "num_slots": self.num_slots,
                "active": active,
                "loading": self._in_slots - active,
                "queued": len(self._queue),
                "free_slots": self.num_slots - self._in_slots,
                "buckets": {b.max_len: len(b.active) for b in self.buckets},
                "kv_cache_bytes": sum(b.cache.nbytes for b in self.buckets),
                **self._counters,
                **{k: round(v, 4) for k, v in self._times.items()},
            }

    # ---- submission bookkeeping ----------------------------------------------------------------
    def _reserve(self, key: str) -> None:
        with self._lock:
            if not self._running:
                raise RngdPdError("the decode engine is not running; call start() first", key=key)
            if key in self._keys:
                raise ConfigError("a request with this key is already in flight", key=key)
            waiting = len(self._queue) + sum(1 for e in self._keys.values() if e is None)
            if waiting >= self.max_queue + max(0, self.num_slots - self._in_slots):
                self._counters["rejected"] += 1
                raise CapacityError(
                    f"decode queue full ({len(self._queue)} waiting, max_queue={self.max_queue}, "
                    f"all {self.num_slots} slots busy); retry later or raise max_queue/num_slots",
                    key=key,
                )
            self._keys[key] = None

    def _unreserve(self, key: str, finished: bool = False) -> None:
        with self._lock:
            self._keys.pop(key, None)
            self._cancelled.discard(key)
            if finished:
                self._counters["finished"] += 1

    # ---- scheduler thread ----------------------------------------------------------------------
    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._lock:
                    if not self._running:
                        return
                    cancelled = self._take_cancelled_locked()
                    self._start_loads_locked()
                    ready, self._ready = self._ready, []
                    ready_cancelled = [e for e in ready if e.req.key in self._cancelled]
                    busy = any(b.active for b in self.buckets)
                    if not (cancelled or ready or busy):
                        self._wake.wait()
                        continue
                for e in cancelled + ready_cancelled:
                    self._retire(e, e.state.final(FINISH_CANCELLED))
                for e in ready:
                    if e not in ready_cancelled:
                        self._admit(e)
                for b in self.buckets:
                    if b.active:
                        self._step(b)

    def _take_cancelled_locked(self) -> list[_Entry]:
        """Queued or active entries whose cancel was asked; loading ones wait for their load."""
        out = []
        for key in list(self._cancelled):
            if key not in self._keys:
                self._cancelled.discard(key)
                continue
            e = self._keys[key]
            if e is None or e.phase == "loading":
                continue
            self._cancelled.discard(key)
            if e.phase == "queued":
                self._queue.remove(e)
            out.append(e)
        return out

    def _start_loads_locked(self) -> None:
        """FIFO: give the head of the queue a slot and start loading its KV, while slots last."""
        while self._queue and self._in_slots < self.num_slots:
            e = self._queue[0]
            bucket = next((b for b in self.buckets if b.max_len >= e.need and b.free), None)
            if bucket is None:
                return
            self._queue.popleft()
            e.bucket, e.slot, e.phase = bucket, heapq.heappop(bucket.free), "loading"
            self._in_slots += 1
            assert self._pool is not None
            e.load_future = self._pool.submit(self._load, e)

    def _load(self, e: _Entry) -> None:
        """Loader thread: fill the entry's slot; a failure fails only this request."""
        try:
            assert e.bucket is not None
            with torch.inference_mode():
                e.req.load_kv(e.bucket.cache, e.slot)
        except BaseException as ex:
            e.load_error = ex
        with self._lock:
            self._ready.append(e)
            self._wake.notify()

    def _admit(self, e: _Entry) -> None:
        if e.load_error is not None:
            err = e.load_error
            if not isinstance(err, RngdPdError):
                err = RngdPdError(f"loading the KV failed: {err!r}", key=e.req.key)
            self._retire(e, e.state.final(FINISH_ERROR, err))
            return
        assert e.bucket is not None
        e.phase = "active"
        with self._lock:
            e.bucket.active[e.slot] = e

    def _step(self, b: _Bucket) -> None:
        """One batched decode step over the bucket's active slots, then sample, emit, retire."""
        rows = [b.active[s] for s in sorted(b.active)]
        t0 = time.perf_counter()
        tokens, positions, slots = b.step_inputs(rows)
        try:
            logits = self.model.decode_step(tokens, positions, b.cache, slots)
            greedy = logits.argmax(dim=-1).tolist()
        except Exception as ex:
            log.exception("decode step failed for %d requests", len(rows))
            for e in rows:
                err = RngdPdError(f"decode step failed: {ex!r}", key=e.req.key)
                self._retire(e, e.state.final(FINISH_ERROR, err))
            return
        t1 = time.perf_counter()
        for i, e in enumerate(rows):
            try:
                tok = greedy[i] if e.sampler.greedy else e.sampler.sample(logits[i])
                e.position += 1
                e.last_token = tok
                ev = e.state.advance(tok)
            except Exception as ex:
                log.exception("sampling failed")
                self._retire(e, e.state.final(FINISH_ERROR, RngdPdError(f"sampling failed: {ex!r}")))
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

    def _retire(self, e: _Entry, ev: TokenEvent) -> None:
        """Free the slot at once, then send the request's one final event."""
        with self._lock:
            if e.bucket is not None and e.slot >= 0:
                e.bucket.active.pop(e.slot, None)
                heapq.heappush(e.bucket.free, e.slot)
                self._in_slots -= 1
                e.slot = -1
            self._keys.pop(e.req.key, None)
            self._cancelled.discard(e.req.key)
            self._counters["finished"] += 1
            self._wake.notify()
        self._emit(e, ev)

    def _emit(self, e: _Entry, ev: TokenEvent) -> None:
        try:
            e.req.emit(ev)
        except Exception:
            log.exception("emit failed for request %s; cancelling it", e.req.key)
            if not ev.finished:
                self.cancel(e.req.key)
