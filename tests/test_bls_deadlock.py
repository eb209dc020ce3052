"""e2e: the load under which decoupled BLS deadlocks Triton 2.51's stub, through the gRPC path pd uses.

`bench/bls_deadlock.py` reproduces the deadlock itself (a race, so a rate: by BLS 2 of 3 runs of 16
threads x 30 streams stalled here, bench/results/decode-via-2026-12-02). This test runs the same
fan-out load (rngd_pd.testing.fanout) with `via grpc` and requires every stream back, with and without
threads keeping the GIL busy.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rngd_pd.testing import fanout
from tests.triton_harness import triton_server

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(("loops", "spin"), [(20, 0), (3, 2)])
def test_concurrent_streams_over_the_servers_own_grpc_endpoint_all_complete(
        tmp_path: Path, loops: int, spin: int) -> None:
    threads, tokens = 16, 40
    with triton_server(fanout.repository(tmp_path / "repo", "grpc"), models=["echo", "fan"]) as server:
        assert fanout.fan(server.grpc_url, threads, loops, tokens, spin, limit=240) == threads * loops
