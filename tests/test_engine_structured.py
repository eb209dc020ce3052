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


def _choices(engine: ColocatedEngine, ids: list[int], params: SamplingParams) -> dict[int, dict]:
    """Each choice's tokens, text, logprobs rows and finish reason."""
    out: dict[int, dict] = {}
    for ev in engine.stream(ids, params):
        c = out.setdefault(ev.index, {"tokens": [], "text": "", "rows": [], "reason": ""})
        if ev.token_id is not None:
            c["tokens"].append(ev.token_id)
            c["rows"].append(ev.logprobs)
        c["text"] += ev.text
        c["reason"] = ev.finish_reason or c["reason"]
    return out


def test_n_choices_each_keep_their_own_grammar_with_logprobs_and_penalties(colocated, smollm) -> None:
    """One grammar state per choice: n=3 sampled replies (choice i seeded seed + i) each validate, with
    raw logprobs on every token and a penalty and a bias in the sampler's order before the mask."""
    ids = _prompt(smollm, "Describe a person as JSON with name, age and pets.")
    structured = Structured("json_schema", SCHEMA, strict=True).to_json()
    params = SamplingParams(max_tokens=96, temperature=1.0, seed=11, n=3, logprobs=2, structured=structured,
                            presence_penalty=0.3, logit_bias=((smollm.tokenizer.encode("cat")[0], 2.0),))
    got = _choices(colocated, ids, params)
    assert sorted(got) == [0, 1, 2]
    for c in got.values():
        assert c["reason"] in ("stop", "eos"), c
        jsonschema.validate(json.loads(c["text"]), SCHEMA)
        assert all(r is not None and r.token == t and len(r.top) == 2 and r.logprob <= 0
                   for r, t in zip(c["rows"], c["tokens"], strict=True))
    again = _choices(colocated, ids, params)  # seeded: the same n replies
    assert [again[i]["tokens"] for i in range(3)] == [got[i]["tokens"] for i in range(3)]


def test_greedy_fast_path_under_a_grammar_and_the_full_path_agree(colocated, smollm, monkeypatch) -> None:
    """A plain greedy row whose argmax the grammar admits takes it without the vocabulary mask; asking
    for logprobs (or n > 1) takes the sampler's full path, which must choose the same tokens."""
    from rngd_pd.model.grammar import GrammarConstraint

    ids = _prompt(smollm, "Name three colours.")
    free = colocated.generate(ids, SamplingParams(max_tokens=8, ignore_eos=True))
    regex = Structured("regex", re.escape(free.text)).to_json()  # admits the free greedy reply
    masks = [0]
    original = GrammarConstraint.mask_into

    def counted(self, logits):
        masks[0] += 1
        return original(self, logits)

    monkeypatch.setattr(GrammarConstraint, "mask_into", counted)
    plain = colocated.generate(ids, SamplingParams(max_tokens=8, structured=regex))
    assert plain.token_ids == free.token_ids and plain.text == free.text
    assert masks[0] <= 1  # prefill's first token at most; decode never masked
    masks[0] = 0
    full = _choices(colocated, ids, SamplingParams(max_tokens=8, structured=regex, logprobs=1, n=2))
    for c in full.values():
        assert c["tokens"] == free.token_ids and c["text"] == free.text
        assert all(r.token == t for r, t in zip(c["rows"], c["tokens"], strict=True))
    assert masks[0] >= 2 * (len(free.token_ids) - 1)  # every decode step of both choices masked
