"""e2e: pd over the tcp relay (started here) and over nixl-ucx: the same greedy tokens as the colocated
engine, and a relay SIGKILLed mid-transfer fails the requests in flight (each naming the transport,
none hanging), and new ones succeed once a relay is back. `nixl` (HETERO_NPU, a library transport)
is refused by the serving models, naming `nixl-ucx`.

Each server holds only prefill, decode and pd (preprocess/postprocess/llm do not depend on the
transport and are covered by test_e2e_pd.py), which keeps the start-up short on 2 cores.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from rngd_pd.kv.relay.proc import start_relay
from rngd_pd.serve.server import TritonServerError
from rngd_pd.testing import e2e as E
from tests.triton_harness import triton_server

pytestmark = pytest.mark.e2e
PD_OUT = ("output_ids", "finish_reason")
IN_FLIGHT = 3  # requests needing the relay when it is killed


def _check_tokens(server, kv_log: Path) -> None:
    """Greedy tokens equal the colocated engine's, and decode received the bytes prefill produced."""
    for text in E.PROMPTS:
        ids, _, reason = E.reference(text)
        responses = E.stream_infer(server.grpc_url, "pd", E.pd_inputs(E.prompt_ids(text)), PD_OUT)
        assert E.ids_of(responses) == list(ids), text
        assert E.reason_of(responses) == reason
    assert E.assert_kv_bytes_match(kv_log) == len(E.PROMPTS)


def _serve_with_retries(server, text: str, attempts: int = 3) -> list[int]:
    """pd tokens for text; a request may fail while pooled connections to a restarted relay are renewed."""
    last: Exception | None = None
    for _ in range(attempts):
        try:
            return E.ids_of(E.stream_infer(server.grpc_url, "pd", E.pd_inputs(E.prompt_ids(text)), PD_OUT))
        except RuntimeError as exc:
            last = exc
    raise AssertionError(f"no success after the relay came back: {last}")


@pytest.mark.long
def test_tcp_relay_tokens_and_relay_killed_mid_transfer(tmp_path: Path) -> None:
    relay = start_relay()
    host, port = relay.addr.rsplit(":", 1)
    try:
        env = {"AIRM_KV_TRANSPORT": "tcp", "AIRM_KV_TCP_ADDR": relay.addr,
               "RNGD_PD_KV_DEBUG_LOG": str(tmp_path / "kv.jsonl")}
        with triton_server(E.subset_repository(["prefill", "decode", "pd"]), "cpu", env) as server:
            _check_tokens(server, tmp_path / "kv.jsonl")
            errors: dict[int, tuple[str, float]] = {}

            def long_request(i: int) -> None:
                try:
                    E.stream_infer(server.grpc_url, "pd", E.pd_inputs([42 + i] * 1500, max_tokens=8), PD_OUT)
                except RuntimeError as exc:
                    errors[i] = (str(exc), time.monotonic())

            workers = [threading.Thread(target=long_request, args=(i,)) for i in range(IN_FLIGHT)]
            for worker in workers:
                worker.start()
            time.sleep(0.5)  # the first prefill of 1500 tokens is pushing layers now, the others queue
            relay.proc.kill()  # SIGKILL: no goodbye to any connection
            killed = time.monotonic()
            for worker in workers:
                worker.join(max(0.0, killed + 120 - time.monotonic()))
            assert not any(w.is_alive() for w in workers), "a request hung after the relay died"
            assert sorted(errors) == list(range(IN_FLIGHT)), errors  # every one needed the relay
            # prefill runs one request at a time: the queued ones reach the dead relay in turn, each
            # failing within 30 s of the kill or of the failure before it (it was 10-38 s after the
            # kill for the last of 4 on a loaded 2-core host)
            previous = killed
            for text, ended in sorted(errors.values(), key=lambda e: e[1]):
                assert "tcp" in text and "Transport" in text, text
                assert ended - previous < 30, f"failed {ended - previous:.0f} s after the one before: {text}"
                previous = ended
            relay = start_relay(host, int(port))  # the server keeps serving once the relay is back
            text = E.PROMPTS[0]
            assert _serve_with_retries(server, text) == list(E.reference(text)[0])
    finally:
        relay.stop()


def test_the_nixl_transport_is_refused_by_the_serving_models_naming_nixl_ucx() -> None:
    """AIRM_KV_TRANSPORT=nixl (as ai-rm sets it): prefill's and decode's loads fail, saying why."""
    with pytest.raises(TritonServerError) as info, triton_server(
            E.subset_repository(["prefill", "decode"]), "cpu", {"AIRM_KV_TRANSPORT": "nixl"}, timeout=120):
        pass
    message = str(info.value)
    for model in ("prefill", "decode"):
        refused = f"failed to load '{model}' version 1: Internal: ConfigError: KV transport 'nixl' cannot"
        assert refused in message, message[-3000:]
    assert "serve KV over NIXL with `nixl-ucx`" in message


@pytest.mark.nixl
def test_nixl_ucx_tokens(tmp_path: Path) -> None:
    with start_relay() as relay:
        env = {"AIRM_KV_TRANSPORT": "nixl-ucx", "AIRM_KV_TCP_ADDR": relay.addr, "AIRM_KV_UCX_POOL_MB": "64",
               "UCX_MODULES": "^ib", "RNGD_PD_KV_DEBUG_LOG": str(tmp_path / "kv.jsonl")}
        with triton_server(E.subset_repository(["prefill", "decode", "pd"]), "cpu", env) as server:
            _check_tokens(server, tmp_path / "kv.jsonl")
