"""The front end's test doubles, kept once: a scripted generation backend (the layer below the HTTP
app) and a uvicorn server in a thread. The e2e tests use the real Triton backend instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator

import openai
import uvicorn

from rngd_pd.frontend.backend import GenerateRequest, TokenChunk, check_supported
from rngd_pd.model.params import FinishReason, TokenLogprobs
from rngd_pd.wire import tensors as T

ALL_INPUTS = tuple(t.name for t in T.PD.inputs)  # a pd-style model: every sampling input declared

SCRIPT = "Hello world! The quick brown fox jumps over the lazy dog. Naïve café ünïcödé 🙂 END of script. "


class FakeBackend:
    """Streams the tokens of SCRIPT (cycled), one per chunk, `delay` seconds apart.

    Records which requests started, finished and were cancelled (closed before their final chunk),
    so tests can check that a client going away reaches the layer below. `inputs` are the optional
    inputs the pretend Triton model declares (checked as TritonBackend checks them); `served_max_len`
    is the context limit it reports (None: says nothing).
    """

    def __init__(
        self,
        tokenizer,
        delay: float = 0.0,
        script: str = SCRIPT,
        eos_at: int | None = None,
        inputs: tuple[str, ...] = (),
        served_max_len: int | None = None,
    ) -> None:
        self.ids = tokenizer.encode(script)
        self.eos = tokenizer.eos_token_ids[0]
        self.delay, self.eos_at = delay, eos_at
        self.inputs = dict.fromkeys(inputs, "BOOL")
        self.served_max_len = served_max_len
        self.started: list[str] = []
        self.finished: list[str] = []
        self.cancelled: list[str] = []
        self.requests: list[GenerateRequest] = []
        self.ready_reason: str | None = None

    def tokens(self, n: int) -> list[int]:
        """The first n tokens this backend generates (ignoring EOS)."""
        return [self.ids[i % len(self.ids)] for i in range(n)]

    async def ready(self) -> str | None:
        return self.ready_reason

    async def max_len(self) -> int | None:
        return self.served_max_len

    async def close(self) -> None:
        pass

    async def weights(self, op: dict) -> dict:
        """A weight operation on a model that has nothing to change."""
        return {"checkpoint": op.get("checkpoint"), "changed": [], "switched": False}

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenChunk]:
        check_supported("fake", req.params, self.inputs)
        self.started.append(req.request_id)
        self.requests.append(req)
        done = False
        p = req.params
        prompt = None
        if p.prompt_logprobs is not None and len(req.input_ids) > 1:
            prompt = tuple(_row(t, p.prompt_logprobs) for t in req.input_ids[1:])
        try:
            n = p.max_tokens
            for i, tid in enumerate(self.tokens(n)):
                if self.delay:
                    await asyncio.sleep(self.delay)
                if self.eos_at is not None and i == self.eos_at:
                    if not p.ignore_eos:
                        for c in range(p.n):
                            done = c == p.n - 1
                            yield TokenChunk((self.eos,), FinishReason.EOS, index=c,
                                             logprobs=_rows((self.eos,), p.logprobs))
                        return
                    tid = self.eos  # generated like any token, and generation goes on
                last = i == n - 1
                for c in range(p.n):  # every choice the same tokens
                    done = last and c == p.n - 1
                    yield TokenChunk((tid,), FinishReason.LENGTH if last else None, index=c,
                                     logprobs=_rows((tid,), p.logprobs),
                                     prompt_logprobs=prompt if not i else None)
        finally:
            (self.finished if done else self.cancelled).append(req.request_id)


def _row(token: int, k: int) -> TokenLogprobs:
    """A made-up logprob row: the token at -0.5, then k others below it."""
    return TokenLogprobs((token, *range(100, 100 + k)), (-0.5, *(-1.0 - j for j in range(k))))


def _rows(tokens: tuple[int, ...], k: int | None) -> tuple[TokenLogprobs, ...] | None:
    return None if k is None else tuple(_row(t, k) for t in tokens)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_app(app, port: int | None = None) -> Iterator[str]:
    """Run `app` under uvicorn on 127.0.0.1 in a thread; yields its base URL; stops it on exit."""
    port = port or free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"uvicorn did not start on port {port}")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def wait_for(predicate, timeout: float = 5.0, what: str = "condition") -> None:
    """Poll `predicate` until true; AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def openai_client(url: str, key: str = "none", timeout: float = 120.0) -> openai.OpenAI:
    """The openai SDK against a front end at `url`, no retries (a test sees the first answer)."""
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=timeout)
