"""llama-cpp-python's own OpenAI server, with the benchmark's `ignore_eos` mapped to its `min_tokens`.

Runs in bench/.peers-venv (it imports only llama_cpp and what its server needs). The load generator
asks for exactly max_tokens with the `ignore_eos` extension (vLLM's name, which rngd-pd serves too);
llama.cpp's server has no such field but has `min_tokens` (EOS is masked until that many tokens), so
a small ASGI wrapper rewrites `ignore_eos: true` into `min_tokens = max_tokens`. Nothing else changes.

    bench/.peers-venv/bin/python bench/peers/llamacpp_server.py --model X.gguf --port 9200
"""

from __future__ import annotations

import argparse
import json
from typing import Any

Scope = dict[str, Any]


def rewrite(body: bytes) -> bytes:
    """`ignore_eos: true` -> `min_tokens: max_tokens`; any other body is returned unchanged."""
    try:
        obj = json.loads(body or b"null")
    except ValueError:
        return body
    if not isinstance(obj, dict) or "ignore_eos" not in obj:
        return body
    if obj.pop("ignore_eos") and obj.get("max_tokens"):
        obj["min_tokens"] = obj["max_tokens"]
    return json.dumps(obj).encode()


class IgnoreEos:
    """ASGI middleware: buffers a POST body to /v1/*completions and rewrites it (see rewrite)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].endswith("completions"):
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            msg = await receive()
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        body = rewrite(b"".join(chunks))
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if sent:
                return await receive()  # after the body: disconnects
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app({**scope, "headers": headers}, replay, send)


def main(argv: list[str] | None = None) -> int:
    """Build llama_cpp.server's app from the flags and serve it behind IgnoreEos."""
    import uvicorn
    from llama_cpp.server.app import create_app
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--alias", required=True, help="the model name clients send")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=4096)
    a = ap.parse_args(argv)
    model = ModelSettings(
        model=a.model,
        model_alias=a.alias,
        n_threads=a.threads,
        n_threads_batch=a.threads,
        n_ctx=a.n_ctx,
        verbose=False,
    )
    server = ServerSettings(host=a.host, port=a.port, interrupt_requests=False)
    app = create_app(server_settings=server, model_settings=[model])
    uvicorn.run(IgnoreEos(app), host=a.host, port=a.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
