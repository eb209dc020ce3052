"""e2e: a greedy request served on the default configuration, against transformers in the same dtype.

One tritonserver with the cpu configs as shipped (compute dtype `auto`: what serving picks here, bf16 on
AVX512-BF16 hosts; the test session's RNGD_PD_DTYPE=fp32 is undone for this server), the shm transport,
pd -> prefill -> decode. One greedy request of 96 tokens (EOS ignored) through `pd` over gRPC.

transformers (its own loader and Llama) runs in the dtype the decode instance logged it chose. In bf16
two implementations round differently and greedy runs may part at a near-tie, after which the texts
differ for good; so the comparison is teacher-forced over the served tokens: transformers scores
prompt + served tokens in one pass, and at every served position the served token must be its top-1,
or a near-tie of it (within the device conformance's bf16 `tie`: rngd_pd.devices.conformance); the
share of positions where it is the top-1 must reach MIN_AGREEMENT (docs/model.md has the figures).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

import numpy as np
import pytest
import torch

from rngd_pd.devices import conformance
from rngd_pd.model.reference import Reference
from rngd_pd.testing import e2e as E
from tests.triton_harness import triton_server

pytestmark = pytest.mark.e2e

TOKENS = 96
MIN_AGREEMENT = 0.95  # top-1 agreement over the served positions (96 here: one miss is 1 %)
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _chosen_dtype(log: str, instance: str) -> str:
    m = re.search(rf"{instance}: compute dtype (\w+) \(([^)]*)", log)
    assert m, f"no compute dtype line for {instance} in the log"
    return m[1]


def test_served_greedy_tokens_are_transformers_top1_teacher_forced(hf_smollm) -> None:
    shm = tempfile.mkdtemp(prefix="rngd-pd-e2e-ref-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    repo = E.subset_repository(["pd", "prefill", "decode"])
    env = {"AIRM_KV_TRANSPORT": "shm", "PD_SHM_ROOT": shm, "RNGD_PD_DTYPE": "auto"}
    try:
        with triton_server(repo, "cpu", env) as server:
            tok = E.loaded_model().tokenizer
            ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]))
            inputs = E.pd_inputs(ids, max_tokens=TOKENS, ignore_eos=np.array([True]))
            responses = E.stream_infer(server.grpc_url, "pd", inputs, ("output_ids",), timeout=300)
            log = server.log_tail(100_000)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    served = E.ids_of(responses)
    assert len(served) == TOKENS
    dtype = _chosen_dtype(log, "decode_0_0")
    prefill_dtype = _chosen_dtype(log, "prefill_0_0")
    ref = Reference.load(None, dtype)
    logits = ref.score(ids + served[:-1])[0][len(ids) - 1:]
    top = logits.argmax(-1)
    agree = float((top == torch.tensor(served)).float().mean())
    margins = [float(logits[i, top[i]] - logits[i, t]) for i, t in enumerate(served) if t != int(top[i])]
    tie = conformance.tolerance(dtype, "bf16").tie
    print(f"\nserved in {dtype} (prefill {prefill_dtype}); transformers {dtype}: top-1 agreement {agree:.4f} "
          f"over {TOKENS} served tokens, margins where not top-1: {[round(m, 3) for m in margins]}")
    assert all(m <= tie for m in margins), margins
    assert agree >= MIN_AGREEMENT
