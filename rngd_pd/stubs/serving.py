"""What the repository's model.py files share: their parameter dataclasses, reading a request's
inputs and building the KV transport (loading a model onto its device: stubs/loading.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rngd_pd.config.env import (
    RNGD_PD_DECODE_URL,
    RNGD_PD_DECODE_VIA,
    RNGD_PD_MODEL,
    RNGD_PD_PREFILL_URL,
)
from rngd_pd.config.params import (
    ServingParams,
    describe,
    param,
    parse_params,
)
from rngd_pd.host.children import exit_when_orphaned
from rngd_pd.kv import Transport, load_transport
from rngd_pd.kv.registry import require_servable
from rngd_pd.stubs import pbutils


@dataclass(frozen=True)
class PrefixParams:
    """Prefix reuse (rngd_pd.engine.prefix), in every model that prefills."""

    prefix_cache_mb: int = param(512, help="host memory for reused prompt prefixes' KV (0 = no reuse)")
    prefix_block: int = param(16, help="tokens per prefix cache block (prefixes are reused in whole blocks); "
                                       "with KV events also the block size a router must hash with")

    def prefix_kwargs(self) -> dict[str, int]:
        return {"prefix_cache_bytes": max(0, self.prefix_cache_mb) << 20, "prefix_block": self.prefix_block}


@dataclass(frozen=True)
class PrefillParams(PrefixParams, ServingParams):
    chunk_size: int = param(512, help="prefill long prompts in chunks of this many tokens (0 = whole)")
    max_len: int = param(4096, help="longest prompt + max_tokens accepted")


@dataclass(frozen=True)
class SlotParams:
    """Decode's slots, in every model that decodes (rngd_pd.engine.capacity)."""

    num_slots: int = param(0, help="concurrent decode streams per instance (continuous batching); 0 = sized "
                                   "at load from the measured step time and the free memory (at most 16)")
    step_target_ms: float = param(100.0, help="num_slots 0: the most rows whose decode step, measured at "
                                               "load on the cores decode gets while the other instances "
                                               "are idle, takes at most this long")
    kv_cache_mb: int = param(0, help="num_slots 0: memory for decode's KV cache (0 = a quarter of the "
                                     "memory free at load)")


@dataclass(frozen=True)
class DecodeParams(SlotParams, ServingParams):
    max_len: int = param(4096, help="longest prompt + max_tokens one slot holds")
    max_queue: int = param(64, help="requests waiting for a slot before CapacityError")
    # It includes the time the request's last prefill turn waits in Triton's queue of the prefill model (pd
    # starts decode with that turn), so it is generous; a prefill that fails makes pd cancel the decode
    # request, which ends the wait at once.
    kv_timeout_s: float = param(300.0, help="how long decode waits for a request's KV")
    # Off by default: on the 2-core hosts measured it did not pay (docs/benchmarks.md, "Conditional
    # disaggregation on the current code").
    local_prefill_tokens: int = param(0, help="prompts up to this long are prefilled by decode itself, "
                                              "no hand-off (0 = never, -1 = measured at load)")
    pack_weights: bool = param(True, help="cpu: keep oneDNN-packed copies of the weights for decode "
                                          "(faster, batch-invariant; one more copy of the model in "
                                          "memory); false: decode runs on the shared weights (an 8B "
                                          "model's prefill and decode on one 24 GiB host)")


@dataclass(frozen=True)
class ColocatedParams(SlotParams, PrefixParams, ServingParams):
    max_len: int = param(4096, help="longest prompt + max_tokens")
    chunk_size: int = param(512, help="prefill chunk (0 = whole prompt)")
    max_inflight: int = param(32, help="requests run at once (one worker thread each, a fixed pool)")
    max_queue: int = param(64, help="requests waiting for a worker before CapacityError")


@dataclass(frozen=True)
class PdParams:
    prefill_url: str | None = param(env=RNGD_PD_PREFILL_URL,
                                    help="gRPC host:port of a tritonserver with prefill (empty: BLS here)")
    decode_url: str | None = param(env=RNGD_PD_DECODE_URL,
                                   help="gRPC host:port of a tritonserver with decode (empty: this one)")
    decode_via: str = param(env=RNGD_PD_DECODE_VIA, choices=("grpc", "bls"),
                            help="how pd reaches a decode in this server: its own gRPC endpoint, or BLS "
                                 "(which can deadlock Triton 2.51's stub under load: docs/serving.md)")
    prefill_model: str = param("prefill", help="name of the prefill model")
    decode_model: str = param("decode", help="name of the decode model")
    # Each running request holds up to two of the Python backend's pool threads (its prefill and its
    # decode BLS call wait on them), so `rngd-pd serve` sizes thread-pool-size from this.
    max_inflight: int = param(32, help="requests orchestrated at once (fixed pools of workers)")
    max_queue: int = param(64, help="requests waiting for a worker before CapacityError")
    local_prefill_tokens: int = param(-1, help="prompts up to this long are prefilled by decode itself "
                                               "(-1 = the length decode measured, 0 = always hand off)")
    prefill_slots: int = param(1, help="prompts sent to one prefill server at once, the rest waiting in pd "
                                       "shortest first (its instance count; 0 = all at once, Triton's order)")
    prefill_chunk: int = param(512, help="prompts longer than this go to prefill in chunks, other prompts "
                                         "between them (needs prefill's prefix cache; 0 = whole prompts)")
    prefill_aging: float = param(1000.0, help="prompt tokens a second of waiting for prefill is worth in "
                                              "pd's shortest-first order (0 = by length alone)")
    local_prefill_when: str = param("busy", choices=("busy", "always"),
                                    help="busy: prefill a short prompt on decode when fewer prompt tokens "
                                         "wait there than for prefill; always: by length alone")


@dataclass(frozen=True)
class TextParams:
    model_path: str | None = param(env=RNGD_PD_MODEL, help="checkpoint whose tokenizer to use")


def model_params(cls: type, args: Mapping[str, Any]) -> Any:
    """Parse this model's parameters from Triton's initialize args and log them. Every model's
    `initialize` starts here, so this is also where the stub learns to exit with its tritonserver."""
    exit_when_orphaned()
    params = parse_params(cls, args["model_config"])
    pbutils.log(f"{args.get('model_name', '?')} ({args.get('model_instance_name', '?')}): {describe(params)}")
    return params


def transport_params(cls: type, args: Mapping[str, Any]) -> Any:
    """`model_params` for a model that hands KV over (prefill, decode): a transport serving refuses
    (`rngd_pd.kv.registry.require_servable`) fails the load here, before any weights are read."""
    params = model_params(cls, args)
    require_servable(params.kv_transport)
    return params


def getter(request: Any) -> Callable[[str], Any]:
    """`get(name)` -> numpy array or None for one Triton request (for rngd_pd.wire.inputs)."""
    return lambda name: pbutils.input_array(request, name)


def transport_for(params: ServingParams) -> Transport:
    """The configured KV transport, built with its options (a bad option fails the model's load)."""
    options = {"config": params.kv_options} if params.kv_options else {}
    return load_transport(params.kv_transport, **options)
