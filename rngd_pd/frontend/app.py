"""The OpenAI-compatible HTTP app: `create_app(config)` builds it, `run(config)` serves it with uvicorn.

Order of checks for a generation request: API key (401), body (400), model name (404), prompt and
context length (400), concurrency (429), then Triton (503 when unreachable). A streaming response's
status is sent with its first token, so everything before that still gets a proper status code.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from rngd_pd import __version__
from rngd_pd.frontend import handlers
from rngd_pd.frontend.api_errors import ERROR_RESPONSES, APIError, install_handlers
from rngd_pd.frontend.backend import Backend, TritonBackend
from rngd_pd.frontend.config import FrontendConfig
from rngd_pd.frontend.metrics import CONTENT_TYPE, FrontendMetrics
from rngd_pd.frontend.prompts import ServedModel
from rngd_pd.frontend.schemas import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    UpdateWeightsRequest,
    UpdateWeightsResponse,
    VersionResponse,
)
from rngd_pd.frontend.served_model import load_served_model
from rngd_pd.frontend.state import FrontendState
from rngd_pd.frontend.supervised import SupervisedBackend
from rngd_pd.wire.status import StatusReader

log = logging.getLogger("rngd_pd.frontend")
_bearer = HTTPBearer(auto_error=False, description="Required when the server runs with --api-key")
# One server-sent event: `data` is a JSON chunk (the response object with text deltas), an error
# object, or the final "[DONE]".
_SSE_EVENT = {
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}
_SSE_DOC = {"text/event-stream": {"schema": _SSE_EVENT, "example": "data: {...}\n\ndata: [DONE]\n\n"}}

# seed < 2**64 stated as the largest double below 2**64: JSON tools compare numbers as doubles, and
# `exclusiveMaximum: 2**64` let them send 2**64 + 382 as valid (it rounds to 2**64 - 2048 or below).
_SEED_MAX = 2**64 - 2048
_COUNTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/tokenize",
                            "/detokenize", "/version"})


class _StatusCounter:
    """ASGI middleware counting answers by endpoint and status (unknown paths as "other")."""

    def __init__(self, app: Any, metrics: FrontendMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope[handlers.ARRIVAL_KEY] = time.perf_counter()
        path = scope["path"] if scope["path"] in _COUNTED_PATHS else "other"

        async def counting_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(path, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def _state(request: Request) -> FrontendState:
    return request.app.state.frontend


async def _authorize(request: Request, creds: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:
    key = _state(request).api_key
    if key is None:
        return
    if creds is None:
        raise APIError(401, "Missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
    if not hmac.compare_digest(creds.credentials.encode(), key.encode()):
        raise APIError(401, "Incorrect API key provided", code="invalid_api_key")


def create_app(
    config: FrontendConfig, *, model: ServedModel | None = None, backend: Backend | None = None
) -> FastAPI:
    """The ASGI app. `model` (tokenizer + limits) and `backend` default to the real ones from `config`."""
    config.validate()
    if model is None:
        model = load_served_model(config)
    backend = backend or TritonBackend(config.triton_url, config.triton_model)
    status = None
    if config.server_status:  # under `rngd-pd serve`: its status file says ready first
        status = StatusReader(config.server_status)
        backend = SupervisedBackend(backend, status)
    state = FrontendState(config, model, backend)
    if status is not None:
        state.metrics.watch_server(status)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        # learn the served context limit now if Triton is up (else at /health or the first request)
        learn = asyncio.create_task(state.context_model())
        yield
        learn.cancel()
        await asyncio.gather(learn, return_exceptions=True)
        await state.backend.close()

    app = FastAPI(
        title="rngd-pd OpenAI-compatible API",
        version=__version__,
        lifespan=lifespan,
        description="Completions and chat completions over Triton Inference Server.",
    )
    app.state.frontend = state
    app.add_middleware(_StatusCounter, metrics=state.metrics)
    install_handlers(app)
    _add_routes(app)
    _tidy_openapi(app, secured=state.api_key is not None, state=state)
    return app


def _add_routes(app: FastAPI) -> None:
    gen_responses: dict[int | str, dict[str, Any]] = {**ERROR_RESPONSES, 200: {"content": _SSE_DOC}}
    auth = [Depends(_authorize)]

    @app.post(
        "/v1/completions", response_model=CompletionResponse, responses=gen_responses, dependencies=auth
    )
    async def completions(body: CompletionRequest, request: Request) -> Any:
        """Text completion; `stream: true` answers with server-sent events ending in `data: [DONE]`."""
        return await handlers.completion(_state(request), body, request)

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses=gen_responses,
        dependencies=auth,
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        """Chat completion with the model's chat template; streaming like /v1/completions."""
        return await handlers.chat(_state(request), body, request)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES, dependencies=auth)
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest, request: Request) -> Any:
        """vLLM's /tokenize: a prompt (or chat messages, through the chat template) -> token ids."""
        return await handlers.tokenize(_state(request), body)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=ERROR_RESPONSES, dependencies=auth)
    async def detokenize(body: DetokenizeRequest, request: Request) -> Any:
        """vLLM's /detokenize: token ids -> text."""
        return await handlers.detokenize(_state(request), body)

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        """The server's version (vLLM's /version)."""
        return VersionResponse(version=__version__)

    @app.get("/v1/models", response_model=ModelList, responses={401: ERROR_RESPONSES[401]}, dependencies=auth)
    async def models(request: Request) -> ModelList:
        s = _state(request)
        model = await s.context_model()
        card = ModelCard(id=model.name, created=s.created, max_model_len=model.max_model_len)
        return ModelList(data=[card])

    @app.post("/update_weights_from_disk", response_model=UpdateWeightsResponse, responses=ERROR_RESPONSES,
              dependencies=auth)
    async def update_weights_from_disk(body: UpdateWeightsRequest, request: Request) -> UpdateWeightsResponse:
        """Update the served weights to a checkpoint directory on the server's host in which some
        tensors changed (SGLang's endpoint of this name): only the changed tensors are read;
        running requests finish on the old weights, new ones wait and then run on the new."""
        op = {"op": "apply_delta", "checkpoint": body.model_path, "drain_s": body.drain_s}
        report = await _state(request).backend.weights(op)
        changed = len(report.get("changed", []))
        return UpdateWeightsResponse(success=True, message=f"{changed} tensors changed", report=report)

    @app.get("/health", response_model=HealthResponse, responses={503: {"model": HealthResponse}})
    async def health(request: Request) -> Any:
        """200 only when Triton and the served model are ready (and, under `rngd-pd serve`, serve's
        status says ready: 503 naming what failed while it restarts tritonserver)."""
        reason = await _state(request).backend.ready()
        if reason is None:
            await _state(request).context_model()  # Triton may have come up since start-up
            return HealthResponse(status="ok")
        return JSONResponse(HealthResponse(status="unavailable", detail=reason).model_dump(), status_code=503)

    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
    )
    async def metrics(request: Request) -> Response:
        """The front end's own Prometheus metrics."""
        return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


