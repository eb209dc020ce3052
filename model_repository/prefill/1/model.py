"""Triton entry point of `prefill`: the logic is in rngd_pd.stubs.prefill_model.PrefillModel."""

from __future__ import annotations

from rngd_pd.stubs.prefill_model import PrefillModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
