"""Triton entry point of `colocated`: the logic is in rngd_pd.stubs.pd_model.ColocatedModel."""

from __future__ import annotations

from rngd_pd.stubs.pd_model import ColocatedModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
