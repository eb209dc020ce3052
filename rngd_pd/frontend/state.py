"""What the request handlers of one app share: `FrontendState` (config, served model, backend,
concurrency limit, metrics). Its own module, so the app that builds it and the handlers that use it
both import it, and neither imports the other's way back.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from rngd_pd.frontend.api_errors import APIError
from rngd_pd.frontend.backend import Backend
from rngd_pd.frontend.config import FrontendConfig
from rngd_pd.frontend.metrics import FrontendMetrics
from rngd_pd.frontend.prompts import ServedModel

log = logging.getLogger("rngd_pd.frontend")


class Limiter:
    """At most `limit` requests generating at once; the next one is refused (429), never queued."""

    def __init__(self, limit: int) -> None:
        self.limit, self.active = limit, 0

    def acquire(self) -> None:
        if self.active >= self.limit:
            raise APIError(
                429,
                f"The server is at its limit of {self.limit} concurrent requests "
                "(--max-concurrency); retry shortly",
                type="rate_limit_error",
                code="too_many_concurrent_requests",
            )
        self.active += 1

    def release(self) -> None:
        self.active -= 1


class FrontendState:
    """What the request handlers share; one per app."""

    def __init__(self, config: FrontendConfig, model: ServedModel, backend: Backend) -> None:
        if config.max_model_len is not None and config.max_model_len < model.max_model_len:
            model = replace(model, max_model_len=config.max_model_len)
        self.config, self.model, self.backend = config, model, backend
        self.checkpoint_limit = model.max_model_len  # the checkpoint's context, or --max-model-len
        self.api_key = config.resolved_api_key()
        self.limiter = Limiter(config.max_concurrency)
        self.metrics = FrontendMetrics()
        self.created = int(time.time())

    async def context_model(self) -> ServedModel:
        """The served model with the context limit Triton really serves: min(checkpoint's context,
        the Triton model's `max_len`), so an over-long request gets the front end's 400 with the
        lengths. Asked once and again after a Triton error; `--max-model-len` replaces the question.
        """
        if self.config.max_model_len is None:
            served = await self.backend.max_len()
            if served is not None:
                limit = min(self.checkpoint_limit, served)
                if limit != self.model.max_model_len:
                    log.info("context limit %d (Triton model serves %d tokens)", limit, served)
                    self.model = replace(self.model, max_model_len=limit)
        return self.model
