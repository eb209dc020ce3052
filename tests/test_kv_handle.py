"""KV handle (versioned JSON, validation before bytes) and the zero-copy buffer helpers."""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest
import torch

from rngd_pd.errors import TransportError, TransportIntegrityError
from rngd_pd.kv.buffers import as_bytes, as_writable_bytes, checksum
from rngd_pd.kv.handle import FORMAT_VERSION, KVHandle, KVSpec, handle_index, k_index, v_index

SPEC = KVSpec(fingerprint="fp-abc", num_layers=2, num_kv_heads=3, head_dim=4, dtype="bf16")


def make_handle(**over) -> tuple[KVHandle, list[torch.Tensor]]:
    blobs = [torch.randn(3, 5, 4).to(torch.bfloat16) for _ in range(4)]
    h = KVHandle(key="r1", transport="shm", fingerprint="fp-abc", num_tokens=5, num_layers=2,
                 num_kv_heads=3, head_dim=4, first_token=42, locator={"root": "/dev/shm/x"}).seal(blobs)
    for k, v in over.items():
        setattr(h, k, v)
    return h, blobs


def test_blob_indices():
    assert (k_index(0), v_index(0), k_index(29), v_index(29), handle_index(30)) == (0, 1, 58, 59, 60)


def test_roundtrip_json_and_validate():
    h, blobs = make_handle()
    raw = h.to_json()
    assert raw.startswith(b'{"version":%d' % FORMAT_VERSION)
    back = KVHandle.from_json(raw)
    assert back == h
    back.validate(SPEC)
    for i, b in enumerate(blobs):
        back.verify_blob(i, b)
    assert back.sizes == [3 * 5 * 4 * 2] * 4 and back.checksum_algorithm == "crc32c"


@pytest.mark.parametrize(("field", "value"), [
    ("fingerprint", "other-model"), ("dtype", "fp16"), ("layout", "thd"), ("num_layers", 3),
    ("num_kv_heads", 8), ("head_dim", 128)])
def test_validate_names_field_and_both_values(field, value):
    h, _ = make_handle(**{field: value})
    with pytest.raises(TransportIntegrityError) as e:
        h.validate(SPEC)
    msg = str(e.value)
    assert field in msg and repr(value) in msg and repr(getattr(SPEC, field)) in msg and "r1" in msg


def test_validate_refuses_wrong_sizes():
    h, _ = make_handle()
    h.sizes[2] += 2
    with pytest.raises(TransportIntegrityError, match=r"sizes\[2\]"):
        h.validate(SPEC)


def test_version_checked_before_anything_else():
    d = json.loads(make_handle()[0].to_json())
    d["version"] = 99
    d["fingerprint"] = 7  # would be wrong too, but the version is reported
    with pytest.raises(TransportIntegrityError, match="format version: expected 1, got 99"):
        KVHandle.from_json(json.dumps(d))
    with pytest.raises(TransportIntegrityError, match="not valid JSON"):
        KVHandle.from_json(b"\xff{")
    d["version"] = 1
    d["surprise"] = 1
    with pytest.raises(TransportIntegrityError, match="unknown fields"):
        KVHandle.from_json(json.dumps(d))


def test_verify_blob_detects_corruption_and_size():
    h, blobs = make_handle()
    bad = blobs[1].clone()
    bad.view(torch.uint8).view(-1)[0] ^= 1
    with pytest.raises(TransportIntegrityError, match="crc32c of blob 1"):
        h.verify_blob(1, bad)
    with pytest.raises(TransportIntegrityError, match="size of blob 0"):
        h.verify_blob(0, b"short")


@pytest.mark.parametrize("alg", ["crc32c", "crc32", "xxh3"])
def test_checksum_algorithms(alg):
    h, blobs = make_handle(checksum_algorithm=alg)
    h.seal(blobs)
    h.verify_blob(3, blobs[3])
    if alg == "crc32":
        assert h.checksums[0] == zlib.crc32(blobs[0].view(torch.uint8).numpy().tobytes())


def test_unknown_checksum_is_refused():
    with pytest.raises(TransportError, match="unknown checksum algorithm 'md5'"):
        checksum(b"x", "md5")
    h, _ = make_handle(checksum_algorithm="md5")
    with pytest.raises(TransportIntegrityError, match="checksum_algorithm"):
        h.validate(SPEC)


def test_views_do_not_copy():
    t = torch.zeros(2, 3, dtype=torch.bfloat16)
    mv = as_writable_bytes(t)
    assert len(mv) == 12 and not mv.readonly
    mv[0] = 0x80
    assert t.view(torch.uint8)[0, 0] == 0x80  # same memory
    a = np.zeros((4, 4), np.float32)
    as_writable_bytes(a)[4] = 1
    assert a.view(np.uint8)[0, 4] == 1
    assert as_bytes(b"abc").readonly


def test_views_refuse_what_cannot_be_viewed():
    with pytest.raises(TransportError, match="not contiguous"):
        as_bytes(torch.zeros(4, 4).t())
    with pytest.raises(TransportError, match="read-only"):
        as_writable_bytes(b"abc")
    with pytest.raises(TransportError, match="not C-contiguous"):
        as_bytes(np.zeros((4, 4))[:, 1])
    with pytest.raises(TransportError, match="cannot view"):
        as_bytes(12)
