"""Shared fixtures (session-scoped so the model loads once per test run), and CI's rule on skips:
under CI=true a skip outside the allow-list of tests/skips.py fails (docs/testing.md)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from rngd_pd.config.env import CI
from tests import skips

# Servers that tests start compute in fp32 (the served default `auto` is bf16 on CPUs with native bf16):
# the references they are compared with (ColocatedEngine in-process, transformers) are fp32, and greedy
# tokens must be equal.
os.environ.setdefault("RNGD_PD_DTYPE", "fp32")
# Servers that tests start hand every prompt off (the tests' prompts are short, and decode would
# prefill them itself): the transport is what most e2e tests check. test_e2e_local_prefill turns
# conditional disaggregation on.
os.environ.setdefault("RNGD_PD_PARAM_LOCAL_PREFILL_TOKENS", "0")
# Servers that tests start keep 8 decode slots, the concurrency their tests were written for; the
# sizing at load (num_slots 0, the served default) is tests/test_capacity.py's and
# test_e2e_pd.py::test_the_server_unloads_pd_promptly_after_traffic's.
os.environ.setdefault("RNGD_PD_PARAM_NUM_SLOTS", "8")


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
    """The transformers oracle on the same GGUF, fp32 (transformers is a test dependency only); the
    same process-wide load the device conformance's reference uses (rngd_pd.model.reference)."""
    import transformers  # noqa: F401 - a test dependency (make setup): missing, this fails, never skips

    from rngd_pd.model.reference import hf_model

    return hf_model(None, "fp32")


@pytest.fixture(scope="session")
def hf_smollm_tokenizer():
    """transformers' tokenizer converted from the same GGUF (the tokenizer oracle)."""
    import transformers

    from rngd_pd.model import embedded_model_path

    path = embedded_model_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


# ---------------------------------------------------------------- CI: no skip outside the allow-list

_ACCEPTED = pytest.StashKey[list[tuple[str, str]]]()


def _judge(config: pytest.Config, report: pytest.TestReport | pytest.CollectReport) -> None:
    """In CI, a skipped report outside the allow-list becomes a failure that says why; an allowed one
    is remembered for the summary."""
    if not report.skipped or hasattr(report, "wasxfail") or not CI.get():
        return
    reason = skips.skip_reason(report)
    why = skips.allowed(reason)
    if why is not None:
        config.stash.setdefault(_ACCEPTED, []).append((report.nodeid, f"{why}: {reason}"))
        return
    report.outcome = "failed"
    report.longrepr = (f"skipped in CI (CI=true) for a reason outside the allow-list of tests/skips.py: "
                       f"{reason}\n(install what it needs through `make`, or fix the test; a new allowed "
                       "reason needs its justification there)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    _judge(item.config, outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    _judge(collector.config, outcome.get_result())


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int,
                            config: pytest.Config) -> None:
    """Under CI=true, what the allow-list let skip (each test and its reason), even when nothing did."""
    if CI.get():
        accepted = config.stash.get(_ACCEPTED, [])
        terminalreporter.section(f"CI skip allow-list (tests/skips.py): {len(accepted)} skipped")
        for nodeid, reason in accepted:
            terminalreporter.write_line(f"{nodeid}: {reason}")
