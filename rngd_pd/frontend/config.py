"""Front-end configuration: one frozen dataclass shared by `rngd-pd frontend`, `rngd-pd serve` and tests."""

from __future__ import annotations

from dataclasses import dataclass, field

from rngd_pd.config.env import RNGD_PD_API_KEY
from rngd_pd.errors import ConfigError

TRITON_MODELS = ("pd", "colocated")


@dataclass(frozen=True)
class FrontendConfig:
    """Everything the OpenAI front end needs; `validate()` before use.

    `model_path` None means the embedded SmolLM2 GGUF, the same default the server uses, so the
    tokenizer the front end loads always matches the served weights.
    """

    triton_url: str = "127.0.0.1:8001"
    host: str = "127.0.0.1"
    port: int = 9000
    model_path: str | None = None
    served_model_name: str | None = None
    api_key: str | None = field(default=None, repr=False)
    max_concurrency: int = 256
    triton_model: str = "pd"
    max_model_len: int | None = None
    log_level: str = "warning"
    server_status: str | None = None  # serve's status file (rngd_pd.wire.status): 503 unless ready

    def validate(self) -> None:
        """Raise ConfigError naming the first bad setting."""
        if not self.triton_url or "://" in self.triton_url:
            raise ConfigError(
                f"--triton-url must be HOST:PORT of Triton's gRPC endpoint, got {self.triton_url!r}"
            )
        if not 0 <= self.port < 65536:
            raise ConfigError(f"--port must be in 0..65535, got {self.port}")
        if self.max_concurrency < 1:
            raise ConfigError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.triton_model not in TRITON_MODELS:
            raise ConfigError(
                f"--triton-model must be one of {', '.join(TRITON_MODELS)}, got {self.triton_model!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("--api-key must not be empty (unset it to disable authentication)")

    def resolved_api_key(self) -> str | None:
        """The key from the config, else from $RNGD_PD_API_KEY; None disables authentication."""
        key = self.api_key if self.api_key is not None else RNGD_PD_API_KEY.get()
        return key.strip() if key else None

    def to_argv(self) -> list[str]:
        """Arguments for `rngd-pd frontend` reproducing this config (the key travels by environment)."""
        argv = [
            "--triton-url",
            self.triton_url,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--max-concurrency",
            str(self.max_concurrency),
            "--triton-model",
            self.triton_model,
            "--log-level",
            self.log_level,
        ]
        if self.model_path:
            argv += ["--model", self.model_path]
        if self.served_model_name:
            argv += ["--served-model-name", self.served_model_name]
        if self.max_model_len:
            argv += ["--max-model-len", str(self.max_model_len)]
        if self.server_status:
            argv += ["--server-status", self.server_status]
        return argv
