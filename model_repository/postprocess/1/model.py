"""Triton entry point of `postprocess`: the logic is in rngd_pd.stubs.text_models.PostprocessModel."""

from __future__ import annotations

from rngd_pd.stubs.text_models import PostprocessModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
