"""The requests that carry weight operations (rngd_pd.wire.weights) and the swap's config override
(rngd_pd.serve.model_control): each model's required inputs present in its declared dtypes, the
operation as JSON, parameters set as config.pbtxt spells them."""

from __future__ import annotations

import json

import numpy as np

from rngd_pd.serve.model_control import with_params
from rngd_pd.wire import tensors as T
from rngd_pd.wire.weights import generate_body, op_inputs, state_of


def test_op_inputs_carry_every_required_input_of_the_model():
    op = {"op": "stage", "checkpoint": "/ckpt"}
    for model in ("pd", "prefill", "decode"):
        inputs = op_inputs(model, op)
        spec = T.model_spec(model)
        required = {t.name for t in spec.inputs if not t.optional}
        assert required <= set(inputs), (model, required - set(inputs))
        for name, array in inputs.items():
            assert array.dtype == spec.input(name).numpy_dtype, (model, name)
        assert json.loads(inputs[T.WEIGHTS_OP][0]) == op


def test_generate_body_and_answers():
    body = generate_body("pd", {"op": "state"})
    assert json.loads(body[T.WEIGHTS_OP]) == {"op": "state"} and body[T.INPUT_IDS] == [0]
    answer = {"x": 1}
    assert state_of({T.WEIGHTS_STATE: np.array([json.dumps(answer).encode()], dtype=np.object_)}) == answer
    assert state_of({T.WEIGHTS_STATE: json.dumps(answer)}) == answer  # the generate extension's JSON


def test_with_params_overrides_only_what_it_names():
    config = {"name": "decode", "parameters": {"num_slots": {"string_value": "8"},
                                               "max_len": {"string_value": "2048"}}}
    out = with_params(config, {"num_slots": 16, "pack_weights": "false"})
    assert out["parameters"]["num_slots"] == {"string_value": "16"}
    assert out["parameters"]["pack_weights"] == {"string_value": "false"}
    assert out["parameters"]["max_len"] == {"string_value": "2048"}
    assert config["parameters"]["num_slots"] == {"string_value": "8"}  # the served config is not changed
