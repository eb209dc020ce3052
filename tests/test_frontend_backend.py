"""TritonBackend's pieces without a server: request protobufs, response parsing, error mapping."""

from __future__ import annotations

import struct

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2
from tritonclient.utils import deserialize_bytes_tensor

from rngd_pd import errors
from rngd_pd.frontend import backend as B
from rngd_pd.frontend.api_errors import APIError, answer, from_domain_error
from rngd_pd.frontend.schemas import AssistantMessage, ChatChoice, CompletionChoice
from rngd_pd.model.params import FinishReason
from rngd_pd.model.sampling import SamplingParams
from rngd_pd.wire.inputs import sampling_inputs

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


def test_request_encodes_sampling_as_the_wire_module_does():
    """The front end and pd send the same bytes for the same SamplingParams (one encoder)."""
    params = SamplingParams(max_tokens=9, temperature=0.25, top_p=0.5, top_k=7, seed=11)
    info = B._ModelInfo({**PD_INPUTS, "ignore_eos": "BOOL"}, False)
    got = _inputs(B._build_request("pd", B.GenerateRequest("r", [1], params), info))
    for name, array in sampling_inputs(params).items():
        assert got[name][2] == array.tobytes(), name


def _rpc(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


@pytest.mark.parametrize(
    ("code", "details", "status", "kind", "says"),
    [
        (grpc.StatusCode.UNAVAILABLE, "refused", 503, "backend_unavailable", "127.0.0.1:1 is not reachable"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "", 503, "backend_unavailable", "(DEADLINE_EXCEEDED); retry"),
        (grpc.StatusCode.NOT_FOUND, "no such model", 503, "backend_unavailable", "no such model"),
        (grpc.StatusCode.INTERNAL, "unknown model 'pd'", 503, "backend_unavailable", "is not available"),
        (grpc.StatusCode.CANCELLED, "stopping", 503, None, "cancelled the request: stopping"),
        (grpc.StatusCode.INTERNAL, "boom", 502, "backend_error", "gRPC error INTERNAL: boom"),
    ],
)
def test_grpc_errors_map_to_statuses(code, details, status, kind, says):
    err = B._rpc_error(_rpc(code, details), B.TritonBackend("127.0.0.1:1", "pd"))
    assert (err.status, err.code) == (status, kind) and says in err.message


def test_one_table_answers_every_error():
    """ConfigError and its kinds 400, busy 503, any other error of ours 502 (the serving side failed),
    an exception that is not ours 500, wherever it was raised."""
    assert answer(errors.ContextLengthError).status == answer(errors.TransportConfigError).status == 400
    assert answer(errors.CapacityError("full")).status == 503
    assert answer(errors.TransportCapacityError).status == answer(errors.ModelLoadError).status == 502
    assert answer(KeyError).status == 500
    local = from_domain_error(errors.TransportError("lost"))
    remote = B._model_error("TransportError: lost", "pd")
    assert (local.status, local.type, local.code) == (remote.status, remote.type, remote.code)
    busy = from_domain_error(errors.CapacityError("decode queue is full"))
    assert busy.status == 503 and busy.message == "decode queue is full; retry later"


@pytest.mark.parametrize(
    ("reason", "openai"),
    [(FinishReason.LENGTH, "length"), (FinishReason.STOP, "stop"), (FinishReason.EOS, "stop")],
)
def test_finish_reasons_are_written_in_openai_spelling(reason, openai):
    assert reason.openai == openai
    assert f'"finish_reason":"{openai}"' in CompletionChoice(text="", finish_reason=reason).model_dump_json()
    chat = ChatChoice(message=AssistantMessage(content="x"), finish_reason=reason)
    assert chat.model_dump()["finish_reason"] == openai
    assert '"finish_reason":null' in CompletionChoice(text="", finish_reason=None).model_dump_json()
    assert B._finish_reason("") is None and B._finish_reason(str(reason)) is reason
