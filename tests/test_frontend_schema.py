"""Schemathesis against the front end's own OpenAPI schema: no 5xx, every response matches the schema.

The app runs over the scripted backend (tests/frontend_fakes.py) with a short context so that
generated requests stay fast; the checks are about the HTTP layer's honesty, not the model.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import positive_data_acceptance

from rngd_pd.frontend.app import create_app
from rngd_pd.frontend.config import FrontendConfig
from rngd_pd.frontend.served_model import load_served_model
from tests.frontend_fakes import ALL_INPUTS, FakeBackend


def _token_count_error(response) -> bool:
    """A 400 that depends on the prompt's tokens or on two fields, which no JSON schema can express:
    prompt + max_tokens over the context, a prompt whose text has no tokens at all (e.g. "\\x14"), a
    logit_bias key (a string) outside the vocabulary, min_tokens over max_tokens (or its default)."""
    body = response.content
    return response.status_code == 400 and (b"context_length_exceeded" in body
                                             or b"'prompt' is empty: give at least one token" in body
                                             or b"in 'logit_bias' is outside the vocabulary" in body
                                             or b"min_tokens must be an integer in" in body
                                             or b"top_logprobs needs logprobs" in body)


# parameters whose value must also compile (a JSON schema, a regex, a grammar) or agree with another
# (tool_choice naming one of the tools; one structured output at most): no JSON schema expresses that
_CHECKED_PARAMS = {"response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                   "structured_outputs", "tools", "tool_choice"}


def _constraint_error(response) -> bool:
    """A 400 for a structured output or tool that cannot be enforced (see _CHECKED_PARAMS)."""
    if response.status_code != 400:
        return False
    error = response.json()["error"]
    return error["code"] == "invalid_value" and error["param"] in _CHECKED_PARAMS


@pytest.fixture(scope="module")
def served():
    return load_served_model(FrontendConfig(max_model_len=256))


@pytest.mark.parametrize("api_key", [None, "k3y"])
def test_openapi_conformance(served, api_key):
    """Every operation, with generated bodies and parameters: status documented, body schema-valid.

    With a key configured the schema declares the bearer scheme, and schemathesis also checks that
    missing or wrong keys are refused. The schema names the served model, so most generated requests
    reach generation (over the scripted backend) instead of stopping at the 404.
    """
    config = FrontendConfig(max_model_len=256, api_key=api_key)
    # the schema offers `ignore_eos`, structured outputs, n, logprobs, ..., which a Triton model serves
    # only when it declares their inputs (a pd-style model declares them all)
    backend = FakeBackend(served.tokenizer, inputs=ALL_INPUTS)
    app = create_app(config, model=served, backend=backend)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/health"}
    for op in operations:

        @given(case=op.as_strategy())
        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            response = case.call(headers=headers)
            # accept exactly the rejections that depend on the prompt's tokens, check everything else
            rejected = _token_count_error(response) or _constraint_error(response)
            excluded = [positive_data_acceptance] if rejected else []
            case.validate_response(response, headers=headers, excluded_checks=excluded)

        check()
