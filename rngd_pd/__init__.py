"""rngd-pd: prefill/decode-disaggregated LLM serving on Triton Inference Server.

Importing the package sets `MKL_CBWR=AUTO` unless the environment sets it: MKL, which runs torch's
fp32 GEMMs on the CPU (and those inside its SDPA flash kernel), otherwise picks code paths by memory
alignment, and a decode row's attention then got other bits beside other rows than alone at 2
threads (2-core AVX2 EPYC; tests/test_batch_invariance.py). MKL reads it at its first call, so it
must be set before any torch compute in the process; no measurable cost (bench/engine_bench.py).
"""

from __future__ import annotations

import os

from rngd_pd.config.env import MKL_CBWR

os.environ.setdefault(MKL_CBWR.name, MKL_CBWR.default)

__version__ = "0.1.0"
