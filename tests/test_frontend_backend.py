"""TritonBackend's pieces without a server: request protobufs, response parsing, error mapping."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from tritonclient.grpc import service_pb2
from tritonclient.utils import deserialize_bytes_tensor

from rngd_pd.frontend import backend as B
from rngd_pd.frontend.api_errors import APIError
from rngd_pd.model.sampling import SamplingParams

PD_INPUTS = {
    "input_ids": "INT32",
    "max_tokens": "INT32",
    "stream": "BOOL",
    "temperature": "FP32",
    "top_p": "FP32",
    "top_k": "INT32",
    "seed": "UINT64",
    "stop": "BYTES",
}


def _inputs(req: service_pb2.ModelInferRequest) -> dict[str, tuple[list[int], str, bytes]]:
    return {
        t.name: (list(t.shape), t.datatype, raw)
        for t, raw in zip(req.inputs, req.raw_input_contents, strict=True)
    }


def test_request_carries_ids_sampling_and_stop_strings():
    params = SamplingParams(
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=3, seed=2**63 + 5, stop=("END", "é!")
    )
    req = B._build_request("pd", B.GenerateRequest("r1", [5, 6, 7], params), B._ModelInfo(PD_INPUTS, False))
    got = _inputs(req)
    assert req.model_name == "pd" and req.id == "r1"
    assert req.parameters["triton_enable_empty_final_response"].bool_param
    assert np.frombuffer(got["input_ids"][2], np.int32).tolist() == [5, 6, 7] and got["input_ids"][0] == [3]
    assert np.frombuffer(got["max_tokens"][2], np.int32).tolist() == [7]
    assert np.frombuffer(got["stream"][2], np.bool_).tolist() == [True]
    assert np.frombuffer(got["temperature"][2], np.float32)[0] == pytest.approx(0.5)
    assert np.frombuffer(got["seed"][2], np.uint64).tolist() == [2**63 + 5]
    assert [s.decode() for s in deserialize_bytes_tensor(got["stop"][2])] == ["END", "é!"]


def test_request_follows_the_model_metadata():
    info = B._ModelInfo({"input_ids": "INT64", "max_tokens": "INT32"}, batched=True)
    req = B._build_request("m", B.GenerateRequest("r", [1, 2], SamplingParams(stop=("x",), seed=1)), info)
    got = _inputs(req)
    assert set(got) == {"input_ids", "max_tokens"}  # undeclared optional inputs are not sent
    assert got["input_ids"][:2] == ([1, 2], "INT64") and got["max_tokens"][0] == [1, 1]
    with pytest.raises(APIError) as err:
        B._build_request("m", B.GenerateRequest("r", [1], SamplingParams(ignore_eos=True)), info)
    assert err.value.status == 400 and err.value.param == "ignore_eos"
    with_eos = B._ModelInfo({**PD_INPUTS, "ignore_eos": "BOOL"}, False)
    req = B._build_request("m", B.GenerateRequest("r", [1], SamplingParams(ignore_eos=True)), with_eos)
    assert np.frombuffer(_inputs(req)["ignore_eos"][2], np.bool_).tolist() == [True]


def _response(ids: list[int], reason: str, final: bool) -> service_pb2.ModelInferResponse:
    resp = service_pb2.ModelInferResponse()
    resp.outputs.add(name="output_ids", datatype="INT32", shape=[len(ids)])
    resp.raw_output_contents.append(np.asarray(ids, np.int32).tobytes())
    resp.outputs.add(name="finish_reason", datatype="BYTES", shape=[1])
    resp.raw_output_contents.append(struct.pack("<I", len(reason)) + reason.encode())
    resp.parameters["triton_final_response"].bool_param = final
    return resp


def test_parse_tokens_reason_and_final_flag():
    assert B._parse(_response([4, 5], "", False)) == (B.TokenChunk((4, 5), None), False)
    assert B._parse(_response([], "length", True)) == (B.TokenChunk((), "length"), True)
    assert B._parse(service_pb2.ModelInferResponse()) == (B.TokenChunk((), None), False)


@pytest.mark.parametrize(
    ("message", "status"),
    [
        ("ContextLengthError: prompt of 3000 tokens + max_tokens 8 exceeds the context of 2048", 400),
        ("ConfigError: temperature must be >= 0", 400),
        ("CapacityError: decode queue is full (64)", 503),
        ("TransportTimeoutError: blob 0 did not arrive within 60 s", 502),
    ],
)
def test_model_errors_map_to_statuses(message, status):
    err = B._model_error(message, "pd")
    assert err.status == status and message in err.message
