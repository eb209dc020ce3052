"""`rngd-pd frontend`: the OpenAI-compatible HTTP front end over a running Triton server's gRPC port."""

from __future__ import annotations

import argparse
import logging
import sys

from rngd_pd.errors import RngdPdError
from rngd_pd.frontend.app import run as serve
from rngd_pd.frontend.config import FrontendConfig

HELP = "serve the OpenAI API (/v1/completions, /v1/chat/completions) in front of Triton's gRPC endpoint"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--triton-url", default="127.0.0.1:8001", help="Triton gRPC HOST:PORT (default 127.0.0.1:8001)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=9000, help="port to listen on (default 9000)")
    p.add_argument(
        "--model",
        default=None,
        help="the served model's GGUF file or checkpoint dir, for its tokenizer only; must be the "
        "server's --model (default: embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the name clients put in 'model' (default: the checkpoint's name)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 (default: $RNGD_PD_API_KEY; unset = open)",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=256,
        help="requests generating at once; more are refused with 429 (default 256)",
    )
    p.add_argument(
        "--triton-model",
        default="pd",
        choices=("pd", "colocated"),
        help="Triton model to call: pd (disaggregated, default) or colocated",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="refuse prompt + max_tokens above this (default: the model's context)",
    )
    p.add_argument(
        "--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug")
    )
    p.add_argument(
        "--server-status",
        default=None,
        metavar="FILE",
        help="status file of `rngd-pd serve` (it passes its own): /health and every request answer 503 "
        "while it does not say ready, e.g. while serve restarts tritonserver after a stub died",
    )


def config_from_args(args: argparse.Namespace):  # -> FrontendConfig (imported lazily)

    return FrontendConfig(
        triton_url=args.triton_url,
        host=args.host,
        port=args.port,
        model_path=args.model,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        max_concurrency=args.max_concurrency,
        triton_model=args.triton_model,
        max_model_len=args.max_model_len,
        log_level=args.log_level,
        server_status=args.server_status,
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        serve(config_from_args(args))
    except RngdPdError as e:
        print(f"rngd-pd frontend: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0
