"""Prefill: a prompt -> its first token and its per-layer KV, whole or in chunks.

A prompt longer than `chunk_size` is prefilled chunk by chunk, each chunk attending over the cache
the earlier chunks built (`Llama.prefill(past=...)`), so one long prompt costs bounded activation
memory. The prompt's KV is assembled in one buffer per layer; `on_layer(i, K, V)` receives layer i's
complete K/V as soon as the last chunk has computed it, so a transport pushes layer i while layers
i+1.. are still running.

With a prefix cache (`rngd_pd.engine.prefix`), the longest cached block-aligned prefix of the prompt
is copied in instead of computed and only the rest runs, as a chunk after that past; `on_layer` still
gets the whole prompt's K/V. `cache_prefix` computes a prompt's head into that cache only: pd prefills
a long prompt as several requests this way, other prompts taking turns between them
(`rngd_pd.engine.prefill_queue`); its last request then computes only the last chunk.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rngd_pd.devices.runtime import DeviceRuntime, KVList, prefill_shapes
from rngd_pd.devices.torch_runtime import as_runtime
from rngd_pd.engine.kv_events.publisher import EventSink
from rngd_pd.engine.prefix import PrefixCache
from rngd_pd.engine.request import PrefillResult, check_request
from rngd_pd.errors import ConfigError
from rngd_pd.model.grammar import grammars_for
from rngd_pd.model.sampling import Sampler, SamplingParams, TokenLogprobs, prompt_logprobs

OnLayer = Callable[[int, Any, Any], None]
CHUNKED_KEYS = 1024  # requests whose earlier chunks this engine remembers (for the hit rate only)


class PrefillEngine:
    """Runs prompts one at a time (callers serialise or use one engine per thread).

    `loaded` is a DeviceRuntime (rngd_pd.devices.runtime), or a LoadedModel to run on the CPU.
    """

    def __init__(
        self,
        loaded: DeviceRuntime | Any,
        kv_dtype: Any = "bf16",
        chunk_size: int | None = 512,
        max_context: int | None = None,
        prefix_cache_bytes: int = 0,
        prefix_block: int = 16,
        events: EventSink | None = None,
    ) -> None:
        """prefix_cache_bytes: memory for reused prefixes' KV (0 = no prefix reuse), in blocks of
        prefix_block tokens; `events` is told every change of that cache (KV events)."""
        if chunk_size is not None and chunk_size < 1:
            raise ConfigError(f"chunk_size must be >= 1 (or None for whole prompts), got {chunk_size}")
        self.runtime = as_runtime(loaded)
        self.loaded = self.runtime.loaded
        self.config = self.loaded.config
        self.kv_dtype = self.runtime.dtype(kv_dtype)
        self.chunk_size = chunk_size
        self.max_context = min(max_context or self.config.max_context, self.config.max_context)
        self.runtime.prepare(prefill_shapes(chunk_size, self.max_context, self.kv_dtype))
        c = self.config
        self.prefix_cache = PrefixCache(self.runtime, c.num_layers, c.num_kv_heads, c.head_dim,
                                        self.kv_dtype, prefix_cache_bytes, prefix_block, events) \
            if prefix_cache_bytes > 0 else None
        self._looked_up: OrderedDict[str, int] = OrderedDict()  # key -> prompt tokens its chunks looked up
        self._looked_up_lock = threading.Lock()

    def validate(self, key: str, token_ids: Sequence[int], params: SamplingParams) -> Any:
        """Check the request and return its tokens as the device's int64 [T]; raises before any compute."""
        return self.runtime.tokens(self._ids(key, token_ids, params))

    def _ids(self, key: str, token_ids: Sequence[int], params: SamplingParams) -> np.ndarray:
        check_request(len(token_ids), params, self.max_context, key=key)
        try:
            ids = np.asarray(list(token_ids))
            if ids.dtype.kind not in "iu":
                raise TypeError(f"got {ids.dtype} values")
            ids = ids.astype(np.int64)
        except (TypeError, ValueError, OverflowError) as e:
            raise ConfigError(f"token ids must be integers: {e}", key=key) from None
        vocab = self.config.vocab_size
        bad = (ids < 0) | (ids >= vocab)
        if bad.any():
            raise ConfigError(f"token id {int(ids[bad][0])} is outside the vocabulary [0, {vocab})", key=key)
        return ids

    def prefill(
        self,
        key: str,
        token_ids: Sequence[int],
        params: SamplingParams,
        on_layer: OnLayer | None = None,
        chunk_size: int | None = -1,
    ) -> PrefillResult:
        """Prefill one prompt; the first token is drawn with the request's sampler (draw 0), under
        its grammar when it has one (`params.structured`; decode's constraint accepts it again).

        chunk_size -1 uses the engine's default, None prefills the whole prompt at once.
        on_layer(i, K, V) gets layer i's K/V of the whole prompt [kv_heads, T, head_dim] in kv_dtype
        (on the device: runtime.to_host before a transport), called from this thread during the last
        chunk; it may push to a transport but must not keep mutating the tensors. An exception from
        on_layer aborts the prefill.
        """
        ids = self._ids(key, token_ids, params)
        tokens = self.runtime.tokens(ids)
        constraint = grammars_for(self.loaded.tokenizer).constraint(params.structured)  # before compute
        chunk = self.chunk_size if chunk_size == -1 else chunk_size
        cache = self.prefix_cache
        # prompt logprobs need every position's logits: no prefix reuse (its tokens' are not kept)
        prompt = _PromptLogprobs(ids, params.prompt_logprobs) if params.prompt_logprobs is not None else None
        own = self._chunked_before(key)
        with self.runtime.inference():
            names = cache.hashes(ids) if cache is not None else []
            cached, blocks = cache.match(ids, names, own) if cache is not None and prompt is None else (0, [])
            if not cached and (chunk is None or len(tokens) <= chunk):
                logits, kv = self.runtime.prefill(tokens, on_layer=on_layer, kv_dtype=self.kv_dtype,
                                                  all_logits=prompt is not None)
                logits = prompt.add(0, logits) if prompt is not None else logits
            else:
                logits, kv = self._chunked(tokens, chunk or len(tokens), on_layer, cached, blocks, prompt)
            # each choice its own grammar state (the compiled grammar is cached)
            constraints = [constraint, *(grammars_for(self.loaded.tokenizer).constraint(params.structured)
                                         for _ in range(1, params.n))]
            first = [Sampler(params, choice=i, prompt_ids=token_ids, eos_ids=self.config.eos_token_ids
                             ).choose(logits, constraints[i]) for i in range(params.n)]
            if cache is not None:
                cache.insert(ids, kv, cached, names)
        return PrefillResult(first_token=first[0].token, num_tokens=len(tokens), kv=kv,
                             cached_tokens=max(0, cached - own), first=first,
                             prompt_logprobs=None if prompt is None else prompt.rows)

    def cache_prefix(self, key: str, token_ids: Sequence[int]) -> tuple[int, int]:
        """Compute the KV of `token_ids`' full blocks into the prefix cache only: no token sampled,
        nothing handed over. Returns (leading tokens the cache holds now, 0 without a prefix cache:
        the caller must then send the prompt whole; tokens of this chunk reused from other requests).
        Over a request's chunks (`key`) the hit rate counts each prompt token once, as reused only
        when another request cached it."""
        cache = self.prefix_cache
        if cache is None:
            return 0, 0
        ids = self._ids(key, token_ids, SamplingParams(max_tokens=1))
        own = self._chunked_before(key)
        with self.runtime.inference():
            names = cache.hashes(ids)
            cached, blocks = cache.match(ids, names, own, leave=0)  # leave=0: every full block counts
            full = len(names) * cache.block
            if cached < full:
                tokens = self.runtime.tokens(ids[:full])
                _, kv = self._chunked(tokens, self.chunk_size or full, None, cached, blocks)
                cache.insert(ids[:full], kv, cached, names)
        with self._looked_up_lock:
            self._looked_up[key] = max(own, len(ids))
            self._looked_up.move_to_end(key)
            while len(self._looked_up) > CHUNKED_KEYS:
                self._looked_up.popitem(last=False)
        return cache.present(names), max(0, cached - own)

    def _chunked_before(self, key: str) -> int:
        """Prompt tokens `key`'s earlier chunks looked up in the prefix cache (cache_prefix); forgets them."""
        with self._looked_up_lock:
            return self._looked_up.pop(key, 0)

    def _chunked(self, tokens: Any, chunk: int, on_layer: OnLayer | None, cached: int = 0,
                 blocks: Sequence[Any] = (), prompt: _PromptLogprobs | None = None) -> tuple[Any, KVList]:
        """Chunks of `chunk` tokens after the first `cached` ones, which come from the prefix cache;
        with `prompt`, each chunk's logits of every position go into its logprobs."""
        cfg, total = self.config, len(tokens)
        shape = (cfg.num_kv_heads, total, cfg.head_dim)
        kv = [
            (self.runtime.empty(shape, self.kv_dtype), self.runtime.empty(shape, self.kv_dtype))
            for _ in range(cfg.num_layers)
        ]
        if cached:
            assert self.prefix_cache is not None
            self.prefix_cache.fill(blocks, kv)
        logits = None
        for start in range(cached, total, chunk):
            end = min(start + chunk, total)
            last = end == total

            def store(i: int, k: Any, v: Any, start: int = start, end: int = end, last: bool = last) -> None:
                kv[i][0][:, start:end].copy_(k)
                kv[i][1][:, start:end].copy_(v)
                if last and on_layer is not None:
                    on_layer(i, kv[i][0], kv[i][1])

            past = [(k[:, :start], v[:, :start]) for k, v in kv] if start else None
            logits, _ = self.runtime.prefill(tokens[start:end], past=past, on_layer=store,
                                             kv_dtype=self.kv_dtype, all_logits=prompt is not None)
            if prompt is not None:
                logits = prompt.add(start, logits)
        assert logits is not None
        return logits, kv


class _PromptLogprobs:
    """The prompt's logprobs, gathered chunk by chunk: row i is prompt token i + 1 with the top k at
    position i (token 0 has none); only the rows are kept, never the [T, vocab] logits."""

    def __init__(self, ids: np.ndarray, k: int) -> None:
        self.ids, self.k = ids, k
        self.rows: list[TokenLogprobs] = []

    def add(self, start: int, logits: Any) -> Any:
        """Logits [n, vocab] of positions start.. -> their rows; returns the last position's logits."""
        targets = self.ids[start + 1:start + 1 + int(logits.shape[0])]
        self.rows += prompt_logprobs(logits[:len(targets)], targets.tolist(), self.k)
        return logits[-1]
