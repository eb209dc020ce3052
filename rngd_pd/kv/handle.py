"""The KV handle: a small versioned JSON document describing one request's KV blobs.

It travels from prefill to decode (through Triton as a BYTES tensor, and as the last blob of the
request on the transport). The receiver validates it against what its own model expects *before*
touching any bytes: a mismatch is a `TransportIntegrityError` naming the field and both values, never a
silent conversion.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from rngd_pd.config.dtypes import DTYPES, KV_DTYPES
from rngd_pd.errors import TransportIntegrityError
from rngd_pd.kv.buffers import CHECKSUMS, DEFAULT_CHECKSUM, as_bytes, checksum

FORMAT_VERSION = 1
# Per layer, K and V each [num_kv_heads, num_tokens, head_dim], C-contiguous (Llama.prefill's output).
LAYOUT_HTD = "htd"


def k_index(layer: int) -> int:
    """Blob index of layer `layer`'s K."""
    return 2 * layer


def v_index(layer: int) -> int:
    """Blob index of layer `layer`'s V."""
    return 2 * layer + 1


def handle_index(num_layers: int) -> int:
    """Blob index of the handle itself: after every K/V blob, pushed last."""
    return 2 * num_layers


@dataclass(frozen=True)
class KVSpec:
    """What a receiver expects: its model's identity and KV geometry."""

    fingerprint: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bf16"
    layout: str = LAYOUT_HTD


@dataclass
class KVHandle:
    """Everything a decode process needs to find, size and verify one request's KV."""

    key: str
    transport: str
    fingerprint: str
    num_tokens: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    first_token: int
    dtype: str = "bf16"
    layout: str = LAYOUT_HTD
    sizes: list[int] = field(default_factory=list)
    checksums: list[int] = field(default_factory=list)
    checksum_algorithm: str = DEFAULT_CHECKSUM
    locator: dict[str, Any] = field(default_factory=dict)
    version: int = FORMAT_VERSION
    first_tokens: list[int] = field(default_factory=list)  # n > 1: choice i's first token

    @property
    def blob_nbytes(self) -> int:
        """The size every K or V blob must have given the geometry."""
        return self.num_kv_heads * self.num_tokens * self.head_dim * DTYPES[self.dtype].itemsize

    @property
    def num_blobs(self) -> int:
        return 2 * self.num_layers

    def to_json(self) -> bytes:
        """Compact UTF-8 JSON; the version goes first so any reader can check it before the rest."""
        d = asdict(self)
        if not d["first_tokens"]:
            del d["first_tokens"]  # n = 1: the handle of before n existed, byte for byte
        return json.dumps({"version": d.pop("version"), **d}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes | bytearray | memoryview | str) -> KVHandle:
        """Parse a handle; the format version is checked before any other field is read."""
        try:
            d = json.loads(bytes(raw) if not isinstance(raw, str) else raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise TransportIntegrityError(f"KV handle is not valid JSON ({e})") from None
        if not isinstance(d, dict) or d.get("version") != FORMAT_VERSION:
            got = d.get("version") if isinstance(d, dict) else type(d).__name__
            raise TransportIntegrityError(
                f"KV handle format version: expected {FORMAT_VERSION}, got {got!r}; "
                "prefill and decode run different rngd-pd versions"
            )
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise TransportIntegrityError(f"KV handle has unknown fields {unknown}")
        try:
            return cls(**d)
        except TypeError as e:
            raise TransportIntegrityError(f"KV handle is incomplete: {e}", key=d.get("key")) from None

    def seal(self, blobs: list[Any]) -> KVHandle:
        """Fill sizes and checksums from the K/V blobs in index order (the sender's side)."""
        views = [as_bytes(b) for b in blobs]
        self.sizes = [len(v) for v in views]
        self.checksums = [checksum(v, self.checksum_algorithm) for v in views]
        return self

    def validate(self, expected: KVSpec) -> None:
        """Refuse a handle that does not fit the receiver's model before any blob is read."""
        if self.version != FORMAT_VERSION:
            self._mismatch("version", FORMAT_VERSION, self.version)
        if self.fingerprint != expected.fingerprint:
            raise TransportIntegrityError(
                f"KV handle fingerprint {self.fingerprint!r}: this KV was computed with other model weights "
                f"than this decode serves ({expected.fingerprint!r}); the weights changed in between (a "
                "partial update, or another checkpoint). Refusing to decode it; send the request again",
                key=self.key,
            )
        for name in ("num_layers", "num_kv_heads", "head_dim", "dtype", "layout"):
            want, got = getattr(expected, name), getattr(self, name)
            if want != got:
                self._mismatch(name, want, got)
        if self.dtype not in KV_DTYPES:
            self._mismatch("dtype", "/".join(KV_DTYPES), self.dtype)
        if self.checksum_algorithm not in CHECKSUMS:
            self._mismatch("checksum_algorithm", "/".join(CHECKSUMS), self.checksum_algorithm)
        if self.num_tokens <= 0:
            self._mismatch("num_tokens", "> 0", self.num_tokens)
        if len(self.sizes) != self.num_blobs or len(self.checksums) != self.num_blobs:
            self._mismatch("sizes/checksums count", self.num_blobs, (len(self.sizes), len(self.checksums)))
        for i, size in enumerate(self.sizes):
            if size != self.blob_nbytes:
                self._mismatch(f"sizes[{i}]", self.blob_nbytes, size)

    def verify_blob(self, index: int, data: Any) -> None:
        """Check one received blob's size and checksum against the handle (the receiver's side)."""
        view = as_bytes(data)
        self.verify_sum(index, len(view), checksum(view, self.checksum_algorithm))

    def verify_sum(self, index: int, size: int, value: int) -> None:
        """Check a blob's size and checksum (computed by the receiver with the handle's algorithm)."""
        if size != self.sizes[index]:
            self._mismatch(f"size of blob {index}", self.sizes[index], size)
        if value != self.checksums[index]:
            self._mismatch(f"{self.checksum_algorithm} of blob {index}", self.checksums[index], value)

    def _mismatch(self, name: str, want: Any, got: Any) -> None:
        raise TransportIntegrityError(
            f"KV handle field {name}: expected {want!r}, got {got!r}; refusing to decode this KV",
            key=self.key,
        )
