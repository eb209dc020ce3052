"""e2e: logprobs, n, penalties, batched prompts and the small endpoints over a real tritonserver (pd,
prefill, decode by shm; the llm ensemble) and the OpenAI front end, driven by the openai SDK, whose
typed objects must parse every reply.

References from outside the code under test: transformers' fp32 log-softmax on the same checkpoint,
teacher-forced (the server computes in fp32 with an fp32 KV here, so the 1e-4 bound is about the
logprobs, not about a bf16 cache), and the penalty formulas of OpenAI's and vLLM's documentation
(`tests.test_sampling_features.reference_adjust`). Triton's own `nv_inference_request_success` of the
`prefill` model counts prefills.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
import torch

from rngd_pd.frontend.app import create_app
from rngd_pd.frontend.config import FrontendConfig
from rngd_pd.model.sampling import SamplingParams
from rngd_pd.testing import e2e as E
from tests.frontend_fakes import openai_client, serve_app
from tests.test_sampling_features import reference_adjust
from tests.triton_harness import shm_server

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"
ATOL = 1e-4
PROMPT = "The three primary colours are"


@pytest.fixture(scope="module")
def triton() -> Iterator:
    with shm_server(["pd", "prefill", "decode", "preprocess", "postprocess", "llm"],
                    {"RNGD_PD_DTYPE": "fp32", "RNGD_PD_KV_DTYPE": "fp32"}, "rngd-pd-api-shm-") as server:
        yield server


@pytest.fixture(scope="module")
def served():
    from rngd_pd.frontend.served_model import load_served_model

    return load_served_model(FrontendConfig())


@pytest.fixture(scope="module")
def url(triton, served) -> Iterator[str]:
    with serve_app(create_app(FrontendConfig(triton_url=triton.grpc_url), model=served)) as base:
        yield base


def client(url: str) -> openai.OpenAI:
    return openai_client(url)


@torch.inference_mode()
def hf_greedy(hf, ids: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation and the fp64 log-softmax of every position of prompt + it."""
    out = list(ids)
    for _ in range(steps):
        out.append(int(hf(torch.tensor([out])).logits[0, -1].argmax()))
    logprobs = torch.log_softmax(hf(torch.tensor([out])).logits[0].double(), dim=-1)
    return out[len(ids):], logprobs


def _prefills(triton) -> float:
    with urllib.request.urlopen(triton.metrics_url, timeout=60) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith("nv_inference_request_success") and 'model="prefill"' in line)


def test_chat_logprobs_equal_transformers_streamed_and_not(url, served, hf_smollm) -> None:
    tok = served.tokenizer
    messages = [{"role": "user", "content": "Name a fruit."}]
    ids = tok.encode(tok.apply_chat_template(messages))
    want, ref = hf_greedy(hf_smollm, ids, 6)
    kwargs = dict(model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                  top_logprobs=5, extra_body={"ignore_eos": True})
    # once before: prefill's prefix cache then serves both compared runs alike (a reused prefix sums
    # in another order: the same logprobs to ~1e-6, not to the bit)
    client(url).chat.completions.create(**kwargs)
    r = client(url).chat.completions.create(**kwargs)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [tok.decode([t]) for t in want]
    for step, (entry, token) in enumerate(zip(content, want, strict=True)):
        row = ref[len(ids) - 1 + step]
        assert abs(entry.logprob - float(row[token])) < ATOL
        assert bytes(entry.bytes) == entry.token.encode()
        top = torch.topk(row, 5)
        assert [t.token for t in entry.top_logprobs] == [tok.decode([int(i)]) for i in top.indices]
        values = [t.logprob for t in entry.top_logprobs]
        assert max(abs(a - float(b)) for a, b in zip(values, top.values, strict=True)) < ATOL
    chunks = list(client(url).chat.completions.create(**kwargs, stream=True))
    streamed = [c for chunk in chunks for choice in chunk.choices if choice.logprobs
                for c in choice.logprobs.content]
    assert [c.model_dump() for c in streamed] == [c.model_dump() for c in content]


def test_completion_echo_logprobs_equal_transformers(url, served, hf_smollm) -> None:
    tok = served.tokenizer
    ids = tok.encode(PROMPT)
    want, ref = hf_greedy(hf_smollm, ids, 3)
    r = client(url).completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0, echo=True,
                                       logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert r.choices[0].text == tok.decode(ids) + tok.decode(want)
    assert lp.tokens == [tok.decode([t]) for t in ids + want]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i, token in enumerate(ids[1:] + want):
        row = ref[i]
        assert abs(lp.token_logprobs[i + 1] - float(row[token])) < ATOL
        top = torch.topk(row, 3)
        assert list(lp.top_logprobs[i + 1])[:3] == [tok.decode([int(t)]) for t in top.indices]
    assert lp.text_offset == [sum(len(s) for s in lp.tokens[:i]) for i in range(len(lp.tokens))]
    stream = client(url).completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0, echo=True,
                                            logprobs=3, stream=True, extra_body={"ignore_eos": True})
    parts = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
    assert [v for p in parts for v in p.token_logprobs] == lp.token_logprobs
    assert [o for p in parts for o in p.text_offset] == lp.text_offset


def test_n4_greedy_is_four_identical_choices_from_one_prefill(url, triton) -> None:
    before = _prefills(triton)
    r = client(url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, n=4)
    assert _prefills(triton) == before + 1
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert len({c.text for c in r.choices}) == 1 and r.choices[0].text
    one = client(url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.choices[0].text == one.choices[0].text
    assert r.usage.completion_tokens == 4 * one.usage.completion_tokens
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    chat = client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=8, temperature=0, n=4, stream=True)
    texts = ["", "", "", ""]
    for chunk in chat:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert len(set(texts)) == 1 and texts[0]


