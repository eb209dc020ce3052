"""Shared fixtures (session-scoped so the model loads once per test run)."""

from __future__ import annotations

import os

import pytest

# Servers that tests start compute in fp32 (the served default `auto` is bf16 on CPUs with native bf16):
# the references they are compared with (ColocatedEngine in-process, transformers) are fp32, and greedy
# tokens must be equal.
os.environ.setdefault("RNGD_PD_DTYPE", "fp32")
# Servers that tests start hand every prompt off (the tests' prompts are short, and decode would
# prefill them itself): the transport is what most e2e tests check. test_e2e_local_prefill turns
# conditional disaggregation on.
os.environ.setdefault("RNGD_PD_PARAM_LOCAL_PREFILL_TOKENS", "0")


@pytest.fixture(scope="session")
def engine_model():
    """The embedded SmolLM2-135M-Instruct (fp32 compute), for the engine tests."""
    import torch

    from rngd_pd.model import load_model

    # One thread: on these shared 2-core machines two OpenMP threads wait at every barrier for a core
    # someone else holds; measured: a 16-token prefill 107 ms with 1 thread, 2-4 s with 2, and the
    # model tests 54 s instead of 610 s.
    torch.set_num_threads(1)
    return load_model(progress=False)


@pytest.fixture(scope="session")
def smollm(engine_model):
    """The embedded model as a LoadedModel (fp32 compute); the same object as engine_model."""
    return engine_model


@pytest.fixture(scope="session")
def hf_smollm():
    """The transformers oracle on the same GGUF, fp32 (transformers is a test dependency only)."""
    import torch

    transformers = pytest.importorskip("transformers")
    from rngd_pd.model import embedded_model_path

    path = embedded_model_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def hf_smollm_tokenizer():
    """transformers' tokenizer converted from the same GGUF (the tokenizer oracle)."""
    transformers = pytest.importorskip("transformers")
    from rngd_pd.model import embedded_model_path

    path = embedded_model_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
