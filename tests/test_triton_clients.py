"""The clients pd reaches models with: RetiredIterators (a finished BLS stream is released only after a
fence proves the stub let go of it), finding this server's own gRPC endpoint, the gRPC protobufs."""

from __future__ import annotations

import gc
import time
import weakref

import numpy as np
import pytest

from rngd_pd.stubs.clients import RetiredIterators


class _Iterator:  # stands in for the stub's ResponseIterator: we only care when the last reference goes
    pass


def _retire_one(retired: RetiredIterators) -> weakref.ref:
    """Retire an iterator nobody else holds; the weak reference tells when its last reference went."""
    it = _Iterator()
    ref = weakref.ref(it)
    retired.retire(it)
    return ref


def test_a_retired_iterator_lives_until_a_fence_that_started_after_it() -> None:
    retired = RetiredIterators()
    ref = _retire_one(retired)
    gc.collect()
    assert ref() is not None and len(retired) == 1

    seen_during_probe = []

    def probe() -> bool:
        seen_during_probe.append(ref() is not None)  # still alive while the round trip runs
        return True

    assert retired.fenced(probe) is True
    gc.collect()
    assert seen_during_probe == [True]
    assert ref() is None and len(retired) == 0


def test_an_iterator_retired_during_the_probe_waits_for_the_next_fence() -> None:
    retired = RetiredIterators()
    late = [_Iterator()]
    ref = weakref.ref(late[0])

    def probe() -> bool:
        retired.retire(late.pop())  # its cleanup may be queued behind this probe: not proven yet
        return False

    assert retired.fenced(probe) is False
    gc.collect()
    assert ref() is not None and len(retired) == 1
    retired.fenced(lambda: False)
    gc.collect()
    assert ref() is None


def test_a_failed_probe_keeps_the_iterators_for_the_next_fence() -> None:
    retired = RetiredIterators()
    retired.retire(_Iterator())

    def probe() -> bool:
        raise RuntimeError("stub gone")

    with pytest.raises(RuntimeError, match="stub gone"):
        retired.fenced(probe)
    assert len(retired) == 1


def test_drain_waits_for_the_newest_to_settle_then_drops_all() -> None:
    import time

    retired = RetiredIterators()
    ref = _retire_one(retired)
    t0 = time.monotonic()
    retired.drain(settle_s=0.2)
    gc.collect()
    assert time.monotonic() - t0 >= 0.15 and ref() is None and len(retired) == 0
    t0 = time.monotonic()
    retired.drain(settle_s=0.2)  # nothing newer: no wait beyond what has passed
    assert time.monotonic() - t0 < 0.15


def test_drop_settled_lets_go_only_of_those_retired_long_enough_ago() -> None:
    retired = RetiredIterators()
    old = _retire_one(retired)
    time.sleep(0.3)
    new = _retire_one(retired)
    assert retired.drop_settled(0.2) == 1 and len(retired) == 1
    gc.collect()
    assert old() is None and new() is not None
    assert retired.fenced(lambda: None) is None and len(retired) == 0


# ---------------------------------------------------------------- this server's own gRPC endpoint


@pytest.mark.parametrize(("argv", "url"), [
    (["/opt/tritonserver/bin/tritonserver", "--model-repository=/m"], "127.0.0.1:8001"),
    (["tritonserver", "--grpc-address=127.0.0.1", "--grpc-port=39001"], "127.0.0.1:39001"),
    (["tritonserver", "--grpc-port", "9100", "--grpc-address", "10.1.2.3"], "10.1.2.3:9100"),
    (["tritonserver", "--grpc-port=1", "--grpc-port=2"], "127.0.0.1:2"),  # the last one wins
    (["tritonserver", "--grpc-address=::"], "[::1]:8001"),
    (["tritonserver", "--grpc-address=fd00::5", "--grpc-port=7"], "[fd00::5]:7"),
])
def test_the_own_grpc_endpoint_is_read_from_tritonservers_command_line(argv: list[str], url: str) -> None:
    from rngd_pd.stubs.clients import local_grpc_url

    assert local_grpc_url(argv)[0] == url


