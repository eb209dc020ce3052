"""The fan-out load under which Triton 2.51's stub deadlocks on decoupled BLS streams: a repository with
`echo` and `fan` (rngd_pd/testing/assets), and the one request that makes `fan` open its streams.
bench/bls_deadlock.py measures the stall rate with it; tests/test_bls_deadlock.py requires the gRPC way
to complete."""

from __future__ import annotations

import queue
from pathlib import Path

import numpy as np

from rngd_pd.testing import e2e as E
from rngd_pd.testing.assets import ECHO, FAN
from rngd_pd.testing.assets.echo_model import SPEC as ECHO_SPEC
from rngd_pd.testing.assets.fan_model import SPEC as FAN_SPEC
from rngd_pd.testing.repository import config_pbtxt, write_model


def repository(root: Path, via: str) -> Path:
    """`echo` (threads on, no delay) and `fan` reaching it `via` bls or grpc, laid out under `root`."""
    write_model(root, "echo", ECHO, config_pbtxt(ECHO_SPEC, {"delay_ms": "0", "threads": "true"}))
    write_model(root, "fan", FAN, config_pbtxt(FAN_SPEC, {"via": via}))
    return root


def fan(url: str, threads: int, loops: int, tokens: int, spin: int, limit: float) -> int | None:
    """Streams `fan` completed, or None when it did not answer within `limit` seconds."""
    inputs = {name: np.array([v], np.int32) for name, v in
              (("threads", threads), ("loops", loops), ("tokens", tokens), ("spin", spin))}
    try:
        got = E.stream_infer(url, "fan", inputs, ("count",), timeout=limit)
    except queue.Empty:
        return None
    return int(got[-1]["count"].reshape(-1)[0])
