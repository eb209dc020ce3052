"""The shared parameter parser and the tensor specs: typed values, env overrides, named failures."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest

from rngd_pd.config import params
from rngd_pd.config.env import AIRM_KV_TRANSPORT, RNGD_PD_KV_DTYPE, RNGD_PD_MODEL
from rngd_pd.errors import ConfigError
from rngd_pd.stubs import pbutils
from rngd_pd.testing.repository import config_pbtxt
from rngd_pd.wire import tensors


@dataclass(frozen=True)
class DecodeLike(params.ServingParams):
    num_slots: int = params.param(8)
    prefill_url: str | None = params.param(None)
    chunked: bool = params.param(False)

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.num_slots}")


def triton_config(**values: str) -> str:
    """Triton's args['model_config'] JSON with string parameters."""
    return json.dumps({"name": "decode", "parameters": {k: {"string_value": v} for k, v in values.items()}})


def test_values_convert_to_field_types() -> None:
    p = params.parse_params(DecodeLike, triton_config(
        device="cpu", device_ids="[0, 1]", num_slots="4", chunked="true", prefill_url="", kv_dtype="fp32",
    ), env={})
    assert p == DecodeLike(device_ids=(0, 1), num_slots=4, chunked=True, kv_dtype="fp32")
    assert p.prefill_url is None and p.model_path is None
    assert p.device_id_for(1) == 1


def test_defaults_when_no_parameters() -> None:
    assert params.parse_params(DecodeLike, json.dumps({"name": "decode"}), env={}) == DecodeLike()


def test_environment_overrides_config() -> None:
    env = {RNGD_PD_MODEL.name: "/m/x.gguf", AIRM_KV_TRANSPORT.name: "tcp", RNGD_PD_KV_DTYPE.name: "fp16"}
    p = params.parse_params(DecodeLike, triton_config(kv_transport="shm", kv_dtype="bf16"), env=env)
    assert (p.model_path, p.kv_transport, p.kv_dtype) == ("/m/x.gguf", "tcp", "fp16")
    # an empty variable does not override
    empty = params.parse_params(DecodeLike, triton_config(), env={AIRM_KV_TRANSPORT.name: ""})
    assert empty.kv_transport == "shm"


def test_generic_parameter_override() -> None:
    env = {"RNGD_PD_PARAM_NUM_SLOTS": "3", "RNGD_PD_PARAM_KV_TRANSPORT": "tcp",
           AIRM_KV_TRANSPORT.name: "shm", "RNGD_PD_PARAM_NOT_A_FIELD": "1"}
    p = params.parse_params(DecodeLike, triton_config(num_slots="8"), env=env)
    assert p.num_slots == 3 and p.kv_transport == "shm"  # the named override wins over the generic one
    with pytest.raises(ConfigError, match=r"'num_slots' from \$RNGD_PD_PARAM_NUM_SLOTS is 'x'"):
        params.parse_params(DecodeLike, triton_config(), env={"RNGD_PD_PARAM_NUM_SLOTS": "x"})


