"""Where the RNGD environment is: `.venv-rngd` (furiosa-torch with the torch 2.10 it pins), made by
`make rngd-env`, or $RNGD_PD_RNGD_VENV. Stdlib only: the device probe reads it without torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from rngd_pd.config.env import RNGD_PD_RNGD_VENV
from rngd_pd.devices.rngd.setup import STAMP
from rngd_pd.errors import DeviceUnavailableError

RNGD_ENV = ".venv-rngd"
MAKE_HINT = "run `make rngd-env` in the repository (furiosa-torch 2026.4.0 in its own .venv-rngd)"


def repo_root() -> Path:
    return Path(__file__).resolve().parents[3]


def rngd_env(env: Mapping[str, str] | None = None) -> Path:
    """Where the RNGD environment is (or would be): $RNGD_PD_RNGD_VENV, else <repo>/.venv-rngd."""
    return RNGD_PD_RNGD_VENV.get(env) or repo_root() / RNGD_ENV


def rngd_python(env: Mapping[str, str] | None = None) -> Path | None:
    """The environment's python when it is there and set up (its stamp file), else None."""
    venv = rngd_env(env)
    python = venv / "bin" / "python"
    return python if python.exists() and (venv / STAMP).exists() else None


def require_rngd_python(env: Mapping[str, str] | None = None) -> Path:
    python = rngd_python(env)
    if python is None:
        raise DeviceUnavailableError(f"the FuriosaAI RNGD environment {rngd_env(env)} is missing or "
                                     f"incomplete; {MAKE_HINT}")
    return python
