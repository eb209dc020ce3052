"""Shared fixtures (session-scoped so the model loads once per test run)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def engine_model():
    """The embedded SmolLM2-135M-Instruct (fp32 compute), for the engine tests."""
    import torch

    from rngd_pd.model import load_model

    torch.set_num_threads(2)
    return load_model(progress=False)
