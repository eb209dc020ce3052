"""Engines: prefill (whole or chunked prompt -> first token + KV), decode (slots, continuous
batching, buckets) and colocated (both in one process). See docs/engine.md."""

from __future__ import annotations

from rngd_pd.engine.colocated import ColocatedEngine
from rngd_pd.engine.decode import DecodeEngine
from rngd_pd.engine.prefill import PrefillEngine
from rngd_pd.engine.request import DecodeRequest, GenerationResult, PrefillResult, RequestState, TokenEvent

__all__ = [
    "ColocatedEngine",
    "DecodeEngine",
    "DecodeRequest",
    "GenerationResult",
    "PrefillEngine",
    "PrefillResult",
    "RequestState",
    "TokenEvent",
]