@pytest.mark.parametrize(
    ("values", "env", "needle"),
    [
        ({"num_slot": "4"}, {}, "unknown parameter(s) num_slot"),
        ({"num_slots": "four"}, {}, "'num_slots' from config.pbtxt is 'four', which is not a valid int"),
        ({"chunked": "maybe"}, {}, "'chunked' from config.pbtxt is 'maybe'"),
        ({"device": "tpu"}, {}, "'device' from config.pbtxt is 'tpu'; choose one of cpu, cuda, rngd, atom"),
        ({}, {RNGD_PD_KV_DTYPE.name: "int4"}, "'kv_dtype' from $RNGD_PD_KV_DTYPE is 'int4'"),
        ({"num_slots": "0"}, {}, "num_slots must be >= 1"),
        ({"device_ids": "0,x"}, {}, "'device_ids' from config.pbtxt is 'x'"),
    ],
)
def test_bad_parameters_name_the_culprit(values: dict, env: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        params.parse_params(DecodeLike, triton_config(**values), env=env)
    assert needle in str(info.value)
    assert "model 'decode'" in str(info.value)


def test_triton_own_parameters_are_allowed() -> None:
    p = params.parse_params(DecodeLike, triton_config(EXECUTION_ENV_PATH="/x.tar.gz"), env={})
    assert p == DecodeLike()


def test_device_ids_per_instance() -> None:
    assert DecodeLike(device_ids=(-1,)).device_id_for(3) == -1
    with pytest.raises(ConfigError, match="one id per instance"):
        DecodeLike(device_ids=(0, 1)).device_id_for(2)
    assert params.instance_index("decode_0_1") == 1
    assert params.instance_index("decode") == 0


def test_spec_lookup_and_arrays() -> None:
    assert tensors.model_spec("llm").input("text_input").dtype == "BYTES"
    assert tensors.PD.input_names[0] == "input_ids"
    with pytest.raises(KeyError, match="known: llm, pd"):
        tensors.model_spec("nope")
    with pytest.raises(KeyError, match="its outputs are: output_ids, finish_reason"):
        tensors.PD.output("text_output")
    arr = pbutils.to_array(tensors.LLM.input("stop"), ["a", "é"])
    assert arr.dtype == object and arr.tolist() == [b"a", "é".encode()]
    ids = pbutils.to_array(tensors.PD.output("output_ids"), 7)
    assert ids.dtype == np.int32 and ids.shape == (1,)


def test_error_codes_follow_error_types() -> None:
    from rngd_pd import errors

    assert pbutils.error_code(errors.ContextLengthError("x")) == "INVALID_ARG"
    assert pbutils.error_code(errors.TransportTimeoutError("x")) == "INTERNAL"
    assert pbutils.error_code(errors.CapacityError("x")) == "UNAVAILABLE"
    msg = pbutils.error_message(errors.TransportIntegrityError("crc mismatch via tcp", key="k1"))
    assert msg == "TransportIntegrityError: [request k1] crc mismatch via tcp"
    with pytest.raises(RuntimeError, match="only importable inside a Triton"):
        pbutils.pb()


def test_check_config_catches_drift(tmp_path) -> None:
    good = tmp_path / "pd.pbtxt"
    good.write_text(config_pbtxt(tensors.PD))
    assert tensors.check_config(tensors.load_config(good)) == []
    bad = tmp_path / "bad.pbtxt"
    bad.write_text(config_pbtxt(tensors.PD).replace('"output_ids" data_type: TYPE_INT32',
                                                    '"output_ids" data_type: TYPE_INT64')
                   .replace("decoupled: true", "decoupled: false").replace('"seed"', '"sed"'))
    problems = tensors.check_config(tensors.load_config(bad))
    assert any("output 'output_ids' is INT64, not INT32" in p for p in problems)
    assert any("decoupled is False" in p for p in problems)
    assert any("input 'seed' is missing" in p for p in problems)
    assert any("input 'sed' is not in rngd_pd.wire.tensors" in p for p in problems)


def test_check_config_ensemble_maps(tmp_path) -> None:
    text = config_pbtxt(tensors.LLM).replace('backend: "python"', 'platform: "ensemble"')
    text += """ensemble_scheduling { step [
      { model_name: "preprocess" model_version: -1
        input_map { key: "text_input" value: "text_input" } output_map { key: "input_ids" value: "ids" } },
      { model_name: "pd" model_version: -1
        input_map { key: "input_idz" value: "ids" } output_map { key: "output_ids" value: "out" } } ] }
"""
    text = text.replace("instance_group [ { count: 1 kind: KIND_CPU } ]\n", "")
    path = tmp_path / "llm.pbtxt"
    path.write_text(text)
    problems = tensors.check_config(tensors.load_config(path))
    assert problems == ["llm/config.pbtxt: step pd maps unknown input 'input_idz'"]
