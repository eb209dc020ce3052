"""Structured outputs in the engines with the embedded model: prefill samples the first token under the
grammar, decode accepts it and goes on, per request in the batch (constrained rows beside free ones);
jsonschema and `re` are the oracles."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from rngd_pd.engine.colocated import ColocatedEngine
from rngd_pd.model.sampling import SamplingParams
from rngd_pd.model.structured import Structured

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def colocated(smollm):
    with ColocatedEngine(smollm, num_slots=4, max_len=256, chunk_size=None) as eng:
        yield eng


def _prompt(smollm, text: str) -> list[int]:
    tok = smollm.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def test_json_schema_greedy_and_sampled_in_one_batch(colocated, smollm) -> None:
    ids = _prompt(smollm, "Describe a person as JSON with name, age and pets.")
    structured = Structured("json_schema", SCHEMA, strict=True).to_json()
    cases = [SamplingParams(max_tokens=96, structured=structured),
             *(SamplingParams(max_tokens=96, temperature=1.0, seed=s, structured=structured)
               for s in range(2)),
             SamplingParams(max_tokens=12, ignore_eos=True)]  # an unconstrained row in the same batch
    results: list = [None] * len(cases)

    def run(i: int) -> None:
        results[i] = colocated.generate(ids, cases[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for res in results[:-1]:
        assert res.finish_reason in ("stop", "eos"), res
        jsonschema.validate(json.loads(res.text), SCHEMA)
    assert results[-1].finish_reason == "length" and len(results[-1].token_ids) == 12


def test_the_grammar_ends_the_request(colocated, smollm) -> None:
    ids = _prompt(smollm, "Is the sky blue? Answer yes or no.")
    res = colocated.generate(ids, SamplingParams(max_tokens=20, structured=Structured(
        "choice", ["yes", "no"]).to_json()))
    assert res.text in ("yes", "no") and res.finish_reason == "stop"
    regex = Structured("regex", r"(Yes|No), because [a-z ]{1,20}\.").to_json()
    res = colocated.generate(ids, SamplingParams(max_tokens=30, temperature=0.8, seed=3, structured=regex))
    assert re.fullmatch(r"(Yes|No), because [a-z ]{1,20}\.", res.text), res


def test_a_tokenizer_the_grammar_engine_refuses_still_serves_unconstrained_requests(smollm) -> None:
    """A checkpoint whose EOS id lies outside its tokenizer (llguidance refuses such a tokenizer):
    unconstrained requests never build llguidance's view; a constrained one gets an error naming it."""
    from rngd_pd.errors import ConfigError
    from rngd_pd.model.grammar import Grammars

    class OutOfRangeEos:  # the embedded tokenizer, with a Llama-3.1 EOS id it does not hold
        def __init__(self, inner) -> None:
            self.tok, self.eos_token_ids = inner.tok, (128001,)

    grammars = Grammars(OutOfRangeEos(smollm.tokenizer))
    assert grammars.constraint(None) is None and grammars.constraint("") is None
    with pytest.raises(ConfigError, match="llguidance"):
        grammars.constraint(Structured("json_schema", SCHEMA).to_json())