@pytest.mark.parametrize(("argv", "why"), [
    (["tritonserver", "--allow-grpc=false"], "--allow-grpc=false"),
    (["tritonserver", "--allow-grpc", "0"], "--allow-grpc=false"),
    (["tritonserver", "--grpc-use-ssl=true"], "TLS"),
    (["/usr/bin/bash", "-c", "x"], "not tritonserver"),
    ([], "not tritonserver"),
])
def test_no_usable_grpc_endpoint_says_why(argv: list[str], why: str) -> None:
    from rngd_pd.stubs.clients import local_grpc_url

    url, reason = local_grpc_url(argv)
    assert url is None and why in reason


# ---------------------------------------------------------------- the gRPC protobufs


def test_a_stream_request_carries_every_tensor_and_asks_for_the_final_response() -> None:
    from rngd_pd.wire import grpc_codec as W

    inputs = {"request_key": np.array([b"k1", b"key two"], dtype=np.object_),
              "prompt_len": np.array([7], np.int32), "temperature": np.array([0.5], np.float32),
              "cancel": np.array([True]), "seed": np.array([3], np.uint64)}
    req = W.stream_request("decode", inputs, ("output_ids", "finish_reason"), request_id="r1")
    assert req.model_name == "decode" and req.id == "r1"
    assert req.parameters["triton_enable_empty_final_response"].bool_param
    assert [o.name for o in req.outputs] == ["output_ids", "finish_reason"]
    assert [(t.name, t.datatype, list(t.shape)) for t in req.inputs] == [
        ("request_key", "BYTES", [2]), ("prompt_len", "INT32", [1]), ("temperature", "FP32", [1]),
        ("cancel", "BOOL", [1]), ("seed", "UINT64", [1])]
    assert W.unpack_bytes(req.raw_input_contents[0]) == [b"k1", b"key two"]
    assert np.frombuffer(req.raw_input_contents[1], np.int32).tolist() == [7]
    with pytest.raises(TypeError, match="no Triton datatype for numpy float16"):
        W.stream_request("decode", {"x": np.zeros(1, np.float16)})


def test_a_response_becomes_arrays_of_its_own_and_says_whether_it_is_final() -> None:
    from tritonclient.grpc import service_pb2

    from rngd_pd.wire import grpc_codec as W

    resp = service_pb2.ModelInferResponse(model_name="decode")
    ids = np.array([5, 6, 7], np.int32)
    resp.outputs.add(name="output_ids", datatype="INT32", shape=[3])
    resp.raw_output_contents.append(ids.tobytes())
    resp.outputs.add(name="finish_reason", datatype="BYTES", shape=[1])
    resp.raw_output_contents.append(W.pack_bytes(["length"]))
    assert not W.is_final(resp)
    resp.parameters["triton_final_response"].bool_param = True
    out = W.output_arrays(resp)
    assert W.is_final(resp) and out["output_ids"].tolist() == [5, 6, 7]
    assert out["output_ids"].flags.writeable  # a copy, not a view of the protobuf's bytes
    assert out["finish_reason"].dtype == np.object_ and out["finish_reason"].tolist() == [b"length"]


def test_a_stream_to_an_endpoint_nobody_serves_fails_at_once_naming_it() -> None:
    from rngd_pd import errors
    from rngd_pd.serve.server import free_port
    from rngd_pd.stubs.clients import GrpcClient

    url = f"127.0.0.1:{free_port()}"
    client = GrpcClient(url)
    t0 = time.monotonic()
    try:
        with pytest.raises(errors.RngdPdError, match=rf"{url}: gRPC UNAVAILABLE"):
            list(client.stream("decode", {"prompt_len": np.array([3], np.int32)}, ("output_ids",)))
    finally:
        client.close()
    assert time.monotonic() - t0 < 10