def test_n_seeded_sampling_is_reproducible(url) -> None:
    kwargs = dict(model=MODEL, prompt="My favourite animal is", max_tokens=10, temperature=1.0, seed=7, n=3,
                  extra_body={"ignore_eos": True})
    a = client(url).completions.create(**kwargs)
    b = client(url).completions.create(**kwargs)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1
    alone = client(url).completions.create(**{**kwargs, "n": 1, "seed": 9})  # choice 2 samples with seed + 2
    assert alone.choices[0].text == a.choices[2].text


@pytest.mark.parametrize("params", [
    {"presence_penalty": 1.5},
    {"frequency_penalty": 2.0},
    {"repetition_penalty": 1.8},
    {"logit_bias_ids": [28, 30], "logit_bias_values": [6.0, 3.0], "presence_penalty": 0.5},
], ids=["presence", "frequency", "repetition", "bias+presence"])
def test_penalties_on_triton_follow_the_documented_formulas(triton, url, served, hf_smollm, params) -> None:
    """Through pd's own inputs (ids come back), then the same through the front end."""
    ids = served.tokenizer.encode("the the the the the cat cat cat sat on the")
    wire = {k: np.array(v if isinstance(v, list) else [v],
                        np.float32 if "penalty" in k or k.endswith("values") else np.int32)
            for k, v in params.items()}
    got = E.stream_infer(triton.grpc_url, "pd", E.pd_inputs(ids, 10, ignore_eos=np.array([True]), **wire),
                         ("output_ids", "finish_reason"))
    out = E.ids_of(got)
    bias = tuple(zip(params.get("logit_bias_ids", []), params.get("logit_bias_values", []), strict=True))
    p = SamplingParams(max_tokens=10, presence_penalty=params.get("presence_penalty", 0.0),
                       frequency_penalty=params.get("frequency_penalty", 0.0),
                       repetition_penalty=params.get("repetition_penalty", 1.0), logit_bias=bias)
    with torch.inference_mode():
        logits = hf_smollm(torch.tensor([ids + out[:-1]])).logits[0]
    for step, token in enumerate(out):
        ref = reference_adjust(logits[len(ids) - 1 + step], ids, out[:step], p, ())
        top2 = torch.topk(ref, 2).values
        assert int(ref.argmax()) == token or float(top2[0] - top2[1]) < 1e-3, f"step {step}"
    body = {k: v for k, v in params.items() if not k.startswith("logit_bias")}
    if bias:
        body["logit_bias"] = {str(t): b for t, b in bias}
    r = client(url).completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True, **{k: v for k, v in body.items()
                                                                          if k == "repetition_penalty"}},
                                       **{k: v for k, v in body.items() if k != "repetition_penalty"})
    assert r.choices[0].text == served.tokenizer.decode(out)


def test_min_tokens_stop_token_ids_and_batched_prompts(url, served) -> None:
    tok = served.tokenizer
    eos = tok.eos_token_ids[0]
    r = client(url).completions.create(model=MODEL, prompt="Hello", max_tokens=10,
                                       logit_bias={str(eos): 100}, extra_body={"min_tokens": 3})
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "stop"
    word = tok.encode(" banana")[0]
    r = client(url).completions.create(model=MODEL, prompt="Hello", max_tokens=10,
                                       logit_bias={str(word): 100}, extra_body={"stop_token_ids": [word]})
    assert r.usage.completion_tokens == 1 and r.choices[0].text == "" and r.choices[0].finish_reason == "stop"
    prompts = [PROMPT, "def fibonacci(n):", tok.encode("Once upon a time")]
    batch = client(url).completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in batch.choices] == list(range(6))
    singles = [client(url).completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0)
               for p in prompts]
    for i, single in enumerate(singles):
        assert batch.choices[2 * i].text == batch.choices[2 * i + 1].text == single.choices[0].text
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == 2 * sum(s.usage.completion_tokens for s in singles)
    stream = client(url).completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2,
                                            stream=True, stream_options={"include_usage": True})
    texts = [""] * 6
    chunks = list(stream)
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in batch.choices]
    assert chunks[-1].usage.completion_tokens == batch.usage.completion_tokens


def test_tokenize_detokenize_version(url, served) -> None:
    tok = served.tokenizer
    r = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()
    assert r["tokens"] == tok.encode(PROMPT) and r["count"] == len(r["tokens"]) and r["max_model_len"] > 0
    messages = [{"role": "user", "content": "Hi"}]
    r = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": messages}).json()
    assert r["tokens"] == tok.encode(tok.apply_chat_template(messages))
    r = httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": tok.encode(PROMPT)}).json()
    assert r == {"prompt": PROMPT}
    assert httpx.get(url + "/version").json()["version"]


def test_triton_generate_endpoint_takes_the_same_parameters(triton, served) -> None:
    """The llm ensemble's inputs: logprobs and n by name on Triton's generate_stream endpoint."""
    body = {"text_input": PROMPT, "max_tokens": 4, "stream": False, "temperature": 0, "n": 2, "logprobs": 2,
            "ignore_eos": True}
    status, text = E.http_post(triton.http_url, "/v2/models/llm/generate_stream", body)
    assert status == 200, text
    events = E.sse_events(text)
    assert sorted(e["index"] for e in events) == [0, 1]
    for e in events:
        assert len(e["output_ids"]) == 4 and len(e["token_logprob_ids"]) == 4 * 3
        assert e["text_output"] == served.tokenizer.decode(e["output_ids"])
        assert all(v <= 0 for v in e["token_logprobs"])
    assert json.dumps(events[0]["output_ids"]) == json.dumps(events[1]["output_ids"])