def _tidy_openapi(app: FastAPI, secured: bool, state: FrontendState) -> None:
    """Make the schema say what the app does: validation errors are OpenAI-style 400s (not 422), the
    bearer scheme and 401s appear only when an API key is configured, `model` names the served model
    (any other name is a 404), and token ids and max_tokens carry the model's bounds (rebuilt when
    the context limit learned from Triton changes)."""
    original = app.openapi
    built_for: list[int] = []

    def openapi() -> dict[str, Any]:
        limits = state.model
        if built_for != [limits.max_model_len]:
            app.openapi_schema = None
            built_for[:] = [limits.max_model_len]
        if app.openapi_schema is None:
            schema = original()
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
                    if not secured:
                        op.pop("security", None)
                        op.get("responses", {}).pop("401", None)
            if not secured:
                schema.get("components", {}).pop("securitySchemes", None)
            bodies = schema.get("components", {}).get("schemas", {})
            for name in ("CompletionRequest", "ChatCompletionRequest"):
                props = bodies[name]["properties"]
                props["model"]["enum"] = [limits.name]
                for key in ("max_tokens", "max_completion_tokens"):
                    if key in props:
                        _set_integer_bounds(props[key], maximum=limits.max_model_len - 1)
                _set_integer_bounds(props["seed"], maximum=_SEED_MAX)
                _set_integer_bounds(props["stop_token_ids"], maximum=limits.vocab_size - 1)
                _set_key_pattern(props["logit_bias"], "^[0-9]+$")
            _set_integer_bounds(
                bodies["CompletionRequest"]["properties"]["prompt"], maximum=limits.vocab_size - 1
            )
            detokenize = bodies["DetokenizeRequest"]["properties"]["tokens"]
            _set_integer_bounds(detokenize, maximum=limits.vocab_size - 1)
            # FastAPI lists every enum a response names; finish_reason is documented in OpenAI's
            # spelling (schemas.OpenAIFinish), so the enum of ours behind it is nowhere referenced
            for name in ("HTTPValidationError", "ValidationError", "FinishReason"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _set_key_pattern(node: Any, pattern: str) -> None:
    """Give every object schema under `node` a `propertyNames` pattern (logit_bias: token ids)."""
    if isinstance(node, dict):
        if node.get("type") == "object":
            node["propertyNames"] = {"pattern": pattern}
        for value in node.values():
            _set_key_pattern(value, pattern)
    elif isinstance(node, list):
        for value in node:
            _set_key_pattern(value, pattern)


def _set_integer_bounds(node: Any, maximum: int) -> None:
    """Set `maximum` on every integer schema under `node` (pydantic cannot know runtime limits)."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            node["maximum"] = maximum
            node.pop("exclusiveMaximum", None)
        for value in node.values():
            _set_integer_bounds(value, maximum)
    elif isinstance(node, list):
        for value in node:
            _set_integer_bounds(value, maximum)


def run(config: FrontendConfig) -> None:
    """Serve until interrupted (blocking). `rngd-pd serve` calls this in-process or via `rngd-pd frontend`."""
    app = create_app(config)
    log.warning(
        "OpenAI front end on http://%s:%d/v1 -> Triton %s model '%s'",
        config.host,
        config.port,
        config.triton_url,
        config.triton_model,
    )
    uvicorn.run(
        app, host=config.host, port=config.port, log_level=config.log_level, timeout_graceful_shutdown=5
    )
