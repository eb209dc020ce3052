"""Server-sent events and client disconnects.

`SSEResponse` always listens for the client going away (whatever ASGI version the server speaks)
and, however the response ends, closes its body iterator and awaits `on_close` exactly once (which
closes the generation, cancelling the Triton request if it is still running, and frees the
concurrency slot). `until_disconnect` does the same for the part of a request that runs before any
byte is sent (non-streaming requests, and the wait for the first token of a streaming one).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")
DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was complete."""


def sse(payload: BaseModel | dict[str, Any]) -> bytes:
    """One `data:` event."""
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return b"data: " + body.encode() + b"\n\n"


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable`, cancelling it and raising ClientGone if the client disconnects first."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        raise ClientGone()
    finally:
        for task in (work, watch):
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task


class SSEResponse(StreamingResponse):
    """text/event-stream response that cancels its generator when the client leaves."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[bool], Awaitable[None]]) -> None:
        super().__init__(content, headers=SSE_HEADERS)
        self._content = content
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        completed = False
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    nonlocal completed
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                        completed = True
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await _wait_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._content.aclose()  # type: ignore[attr-defined]
                await self._on_close(completed)
