"""rngd-pd: prefill/decode-disaggregated LLM serving on Triton Inference Server."""

from __future__ import annotations

__version__ = "0.1.0"
