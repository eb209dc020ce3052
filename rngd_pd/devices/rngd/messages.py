"""The messages between RngdRuntime and its card worker in `.venv-rngd`: a JSON header and raw tensor
bytes, read the same by torch 2.13 (serving) and torch 2.10 (the worker).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Any

import torch

from rngd_pd.config.dtypes import short_dtype, torch_name


def pack_message(header: dict[str, Any], tensors: Sequence[Any] = ()) -> bytes:
    """One worker message: u32 header length, the JSON header (with the tensors' dtype and
    shape), then each tensor's raw bytes (torch tensors; torch 2.13 and 2.10 share the layout)."""
    blobs, meta = [], []
    for t in tensors:
        t = t.detach().contiguous().cpu()
        blobs.append(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        meta.append({"dtype": short_dtype(t.dtype), "shape": list(t.shape), "nbytes": len(blobs[-1])})
    head = json.dumps({**header, "tensors": meta}).encode()
    return struct.pack("<I", len(head)) + head + b"".join(blobs)


def read_message(stream: Any) -> tuple[dict[str, Any], list[Any]]:
    """The inverse of pack_message, read from a binary stream; EOFError at its end."""
    raw = stream.read(4)
    if len(raw) < 4:
        raise EOFError("the RNGD worker closed its pipe")
    header = json.loads(stream.read(struct.unpack("<I", raw)[0]))
    out = []
    for m in header.pop("tensors", []):
        buf = bytearray(stream.read(m["nbytes"]))
        dtype = getattr(torch, torch_name(m["dtype"]))
        flat = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
        out.append(flat.view(dtype).reshape(m["shape"]))
    return header, out
