"""Triton entry point of `pd`: the logic is in rngd_pd.stubs.pd_model.PdModel."""

from __future__ import annotations

from rngd_pd.stubs.pd_model import PdModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
