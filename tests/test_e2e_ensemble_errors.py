"""e2e: a pd step that fails after tokens went out closes the llm ensemble request (errors in band).

The real llm ensemble, preprocess and postprocess, with a `pd` that streams two tokens and then fails
(tests/assets/failing_pd_model.py): the client gets the two text deltas, then the error naming the
transport, and Triton has nothing of the request left in flight.
"""

from __future__ import annotations

import shutil
import time
import urllib.request
from pathlib import Path

import pytest

from rngd_pd.testing import e2e as E
from tests.triton_harness import triton_server

pytestmark = pytest.mark.e2e
ASSET = Path(__file__).parent / "assets" / "failing_pd_model.py"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("ensemble-errors")
    for name in ("llm", "preprocess", "postprocess", "pd"):
        shutil.copytree(E.REPOSITORY / name, repo / name)
    shutil.copyfile(ASSET, repo / "pd" / "1" / "model.py")
    with triton_server(repo, None, {}) as s:
        yield s


def _pending(server, model: str) -> float:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("nv_inference_pending_request_count") and f'model="{model}"' in line:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("stream", [True, False])
def test_a_pd_failure_after_tokens_ends_the_llm_request_with_its_error(server, stream: bool) -> None:
    t0 = time.monotonic()
    got, error = _stream(server, stream)
    assert "TransportError: [request k1] KV transport 'tcp'" in error, (got, error)
    assert time.monotonic() - t0 < 20
    assert len(got) == (2 if stream else 0), got  # streaming: the two tokens' text deltas came first
    deadline = time.monotonic() + 10
    while (_pending(server, "llm") or _pending(server, "pd")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _pending(server, "llm") == 0 and _pending(server, "pd") == 0


def _stream(server, stream: bool) -> tuple[list, str]:
    """(responses before the error, the error's text) of one llm request."""
    import queue

    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    responses: queue.SimpleQueue = queue.SimpleQueue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    got = []
    final = False
    try:
        client.async_stream_infer("llm", E.grpc_inputs(E.llm_inputs(E.PROMPTS[0], stream=stream)),
                                  enable_empty_final_response=True)
        for _ in range(16):
            result, error = responses.get(timeout=30)
            if error is not None:
                return got, str(error)
            if result.as_numpy("text_output") is not None:
                got.append(result.as_numpy("text_output"))
            if result.get_response().parameters["triton_final_response"].bool_param:
                final = True
                return got, ""
        return got, ""
    finally:
        client.stop_stream(cancel_requests=not final)  # see rngd_pd.testing.e2e.stream_infer
        client.close()
