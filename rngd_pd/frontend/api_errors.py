"""Errors in OpenAI's JSON shape {"error": {"message", "type", "param", "code"}} with the right status.

Every failure a client can cause or meet maps to one `APIError`, its status, type and code from the
one table `ERROR_STATUS` (this package's errors, wherever raised or reported, and Triton's gRPC status
codes); anything else reaching the handler is a bug and becomes a 500 (logged with its traceback).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rngd_pd.errors import CapacityError, ConfigError, RngdPdError
from rngd_pd.frontend.schemas import UNSUPPORTED_CODE, ErrorDetail, ErrorResponse

log = logging.getLogger("rngd_pd.frontend")


@dataclass(frozen=True)
class Answer:
    """How one kind of failure is answered: HTTP status, OpenAI error type and code, and what the
    message gains (what the client can do)."""

    status: int
    type: str
    code: str | None = None
    hint: str = ""


_UNAVAILABLE = Answer(503, "service_unavailable", "backend_unavailable")
_UPSTREAM = Answer(502, "server_error", "backend_error")

ERROR_STATUS: dict[type[BaseException] | grpc.StatusCode, Answer] = {
    ConfigError: Answer(400, "invalid_request_error"),
    CapacityError: Answer(503, "service_unavailable", "server_busy", "; retry later"),
    RngdPdError: _UPSTREAM,
    Exception: Answer(500, "server_error"),
    grpc.StatusCode.UNAVAILABLE: _UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: _UNAVAILABLE,
    grpc.StatusCode.NOT_FOUND: _UNAVAILABLE,
    grpc.StatusCode.CANCELLED: Answer(503, "service_unavailable"),
}
"""Error type or Triton gRPC status code -> how the front end answers it. The rule:

* the request's fault (ConfigError and its kinds, ContextLengthError, ...): 400;
* a server that is busy (CapacityError), cannot be reached, has no ready model of that name, or
  cancelled the request (gRPC UNAVAILABLE, DEADLINE_EXCEEDED, NOT_FOUND, CANCELLED): 503, retry later;
* any other error of this package, and any other gRPC code: 502, the serving side (Triton, its models,
  the engine behind them) failed the request (the front end itself raises no other error of ours);
* an exception that is not ours: 500, a bug in the front end.

An exception's row is its class's nearest in the table (a subclass answers as its base unless named).
"""


def answer(error: BaseException | type[BaseException] | grpc.StatusCode) -> Answer:
    """The table's row for an exception (or its type) or a gRPC status code (unnamed codes: 502)."""
    if isinstance(error, grpc.StatusCode):
        return ERROR_STATUS.get(error, _UPSTREAM)
    cls = error if isinstance(error, type) else type(error)
    return next((ERROR_STATUS[c] for c in cls.__mro__ if c in ERROR_STATUS), ERROR_STATUS[Exception])


class APIError(RngdPdError):
    """An error answered to the client as-is: status plus OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type, param, code

    def body(self) -> dict[str, Any]:
        detail = ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=detail).model_dump()

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)

    @classmethod
    def of(cls, error: BaseException | type[BaseException] | grpc.StatusCode, message: str) -> APIError:
        """The error answered as `ERROR_STATUS` says for `error`, its hint after `message`."""
        row = answer(error)
        return cls(row.status, message + row.hint, type=row.type, code=row.code)


class BackendUnavailable(APIError):
    """Triton is not reachable or the served model is not ready: 503, retry later."""

    def __init__(self, message: str) -> None:
        row = ERROR_STATUS[grpc.StatusCode.UNAVAILABLE]
        super().__init__(row.status, message, type=row.type, code=row.code)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_domain_error(exc: RngdPdError) -> APIError:
    """This package's error (raised while preparing or running a request) as the table answers it."""
    if isinstance(exc, APIError):
        return exc
    return APIError.of(exc, str(exc))


def _validation_error(exc: RequestValidationError) -> APIError:
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    kind = first.get("type", "")
    param = loc[0] if loc else None  # the request's parameter (inner parts are union members, indices)
    if kind == "extra_forbidden":
        return bad_request(
            f"Unsupported parameter '{param}': this server does not implement it", param, UNSUPPORTED_CODE
        )
    if kind == UNSUPPORTED_CODE:
        return bad_request(first["msg"], param, UNSUPPORTED_CODE)
    if kind in ("json_invalid", "model_attributes_type") or not loc:
        return bad_request(f"The request body is not a valid JSON object: {first.get('msg')}")
    msg = first["msg"].removeprefix("Value error, ")
    where = ".".join(p for p in loc if p.isidentifier() or p.isdigit())
    return bad_request(f"Invalid value for '{where}': {msg}", param, "invalid_value")


def install_handlers(app: FastAPI) -> None:
    """Route every exception through the OpenAI error shape."""

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind).response()

    @app.exception_handler(RngdPdError)
    async def _domain(_: Request, exc: RngdPdError) -> JSONResponse:
        return from_domain_error(exc).response()

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return APIError.of(exc, f"internal server error: {type(exc).__name__}").response()


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {
        "model": ErrorResponse,
        "description": "Bad parameter value, unsupported parameter or prompt too long",
    },
    401: {"model": ErrorResponse, "description": "Missing or wrong API key (when one is configured)"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    429: {"model": ErrorResponse, "description": "More concurrent requests than --max-concurrency"},
    500: {"model": ErrorResponse, "description": "A bug in the server"},
    503: {"model": ErrorResponse, "description": "Triton is not reachable or the model is not ready"},
}
