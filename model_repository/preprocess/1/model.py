"""Triton entry point of `preprocess`: the logic is in rngd_pd.stubs.text_models.PreprocessModel."""

from __future__ import annotations

from rngd_pd.stubs.text_models import PreprocessModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
