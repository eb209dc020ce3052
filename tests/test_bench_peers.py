"""bench/peers: the HF peer's OpenAI surface (over a scripted backend) and llama.cpp's ignore_eos mapping.

The peers themselves (transformers, llama.cpp) are exercised by bench/sweep.py, not here: this checks
the small layers this project wrote around them, which the load generator depends on.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.testclient import TestClient

from bench.peers import llamacpp, llamacpp_server
from bench.peers.hf_server import GenRequest, build_app

EOS = 0


class CharTokenizer:
    """One token per character (id = code point); EOS is 0."""

    eos_token_id = EOS
    all_special_ids = (EOS,)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i != EOS)

    def apply_chat_template(self, messages: list[dict], tokenize: bool, add_generation_prompt: bool) -> str:
        return "".join(m["content"] for m in messages) + ">"


class EchoBackend:
    """Streams the prompt back reversed, then EOS, then filler: shows where EOS stops a request."""

    def __init__(self) -> None:
        self.seen: list[GenRequest] = []

    async def stream(self, req: GenRequest) -> AsyncIterator[int]:
        self.seen.append(req)
        out = [*reversed(req.prompt_ids), EOS] + [ord("x")] * req.max_tokens
        for t in out[: req.max_tokens]:
            await asyncio.sleep(0)
            yield t


def _client() -> tuple[TestClient, EchoBackend]:
    backend = EchoBackend()
    return TestClient(build_app(backend, CharTokenizer())), backend


def _events(text: str) -> list[Any]:
    datas = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in datas]


def test_streaming_completion_has_a_chunk_per_token_usage_and_done() -> None:
    client, _ = _client()
    r = client.post(
        "/v1/completions",
        json={"prompt": "abc", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    ev = _events(r.text)
    assert [e["choices"][0]["text"] for e in ev[:3]] == ["c", "b", "a"]
    assert ev[3]["choices"][0]["finish_reason"] == "length"
    assert ev[4]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert ev[-1] == "[DONE]"


def test_eos_stops_unless_ignored() -> None:
    client, backend = _client()
    body = {"prompt": "ab", "max_tokens": 5, "temperature": 0}
    stopped = client.post("/v1/completions", json=body).json()
    assert stopped["choices"][0] == {"index": 0, "text": "ba", "finish_reason": "stop"}
    assert stopped["usage"]["completion_tokens"] == 2
    full = client.post("/v1/completions", json={**body, "ignore_eos": True}).json()
    assert full["choices"][0]["text"] == "baxx" and full["usage"]["completion_tokens"] == 5
    assert backend.seen[-1].ignore_eos and backend.seen[-1].temperature == 0.0


def test_token_id_prompts_chat_and_models() -> None:
    client, backend = _client()
    client.post("/v1/completions", json={"prompt": [104, 105], "max_tokens": 1})
    assert backend.seen[-1].prompt_ids == [104, 105]
    chat = client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    ).json()
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": ">"}
    assert client.get("/v1/models").json()["data"][0]["id"]
    assert client.get("/health").json() == {"status": "ok"}
    assert client.post("/v1/completions", json={"prompt": "", "max_tokens": 1}).status_code == 400


def test_llamacpp_rewrite_maps_ignore_eos_to_min_tokens() -> None:
    out = json.loads(llamacpp_server.rewrite(b'{"prompt": "x", "max_tokens": 7, "ignore_eos": true}'))
    assert out == {"prompt": "x", "max_tokens": 7, "min_tokens": 7}
    off = json.loads(llamacpp_server.rewrite(b'{"max_tokens": 7, "ignore_eos": false}'))
    assert off == {"max_tokens": 7}
    assert llamacpp_server.rewrite(b'{"max_tokens": 7}') == b'{"max_tokens": 7}'
    assert llamacpp_server.rewrite(b"not json") == b"not json"


def test_llamacpp_middleware_hands_the_rewritten_body_on() -> None:
    seen: dict[str, Any] = {}

    async def app(scope: dict, receive: Any, send: Any) -> None:
        seen["body"] = (await receive())["body"]
        seen["length"] = dict(scope["headers"])[b"content-length"]

    body = b'{"max_tokens": 4, "ignore_eos": true}'
    msgs = iter(
        [
            {"type": "http.request", "body": body[:10], "more_body": True},
            {"type": "http.request", "body": body[10:], "more_body": False},
        ]
    )

    async def receive() -> dict:
        return next(msgs)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [(b"content-length", str(len(body)).encode())],
    }
    asyncio.run(llamacpp_server.IgnoreEos(app)(scope, receive, None))
    assert json.loads(seen["body"]) == {"max_tokens": 4, "min_tokens": 4}
    assert seen["length"] == str(len(seen["body"])).encode()


def test_llamacpp_server_argv_runs_the_wrapper_in_the_peer_venv(tmp_path: Any) -> None:
    argv = llamacpp.server_argv(tmp_path / "m.gguf", 9200, alias="m", threads=1, venv=tmp_path / "v")
    assert argv[0] == str(tmp_path / "v" / "bin" / "python")
    assert argv[1].endswith("llamacpp_server.py")
    assert argv[argv.index("--threads") + 1] == "1" and argv[argv.index("--alias") + 1] == "m"
    assert not llamacpp.installed(tmp_path / "v")
