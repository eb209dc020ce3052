"""Two ways to reach a model for the orchestrator: BLS inside this tritonserver, tritonclient gRPC outside.

Both satisfy `rngd_pd.triton.orchestrator.ModelClient` and turn an error response back into our own
exception type (`errors.from_wire`), so pd's error names the transport whichever way it came.

Triton 2.51 facts this leans on: `exec(decoupled=True)` blocks until the first response arrives (so the
orchestrator drives decode from its own thread), async BLS is unsupported in decoupled models, and a
BLS stream cannot be cancelled by its caller.

One more, found the hard way (a stub crash under concurrent streams: `double free`, "Reference count
error ... dtype 17 (O)"): when a BLS stream ends, the stub's stub-to-parent thread drops its reference
to the response iterator *without holding the GIL*. If that is the last reference, the iterator's
responses and their numpy arrays are freed there, racing every Python thread. So a finished iterator is
kept alive (`RETIRED`) until a later blocking round trip through the same FIFO queue (`fenced`, around
the request's `is_cancelled`) proves the stub has let go of it; the last reference then drops here,
on a thread that holds the GIL.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from rngd_pd import errors
from rngd_pd.triton import pbutils

STREAM_TIMEOUT_S = 600.0  # no response from a remote decode for this long fails the request


class RetiredIterators:
    """Finished BLS response iterators, held until the stub's cleanup thread is certainly past them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[Any] = []
        self._times: list[float] = []  # when each was retired (monotonic), oldest first
        self._last = 0.0  # when the newest one was retired

    def retire(self, iterator: Any) -> None:
        with self._lock:
            self._items.append(iterator)
            self._last = time.monotonic()
            self._times.append(self._last)

    def drop_settled(self, settle_s: float = 1.0) -> int:
        """Drop those retired more than `settle_s` ago, when no request is left to fence with (the
        sender calls it while idle). Held on, they kept Triton from unloading pd after traffic: it
        waits for pd's BLS requests, which the iterators keep alive. Returns how many were dropped."""
        cutoff = time.monotonic() - settle_s
        with self._lock:
            n = sum(1 for t in self._times if t <= cutoff)
            items, self._items, self._times = self._items[:n], self._items[n:], self._times[n:]
        del items
        return n

    def drain(self, settle_s: float = 1.0) -> None:
        """Drop them all from `finalize`: no request is left to fence with, so wait until the newest
        is `settle_s` old (its cleanup went out long before). Left to interpreter exit instead, their
        teardown hung the stub's unload."""
        with self._lock:
            wait = self._last + settle_s - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        with self._lock:
            items, self._items, self._times = self._items, [], []
        del items

    def fenced(self, probe: Callable[[], Any]) -> Any:
        """Run `probe` (a blocking stub-to-parent round trip such as `request.is_cancelled`), then drop
        the iterators retired before it: the stub's queue is FIFO, so their cleanup has run."""
        with self._lock:
            items, times, self._items, self._times = self._items, self._times, [], []
        try:
            return probe()
        except BaseException:
            with self._lock:  # not proven: keep them for the next fence
                self._items[:0], self._times[:0] = items, times
            raise

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


RETIRED = RetiredIterators()


class BlsClient:
    """Models of the same tritonserver, by Business Logic Scripting (use from a request thread)."""

    def _request(self, model: str, inputs: Mapping[str, np.ndarray], outputs: tuple[str, ...]) -> Any:
        pb = pbutils.pb()
        tensors = [pb.Tensor(name, array) for name, array in inputs.items()]
        return pb.InferenceRequest(model_name=model, inputs=tensors, requested_output_names=list(outputs))

    @staticmethod
    def _outputs(response: Any) -> dict[str, np.ndarray]:
        """The response's tensors as arrays of our own (copies of a few ids per response), so nothing
        pd keeps for later references a tensor the stub owns (see the module docstring)."""
        if response.has_error():
            raise errors.from_wire(response.error().message())
        return {t.name(): np.array(t.as_numpy(), copy=True) for t in response.output_tensors()}

    def infer(self, model: str, inputs: Mapping[str, np.ndarray],
              outputs: tuple[str, ...]) -> dict[str, np.ndarray]:
        return self._outputs(self._request(model, inputs, outputs).exec())

    def stream(self, model: str, inputs: Mapping[str, np.ndarray],
               outputs: tuple[str, ...]) -> Iterator[dict[str, np.ndarray]]:
        responses = self._request(model, inputs, outputs).exec(decoupled=True)
        try:
            for response in responses:
                result = self._outputs(response)
                if result:  # the empty final response only closes the stream
                    yield result
        finally:
            RETIRED.retire(responses)  # see the module docstring: never the last reference to drop


class GrpcClient:
    """Models of another tritonserver at `url` (host:port of its gRPC endpoint)."""

    def __init__(self, url: str) -> None:
        import tritonclient.grpc as grpcclient

        self.url = url
        self._grpc = grpcclient
        self._client = grpcclient.InferenceServerClient(url)  # unary calls share one channel

    def _inputs(self, inputs: Mapping[str, np.ndarray]) -> list[Any]:
        out = []
        for name, array in inputs.items():
            dtype = "BYTES" if array.dtype == np.object_ else self._grpc.np_to_triton_dtype(array.dtype)
            tensor = self._grpc.InferInput(name, list(array.shape), dtype)
            tensor.set_data_from_numpy(array)
            out.append(tensor)
        return out

    def _fail(self, exc: Exception) -> errors.RngdPdError:
        message = exc.message() if hasattr(exc, "message") else str(exc)
        err = errors.from_wire(message or str(exc))
        if type(err) is errors.RngdPdError:
            err = errors.RngdPdError(f"{self.url}: {message}")
        return err

    def infer(self, model: str, inputs: Mapping[str, np.ndarray],
              outputs: tuple[str, ...]) -> dict[str, np.ndarray]:
        wanted = [self._grpc.InferRequestedOutput(name) for name in outputs]
        try:
            result = self._client.infer(model, self._inputs(inputs), outputs=wanted)
        except Exception as exc:
            raise self._fail(exc) from exc
        return {name: result.as_numpy(name) for name in outputs if result.as_numpy(name) is not None}

    def stream(self, model: str, inputs: Mapping[str, np.ndarray],
               outputs: tuple[str, ...]) -> Iterator[dict[str, np.ndarray]]:
        # one stream per request: a gRPC stream has one callback, and requests end independently
        client = self._grpc.InferenceServerClient(self.url)
        responses: queue.SimpleQueue = queue.SimpleQueue()
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        finished = False
        try:
            client.async_stream_infer(model, self._inputs(inputs), enable_empty_final_response=True,
                                      outputs=[self._grpc.InferRequestedOutput(n) for n in outputs])
            while True:
                try:
                    result, error = responses.get(timeout=STREAM_TIMEOUT_S)
                except queue.Empty:
                    raise errors.RngdPdError(f"{self.url}: {model} sent nothing for "
                                             f"{STREAM_TIMEOUT_S:.0f} s") from None
                if error is not None:
                    raise self._fail(error)
                values = {n: result.as_numpy(n) for n in outputs if result.as_numpy(n) is not None}
                finished = result.get_response().parameters["triton_final_response"].bool_param
                if values:
                    yield values
                if finished:
                    return
        finally:
            # after the final response, half-close and let the server end the stream: cancelling it
            # there leaks the request in Triton 2.51 and pins the model (rngd_pd.frontend.backend)
            client.stop_stream(cancel_requests=not finished)
            client.close()

    def close(self) -> None:
        self._client.close()
