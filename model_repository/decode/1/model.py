"""Triton entry point of `decode`: the logic is in rngd_pd.stubs.decode_model.DecodeModel."""

from __future__ import annotations

from rngd_pd.stubs.decode_model import DecodeModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
