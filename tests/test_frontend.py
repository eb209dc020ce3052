"""The OpenAI front end over a scripted backend (tests/frontend_fakes.py): protocol, errors, limits,
cancellation. The real SmolLM2 tokenizer is used; the Triton path is in tests/test_frontend_e2e.py.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from rngd_pd.frontend.app import create_app
from rngd_pd.frontend.config import FrontendConfig
from rngd_pd.frontend.served_model import load_served_model
from tests.frontend_fakes import SCRIPT, FakeBackend, free_port, openai_client, serve_app, wait_for

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def served():
    return load_served_model(FrontendConfig())


@pytest.fixture
def backend(served):
    return FakeBackend(served.tokenizer)


@pytest.fixture
def url(served, backend):
    with serve_app(create_app(FrontendConfig(), model=served, backend=backend)) as base:
        yield base


def client(url: str, key: str = "none") -> openai.OpenAI:
    return openai_client(url, key, timeout=30)


def expected(served, backend, n: int) -> str:
    return served.tokenizer.decode(backend.tokens(n))


# ------------------------------------------------------------------ happy paths


def test_completion_text_usage_and_finish(url, served, backend):
    r = client(url).completions.create(model=MODEL, prompt="Say hi", max_tokens=12, temperature=0)
    prompt_len = len(served.tokenizer.encode("Say hi"))
    assert r.choices[0].text == expected(served, backend, 12)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        prompt_len,
        12,
        prompt_len + 12,
    )
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.created > 0
    assert backend.requests[0].input_ids == served.tokenizer.encode("Say hi")
    assert backend.requests[0].params.temperature == 0


def test_completion_stream_equals_non_stream_with_usage(url, served, backend):
    stream = client(url).completions.create(
        model=MODEL,
        prompt="Say hi",
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected(served, backend, 20)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


def test_chat_non_stream_and_stream(url, served, backend):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r = client(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    rendered = served.tokenizer.apply_chat_template(messages)
    assert backend.requests[0].input_ids == served.tokenizer.encode(rendered)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected(served, backend, 10)
    assert r.usage.prompt_tokens == len(backend.requests[0].input_ids) and r.usage.completion_tokens == 10
    chunks = list(
        client(url).chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_completion_tokens=10, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_default_max_tokens_is_the_rest_of_the_context(url, served, backend):
    backend.eos_at = 3
    r = client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert backend.requests[0].params.max_tokens == served.max_model_len - r.usage.prompt_tokens
    assert r.choices[0].finish_reason == "stop"  # eos is reported as stop
    assert r.choices[0].message.content == expected(served, backend, 3)  # EOS is not text
    assert r.usage.completion_tokens == 4


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("stop", ["brown fox", "rown f", "🙂"])  # across tokens, inside tokens, multi-byte
def test_stop_string_cuts_text_and_cancels(url, served, backend, stream, stop):
    full = expected(served, backend, 40)
    assert stop in full
    kwargs = dict(model=MODEL, prompt="x", max_tokens=40, temperature=0, stop=[stop, "never"])
    if stream:
        text = "".join(c.choices[0].text for c in client(url).completions.create(stream=True, **kwargs))
    else:
        r = client(url).completions.create(**kwargs)
        text = r.choices[0].text
        assert r.choices[0].finish_reason == "stop"
        assert r.usage.completion_tokens < 40
    assert text == full[: full.index(stop)]
    assert backend.requests[0].params.stop == (stop, "never")
    wait_for(lambda: backend.cancelled, what="the backend stream to be cancelled after the stop match")


def test_echo_and_token_id_prompt(url, served, backend):
    ids = served.tokenizer.encode("Once upon a time")
    r = client(url).completions.create(model=MODEL, prompt=ids, max_tokens=5, echo=True, temperature=0)
    assert backend.requests[0].input_ids == ids
    assert r.choices[0].text == "Once upon a time" + expected(served, backend, 5)
    r = client(url).completions.create(model=MODEL, prompt=["Once"], max_tokens=2, echo=True)
    assert r.choices[0].text.startswith("Once")


def test_sampling_parameters_reach_the_backend(url, backend):
    client(url).completions.create(
        model=MODEL, prompt="x", max_tokens=3, temperature=0.7, top_p=0.9, seed=7, extra_body={"top_k": 40}
    )
    p = backend.requests[0].params
    assert (p.temperature, p.top_p, p.top_k, p.seed) == (pytest.approx(0.7), pytest.approx(0.9), 40, 7)
    client(url).completions.create(model=MODEL, prompt="x", max_tokens=3)
    assert backend.requests[1].params.temperature == 1.0  # OpenAI's default


def test_models_health_metrics(url, backend):
    models = client(url).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(url + "/health").json() == {"status": "ok", "detail": ""}
    backend.ready_reason = "Triton model 'pd' is not ready"
    r = httpx.get(url + "/health")
    assert r.status_code == 503 and "not ready" in r.json()["detail"]
    client(url).completions.create(model=MODEL, prompt="x", max_tokens=4)
    list(client(url).completions.create(model=MODEL, prompt="x", max_tokens=5, stream=True))
    metrics = httpx.get(url + "/metrics").text
    assert "rngd_pd_frontend_completion_tokens_total 9.0" in metrics
    assert "rngd_pd_frontend_preprocess_seconds_count 2.0" in metrics
    assert "rngd_pd_frontend_token_latency_seconds_count 4.0" in metrics  # streamed chunks after the first
    assert 'rngd_pd_frontend_requests_total{endpoint="/v1/completions",status="200"} 2.0' in metrics
    assert "airm_tpot_p90_ms" in metrics and "airm_ttft_p90_ms" in metrics


# ------------------------------------------------------------------ errors


def _post(url: str, body: dict, path: str = "/v1/completions", headers: dict | None = None) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=headers, timeout=30)


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"n": 17}, "n", "less than or equal to 16"),
        ({"logprobs": 21}, "logprobs", "less than or equal to 20"),
        ({"best_of": 3}, "best_of", "not supported"),
        ({"suffix": "x"}, "suffix", "not supported"),
        ({"logit_bias": {"1": 200}}, "logit_bias", "less than or equal to 100"),
        ({"logit_bias": {"one": 2}}, "logit_bias", "must be token ids"),
        ({"logit_bias": {"999999": 2}}, "logit_bias", "outside the vocabulary"),
        ({"stop_token_ids": [999999]}, "stop_token_ids", "outside the vocabulary"),
        ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
        ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
        ({"min_tokens": 20, "max_tokens": 4}, "min_tokens", "min_tokens must be"),
        ({"frobnicate": 1}, "frobnicate", "Unsupported parameter"),
        ({"temperature": 5}, "temperature", "less than or equal to 2"),
        ({"top_p": 0}, "top_p", "greater than 0"),
        ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"stop": ""}, "stop", "must not be empty"),
        ({"seed": -1}, "seed", "greater than or equal to 0"),
        ({"prompt": ""}, "prompt", "empty"),
        ({"prompt": [1, 999999]}, "prompt", "outside the vocabulary"),
        ({"prompt": ["a", ""]}, "prompt", "empty"),
        ({"prompt": ["a"] * 65}, "prompt", "at most 64"),
    ],
)
def test_bad_values_are_400_naming_the_parameter(url, body, param, words):
    err = _error(_post(url, {"model": MODEL, "prompt": "x", **body}), 400)
    assert err["param"] == param and words in err["message"]
    assert err["type"] == "invalid_request_error"


def test_chat_unsupported_and_malformed(url):
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    err = _error(_post(url, {**base, "tools": [{"type": "function"}]}, "/v1/chat/completions"), 400)
    assert err["param"].startswith("tools")
    err = _error(
        _post(url, {**base, "messages": [{"role": "tool", "content": "x"}]}, "/v1/chat/completions"), 400
    )
    assert err["param"].startswith("messages")
    r = httpx.post(
        url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert "not a valid JSON" in _error(r, 400)["message"]


def test_prompt_too_long_says_limit_and_lengths(url, served):
    ids = [1] * (served.max_model_len - 10)
    err = _error(_post(url, {"model": MODEL, "prompt": ids, "max_tokens": 20}), 400)
    assert err["code"] == "context_length_exceeded"
    assert f"maximum context length is {served.max_model_len}" in err["message"]
    assert f"{len(ids) + 20} tokens ({len(ids)} in the prompt, 20 for the completion)" in err["message"]
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client(url).completions.create(model=MODEL, prompt=[1] * served.max_model_len, max_tokens=1)


def test_unknown_model_is_404(url):
    err = _error(_post(url, {"model": "gpt-4", "prompt": "x"}), 404)
    assert err["param"] == "model" and err["code"] == "model_not_found" and MODEL in err["message"]
    with pytest.raises(openai.NotFoundError):
        client(url).chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])


def test_api_key(served, backend):
    with serve_app(create_app(FrontendConfig(api_key="s3cret"), model=served, backend=backend)) as base:
        with pytest.raises(openai.AuthenticationError):
            client(base, "wrong").completions.create(model=MODEL, prompt="x", max_tokens=1)
        err = _error(_post(base, {"model": MODEL, "prompt": "x"}), 401)
        assert err["code"] == "invalid_api_key"
        assert _error(httpx.get(base + "/v1/models"), 401)
        assert client(base, "s3cret").completions.create(model=MODEL, prompt="x", max_tokens=1).usage
        assert httpx.get(base + "/health").status_code == 200  # probes need no key


def test_api_key_from_environment(monkeypatch, served, backend):
    monkeypatch.setenv("RNGD_PD_API_KEY", "envkey")
    with serve_app(create_app(FrontendConfig(), model=served, backend=backend)) as base:
        _error(_post(base, {"model": MODEL, "prompt": "x"}, headers={"Authorization": "Bearer nope"}), 401)
        ok = _post(
            base, {"model": MODEL, "prompt": "x", "max_tokens": 1}, headers={"Authorization": "Bearer envkey"}
        )
        assert ok.status_code == 200


def test_past_max_concurrency_is_429_not_queued(served):
    slow = FakeBackend(served.tokenizer, delay=0.05)
    with serve_app(create_app(FrontendConfig(max_concurrency=1), model=served, backend=slow)) as base:
        with httpx.stream(
            "POST",
            base + "/v1/completions",
            json={"model": MODEL, "prompt": "x", "max_tokens": 200, "stream": True},
        ) as held:
            lines = held.iter_lines()  # keep a reference: a collected iterator closes the connection
            next(lines)
            err = _error(_post(base, {"model": MODEL, "prompt": "x", "max_tokens": 1}), 429)
            assert err["code"] == "too_many_concurrent_requests" and "1 concurrent" in err["message"]
        wait_for(lambda: slow.cancelled, what="the held stream to be cancelled")
        assert _post(base, {"model": MODEL, "prompt": "x", "max_tokens": 1}).status_code == 200


def test_unreachable_triton_is_503(served):
    dead = f"127.0.0.1:{free_port()}"
    with serve_app(create_app(FrontendConfig(triton_url=dead), model=served)) as base:
        for stream in (False, True):
            err = _error(_post(base, {"model": MODEL, "prompt": "x", "stream": stream}), 503)
            assert dead in err["message"] and err["type"] == "service_unavailable"
        r = httpx.get(base + "/health")
        assert r.status_code == 503 and "not reachable" in r.json()["detail"]
        with pytest.raises(openai.InternalServerError):
            client(base).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])


# ------------------------------------------------------------------ disconnects


def test_client_disconnect_mid_stream_cancels(served):
    slow = FakeBackend(served.tokenizer, delay=0.02)
    app = create_app(FrontendConfig(), model=served, backend=slow)
    with serve_app(app) as base:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 500, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["text"]
        wait_for(lambda: slow.cancelled == slow.started, what="the stream's backend request to be cancelled")
        wait_for(lambda: app.state.frontend.limiter.active == 0, what="the concurrency slot to be freed")


def test_client_disconnect_non_stream_cancels(served):
    slow = FakeBackend(served.tokenizer, delay=0.02)
    app = create_app(FrontendConfig(), model=served, backend=slow)
    with serve_app(app) as base:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                base + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 500}, timeout=0.3
            )
        wait_for(lambda: len(slow.cancelled) == 1, what="the non-streaming request to be cancelled")
        wait_for(lambda: app.state.frontend.limiter.active == 0, what="the concurrency slot to be freed")


def test_script_has_multibyte_text(served, backend):
    """The scripted stream exercises UTF-8 characters split across tokens."""
    assert expected(served, backend, len(backend.ids)) == SCRIPT
