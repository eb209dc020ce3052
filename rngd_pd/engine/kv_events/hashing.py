"""Block hashes exactly as vLLM computes them with `--prefix-caching-hash-algo sha256_cbor`.

Block i of a prompt (its tokens [i*B, (i+1)*B), full blocks only) is named
`sha256(cbor2.dumps((parent, tuple(tokens), None), canonical=True))`, where `parent` is block i-1's
hash and, for the first block, NONE_HASH = `sha256(cbor2.dumps(seed, canonical=True))` with seed =
$PYTHONHASHSEED when set, else vLLM's fixed "vllm-none-hash" (`vllm/v1/core/kv_cache_utils.py`:
`init_none_hash`, `hash_block_tokens`; `vllm/utils/hashing.py`: `sha256_cbor`). A name therefore
stands for the whole prefix up to its block. Events carry a hash as vLLM does by default
(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1): its low 64 bits, big-endian, as an unsigned integer.

CBOR rather than pickle (vLLM's own default `sha256`) because an indexer in another language (llm-d's
is Go) can compute it; llm-d configures vLLM with sha256_cbor for that reason.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import cbor2

from rngd_pd.config.env import PYTHONHASHSEED

HASH_ALGO = "sha256_cbor"
DEFAULT_SEED = "vllm-none-hash"  # vLLM's DEFAULT_NONE_HASH_SEED for cryptographic hashes
MASK64 = (1 << 64) - 1


def sha256_cbor(value: object) -> bytes:
    """SHA-256 of the canonical CBOR encoding of `value` (vLLM's sha256_cbor)."""
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def hash_seed(env: Mapping[str, str] | None = None) -> str:
    """vLLM's seed rule: PYTHONHASHSEED if set (even empty), else the fixed default."""
    seed = PYTHONHASHSEED.exact(env)
    return DEFAULT_SEED if seed is None else seed


def none_hash(env: Mapping[str, str] | None = None) -> bytes:
    """The parent of every first block (vLLM's NONE_HASH)."""
    return sha256_cbor(hash_seed(env))


def block_hashes(ids: Sequence[int], block: int, root: bytes) -> list[bytes]:
    """The hash of each full block of `ids`, chained from `root` (none_hash()); ids as Python ints."""
    out, parent = [], root
    for start in range(0, len(ids) - block + 1, block):
        parent = sha256_cbor((parent, tuple(ids[start:start + block]), None))
        out.append(parent)
    return out


def external(block_hash: bytes) -> int:
    """How events carry a hash: the low 64 bits of its bytes read big-endian (vLLM's
    maybe_convert_block_hash with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, its default)."""
    return int.from_bytes(block_hash, "big") & MASK64
