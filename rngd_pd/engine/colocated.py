"""Colocated serving: prefill and decode in one process, KV handed over by a memory copy.

The reference every disaggregated path is compared with (same tokens, no transfer) and the baseline
for throughput: a PrefillEngine feeding a continuous-batching DecodeEngine in the same process.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from rngd_pd.devices.runtime import DeviceRuntime
from rngd_pd.devices.torch_runtime import as_runtime
from rngd_pd.engine.decode import DecodeEngine
from rngd_pd.engine.prefill import PrefillEngine
from rngd_pd.engine.request import DecodeRequest, GenerationResult, PrefillResult, TokenEvent
from rngd_pd.model.sampling import SamplingParams

_ids = itertools.count()


class ColocatedEngine:
    """generate()/stream() from prompt ids; safe to call from several threads at once (prefills run
    one after another, decodes share the slots)."""

    def __init__(
        self,
        loaded: DeviceRuntime | Any,
        num_slots: int = 1,
        max_len: int | None = None,
        kv_dtype: Any = "bf16",
        chunk_size: int | None = 512,
        max_queue: int = 64,
        buckets: Sequence[int] | Mapping[int, int] | None = None,
        prefix_cache_bytes: int = 0,
        prefix_block: int = 16,
    ) -> None:
        """prefix_cache_bytes: memory for the KV of prompt prefixes reused across requests (0 = off),
        in blocks of prefix_block tokens."""
        self.runtime = as_runtime(loaded)
        self.loaded = loaded = self.runtime.loaded
        max_len = min(max_len or loaded.config.max_context, loaded.config.max_context)
        self.prefill_engine = PrefillEngine(self.runtime, kv_dtype, chunk_size, max_context=max_len,
                                            prefix_cache_bytes=prefix_cache_bytes, prefix_block=prefix_block)
        self.decode_engine = DecodeEngine(self.runtime, num_slots, max_len, kv_dtype, max_queue, buckets)
        self.decode_engine.start()
        # one prefill at a time: concurrent prefills only fight over the same
        # cores (and their OpenMP teams oversubscribe them) and delay every first token
        self._prefill_lock = threading.Lock()

    def close(self) -> None:
        self.decode_engine.stop()
        self.runtime.loaded.close()  # lets go of the weight store

    def __enter__(self) -> ColocatedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams, key: str | None = None,
        on_prefill: Callable[[PrefillResult], None] | None = None,
    ) -> Iterator[TokenEvent]:
        """Yield one TokenEvent per generated token; the last has finished=True (with n > 1,
        the events of the n choices interleave, each with its `index`, until each has finished).
        on_prefill gets the prefill's result first (its prompt logprobs, when asked for).

        Validation errors (ConfigError, ContextLengthError, CapacityError) raise before anything is
        yielded; an engine error arrives as the final event's `error` and is raised here. Closing
        the iterator early cancels the request.
        """
        key = key or f"colocated-{next(_ids)}"
        self.prefill_engine.validate(key, prompt_ids, params)
        with self._prefill_lock:
            pre = self.prefill_engine.prefill(key, prompt_ids, params)
        events: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()

        def load_kv(cache, slot: int) -> None:
            cache.load_all(slot, pre.kv)

        req = DecodeRequest(key, pre.num_tokens, pre.first, params, load_kv, events.put,
                            prompt_ids=prompt_ids if params.repetition_penalty != 1 else ())
        if on_prefill is not None:
            on_prefill(pre)
        self.decode_engine.submit(req)
        done = False
        running = params.n  # choices not finished yet
        try:
            while not done:
                ev = events.get()
                running -= ev.finished
                done = running == 0 or ev.error is not None
                if ev.error is not None:
                    raise ev.error
                yield ev
        finally:
            if not done:
                self.decode_engine.cancel(key)

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> GenerationResult:
        """Run one request to the end and collect its tokens and text."""
        tokens: list[int] = []
        text: list[str] = []
        reason = ""
        for ev in self.stream(prompt_ids, params):
            if ev.token_id is not None:
                tokens.append(ev.token_id)
            text.append(ev.text)
            reason = ev.finish_reason or reason
        return GenerationResult(tokens, list(prompt_ids), "".join(text), reason)
