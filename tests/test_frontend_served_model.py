"""What the front end knows of the served model without weights, and the context limit it agrees on
with the Triton model (over the scripted backend in tests/frontend_fakes.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from rngd_pd.errors import ModelLoadError
from rngd_pd.frontend.app import create_app
from rngd_pd.frontend.config import FrontendConfig
from rngd_pd.frontend.served_model import load_served_model
from tests.frontend_fakes import FakeBackend, serve_app

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def served():
    return load_served_model(FrontendConfig())


@pytest.fixture(scope="module")
def gateway_dir(tmp_path_factory, served) -> Path:
    """A Hugging Face directory as a gateway pod gets it: config.json + tokenizer files, no weights
    (the embedded SmolLM2's tokenizer saved as tokenizer.json)."""
    d = tmp_path_factory.mktemp("smollm2-gateway")
    tok = served.tokenizer
    tok.tok.save(str(d / "tokenizer.json"))
    tok_cfg = {"chat_template": tok.chat_template, "eos_token": tok.eos_token, "bos_token": tok.bos_token}
    (d / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": served.vocab_size,
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "max_position_embeddings": 8192, "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "eos_token_id": list(tok.eos_token_ids),
    }  # fmt: skip
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_tokenizer_only_directory_serves(gateway_dir, served):
    gw = load_served_model(FrontendConfig(model_path=str(gateway_dir)))
    assert gw.name == gateway_dir.name and (gw.max_model_len, gw.vocab_size) == (8192, served.vocab_size)
    text = "Naïve café 🙂 <|im_start|>user"
    assert gw.tokenizer.encode(text) == served.tokenizer.encode(text)
    msgs = [{"role": "user", "content": "Hi"}]
    assert gw.tokenizer.apply_chat_template(msgs) == served.tokenizer.apply_chat_template(msgs)
    assert gw.tokenizer.eos_token_ids == served.tokenizer.eos_token_ids
    limited = load_served_model(FrontendConfig(model_path=str(gateway_dir), max_model_len=1024))
    assert limited.max_model_len == 1024


def test_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        load_served_model(FrontendConfig(model_path=str(tmp_path / "nope")))


def test_front_end_starts_without_torch(gateway_dir):
    """A gateway pod needs no torch: building the app over a tokenizer-only directory never imports it."""
    code = (
        "import sys\n"
        "from rngd_pd.frontend.app import create_app\n"
        "from rngd_pd.frontend.config import FrontendConfig\n"
        f"create_app(FrontendConfig(model_path={str(gateway_dir)!r}))\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _models(base: str) -> dict:
    return httpx.get(base + "/v1/models").json()["data"][0]


def test_context_limit_is_learned_from_the_triton_model(served):
    backend = FakeBackend(served.tokenizer, served_max_len=512)
    app = create_app(FrontendConfig(), model=served, backend=backend)
    with serve_app(app) as base:
        assert _models(base)["max_model_len"] == 512
        body = {"model": MODEL, "prompt": [1] * 500, "max_tokens": 20}
        r = httpx.post(base + "/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert "maximum context length is 512 tokens" in r.json()["error"]["message"]
        assert "520 tokens (500 in the prompt, 20 for the completion)" in r.json()["error"]["message"]
        assert not backend.requests  # refused by the front end, never sent
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        r = httpx.post(base + "/v1/chat/completions", json=chat)
        n_prompt = r.json()["usage"]["prompt_tokens"]
        assert backend.requests[-1].params.max_tokens == 512 - n_prompt  # "the rest of the context"
        schema = httpx.get(base + "/openapi.json").json()
        assert schema["components"]["schemas"]["CompletionRequest"]["properties"]["max_tokens"][
            "anyOf"
        ][0]["maximum"] == 511
        backend.served_max_len = 16384  # above the checkpoint's context: the checkpoint's wins
        assert _models(base)["max_model_len"] == 8192


def test_max_model_len_overrides_what_triton_says(served):
    backend = FakeBackend(served.tokenizer, served_max_len=512)
    with serve_app(create_app(FrontendConfig(max_model_len=1000), model=served, backend=backend)) as base:
        assert _models(base)["max_model_len"] == 1000
        r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": [1] * 990, "max_tokens": 20})
        assert r.status_code == 400 and "maximum context length is 1000" in r.json()["error"]["message"]


def test_unknown_served_limit_keeps_the_checkpoint_context(served):
    with serve_app(create_app(FrontendConfig(), model=served, backend=FakeBackend(served.tokenizer))) as base:
        assert _models(base)["max_model_len"] == 8192


@pytest.mark.parametrize("stream", [False, True])
def test_ignore_eos_without_the_model_input_is_400(served, stream):
    backend = FakeBackend(served.tokenizer, eos_at=3)
    with serve_app(create_app(FrontendConfig(), model=served, backend=backend)) as base:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 10, "ignore_eos": True, "stream": stream}
        r = httpx.post(base + "/v1/completions", json=body)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "ignore_eos", r.text
        assert "ignore_eos" in err["message"] and "declares no 'ignore_eos' input" in err["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_ignore_eos_generates_past_eos_when_the_model_takes_it(served, stream):
    backend = FakeBackend(served.tokenizer, eos_at=3, inputs=("ignore_eos",))
    with serve_app(create_app(FrontendConfig(), model=served, backend=backend)) as base:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 10, "ignore_eos": True, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
            with httpx.stream("POST", base + "/v1/completions", json=body) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            finish = [c["choices"][0]["finish_reason"] for c in events if c["choices"]][-1]
            usage = events[-1]["usage"]
        else:
            r = httpx.post(base + "/v1/completions", json=body).json()
            finish, usage = r["choices"][0]["finish_reason"], r["usage"]
        assert backend.requests[0].params.ignore_eos is True
        assert (finish, usage["completion_tokens"]) == ("length", 10)
        r = httpx.post(base + "/v1/completions", json={**body, "ignore_eos": False, "stream": False}).json()
        assert (r["choices"][0]["finish_reason"], r["usage"]["completion_tokens"]) == ("stop", 4)
