"""e2e, the pod layout of the original: prefill-only tritonservers, a decode-only tritonserver and a
gateway (llm, pd, pre/postprocess) whose pd reaches the others by gRPC. Same tokens as colocated.

One layout serves the module (two prefill servers, one decode, one gateway): starting four servers
once instead of seven keeps the module's start-ups to one round on 2 cores.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rngd_pd.serve.server import ServerConfig, TritonServer
from rngd_pd.testing import e2e as E
from tests.triton_harness import READY_TIMEOUT_S, require_tritonserver

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"  # the served model name of the embedded model


def _server(stack: contextlib.ExitStack, models: list[str], env: dict[str, str], logs: Path) -> TritonServer:
    cfg = ServerConfig(E.subset_repository(models), "cpu", http_port=0, grpc_port=0, metrics_port=0,
                       env=env)
    server = TritonServer(cfg, log=logs / f"{models[0]}.log")
    stack.callback(server.stop)
    server.start()
    return server


@contextlib.contextmanager
def _layout(prefix: str) -> Iterator[tuple[contextlib.ExitStack, dict[str, str], Path]]:
    """(stack, shm transport env, log dir) for servers started on the stack: they are stopped, then
    their shm root and logs removed, whatever happens."""
    require_tritonserver()
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    shm_root = tempfile.mkdtemp(prefix=f"{prefix}-", dir=base)
    logs = Path(tempfile.mkdtemp(prefix=f"{prefix}-logs-"))
    try:
        with contextlib.ExitStack() as stack:
            yield stack, {"AIRM_KV_TRANSPORT": "shm", "PD_SHM_ROOT": shm_root}, logs
    finally:
        shutil.rmtree(shm_root, ignore_errors=True)
        shutil.rmtree(logs, ignore_errors=True)


@dataclass(frozen=True)
class Layout:
    """The module's servers: the gateway's pd is configured with `first` and `decode`; `second` is
    reached only when a request names it (x-prefiller-host-port)."""

    first: TritonServer
    second: TritonServer
    decode: TritonServer
    gateway: TritonServer


@pytest.fixture(scope="module")
def layout() -> Iterator[Layout]:
    with _layout("rngd-pd-e2e-remote") as (stack, kv_env, logs):
        first = _server(stack, ["prefill"], kv_env, logs)
        second = _server(stack, ["prefill"], kv_env, logs)
        decode = _server(stack, ["decode"], kv_env, logs)
        urls = {"RNGD_PD_PREFILL_URL": f"127.0.0.1:{first.cfg.grpc_port}",
                "RNGD_PD_DECODE_URL": f"127.0.0.1:{decode.cfg.grpc_port}"}
        gateway = _server(stack, ["pd", "llm", "preprocess", "postprocess"], urls, logs)
        for server in (first, second, decode, gateway):
            server.wait_ready(READY_TIMEOUT_S)
        yield Layout(first, second, decode, gateway)


def test_three_servers_prefill_decode_gateway_give_the_same_tokens(layout: Layout) -> None:
    gateway = layout.gateway
    for text in E.PROMPTS:
        ids, _, reason = E.reference(text)
        responses = E.stream_infer(gateway.grpc_url, "pd", E.pd_inputs(E.prompt_ids(text)),
                                   ("output_ids", "finish_reason"))
        assert E.ids_of(responses) == list(ids), text
        assert E.reason_of(responses) == reason
    request = {"text_input": E.PROMPTS[0], "max_tokens": E.MAX_TOKENS, "stream": True}
    status, body = E.http_post(gateway.http_url, "/v2/models/llm/generate_stream", request)
    assert status == 200, body
    events = E.sse_events(body)
    assert "".join(e["text_output"] for e in events) == E.reference(E.PROMPTS[0])[1]
    status, body = E.http_post(gateway.http_url, "/v2/models/pd/generate",
                               {"input_ids": [42] * 3000, "max_tokens": 4})
    assert status == 400 and "ContextLengthError" in json.loads(body)["error"], body


def _inferences(server: TritonServer, model: str) -> int:
    """Requests `model` has executed on `server` (Triton's statistics)."""
    import urllib.request

    with urllib.request.urlopen(f"{server.http_url}/v2/models/{model}/stats", timeout=10) as resp:
        return int(json.load(resp)["model_stats"][0]["inference_stats"]["success"]["count"])


def test_the_prefiller_header_picks_the_prefill_server(layout: Layout) -> None:
    """llm-d's endpoint picker names a prefill pod in `x-prefiller-host-port`: two prefill servers,
    one gateway whose configured prefill is the first; the header sends a request to the second."""
    import openai

    from rngd_pd.frontend.app import create_app
    from rngd_pd.frontend.config import FrontendConfig
    from rngd_pd.frontend.served_model import load_served_model
    from rngd_pd.model.params import PREFILLER_HEADER
    from tests.frontend_fakes import serve_app

    first, second, gateway = layout.first, layout.second, layout.gateway
    text = E.PROMPTS[0]
    ids = E.reference(text)[0]
    counts = lambda: (_inferences(first, "prefill"), _inferences(second, "prefill"))  # noqa: E731
    chosen = f"127.0.0.1:{second.cfg.grpc_port}"

    before = counts()
    got = E.stream_infer(gateway.grpc_url, "pd", E.pd_inputs(E.prompt_ids(text)), ("output_ids",))
    assert E.ids_of(got) == list(ids) and counts() == (before[0] + 1, before[1])  # configured one
    got = E.stream_infer(gateway.grpc_url, "pd", E.pd_inputs(E.prompt_ids(text)), ("output_ids",),
                         parameters={PREFILLER_HEADER: chosen})
    assert E.ids_of(got) == list(ids) and counts() == (before[0] + 1, before[1] + 1)  # the named one

    config = FrontendConfig(triton_url=gateway.grpc_url)
    with serve_app(create_app(config, model=load_served_model(config))) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        kwargs = {"model": MODEL, "prompt": text, "max_tokens": E.MAX_TOKENS, "temperature": 0}
        plain = client.completions.create(**kwargs).choices[0].text
        assert counts() == (before[0] + 2, before[1] + 1)
        named = client.completions.create(**kwargs, extra_headers={PREFILLER_HEADER: chosen})
        assert named.choices[0].text == plain and counts() == (before[0] + 2, before[1] + 2)
        with pytest.raises(openai.BadRequestError, match=PREFILLER_HEADER):
            client.completions.create(**kwargs, extra_headers={PREFILLER_HEADER: "not-an-address"})
