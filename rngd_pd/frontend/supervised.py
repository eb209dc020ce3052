"""The front end under `rngd-pd serve`: serve's status file decides readiness before Triton is asked.

`rngd-pd serve` passes `--server-status FILE` (rngd_pd.wire.status.ServerStatus, JSON). While the
file does not say `ready` (a model's stub died and tritonserver is being restarted, or serve gave up):

* /health answers 503 with the status's sentence (what failed, restart n);
* every new generation request answers 503 `{"error": {"type": "service_unavailable",
  "code": "server_recovering", "message": "The server is recovering: stub of model decode (pid 812)
  died; restarting tritonserver (restart 1); retry shortly"}}` with `Retry-After`;
* a request whose stream breaks meanwhile (the restart ends every stream) ends with that error too,
  the transport's own words appended, as an SSE error event when its 200 already went out.

Without the file (a front end started by hand) nothing changes: readiness is Triton's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse

from rngd_pd.frontend.api_errors import APIError
from rngd_pd.frontend.backend import Backend, GenerateRequest, TokenChunk
from rngd_pd.wire.status import FAILED, ServerStatus, StatusReader

RETRY_AFTER_S = 5


class ServerRecovering(APIError):
    """503 while serve restarts tritonserver (code `server_recovering`), or after it gave up."""

    def __init__(self, status: ServerStatus, interrupted: str = "") -> None:
        message = status.message()
        if interrupted:
            message += f" (this request was interrupted: {interrupted})"
        failed = status.state == FAILED
        super().__init__(503, message, type="service_unavailable",
                         code="server_unavailable" if failed else "server_recovering")
        self.retry_after = None if failed else RETRY_AFTER_S

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


class SupervisedBackend:
    """A Backend that answers 503 while serve's status is not `ready`, else passes through."""

    def __init__(self, inner: Backend, status: StatusReader) -> None:
        self.inner, self.status = inner, status

    async def ready(self) -> str | None:
        current = self.status.current()
        if not current.ready:
            return current.message()
        return await self.inner.ready()

    async def max_len(self) -> int | None:
        return await self.inner.max_len()

    async def weights(self, op: dict[str, Any]) -> dict[str, Any]:
        current = self.status.current()
        if not current.ready:
            raise ServerRecovering(current)
        return await self.inner.weights(op)

    async def close(self) -> None:
        await self.inner.close()

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenChunk]:
        current = self.status.current()
        if not current.ready:
            raise ServerRecovering(current)
        stream = self.inner.generate(req)
        try:
            async for chunk in stream:
                yield chunk
        except APIError as exc:
            current = self.status.current()
            if current.ready:
                raise
            raise ServerRecovering(current, exc.message) from None
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
