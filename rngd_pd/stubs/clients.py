"""Two ways to reach a model for the orchestrator: BLS inside this tritonserver, or gRPC to a
tritonserver's endpoint (another server's, or this one's own: `local_grpc_url`).

Both satisfy `rngd_pd.engine.orchestrator.ModelClient` and turn an error response back into our own
exception type (`errors.from_wire`), so pd's error names the transport whichever way it came.

Triton 2.51 facts this leans on: `exec(decoupled=True)` blocks until the first response arrives (so the
orchestrator drives decode from its own thread), async BLS is unsupported in decoupled models, and a
BLS stream cannot be cancelled by its caller. Concurrent decoupled BLS streams can also deadlock the
stub (rngd_pd.stubs.pd_model), which is why pd reaches decode by gRPC even in its own server.

When a BLS stream ends, 2.51's stub drops its reference to the response iterator without holding the
GIL, so that reference must never be the last: a finished iterator is kept (`RETIRED`) until a later
blocking round trip through the same FIFO queue (`fenced`, around the request's `is_cancelled`) proves
the stub has let go of it, and the last reference then drops on a thread that holds the GIL (the crash
this prevents: docs/serving.md, "A finished BLS stream is freed without the GIL").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2_grpc

from rngd_pd import errors
from rngd_pd.stubs import pbutils
from rngd_pd.wire import grpc_codec

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


def _flag(argv: list[str], name: str) -> str | None:
    """The value of tritonserver's `--name=value` or `--name value` (the last one given)."""
    value = None
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{name}="):
            value = arg.split("=", 1)[1]
        elif arg == f"--{name}" and i + 1 < len(argv):
            value = argv[i + 1]
    return value


def local_grpc_url(argv: list[str] | None = None) -> tuple[str | None, str]:
    """Where this stub's own tritonserver serves gRPC, read from its command line (the stub's parent):
    (host:port, why) or (None, why not). A wildcard address is reached on the loopback."""
    if argv is None:
        try:
            argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode().split("\0")
        except OSError as exc:
            return None, f"cannot read tritonserver's command line ({exc})"
    if not argv or not Path(argv[0]).name.startswith("tritonserver"):
        return None, f"the stub's parent is not tritonserver ({argv[0] if argv else '?'})"
    if (_flag(argv, "allow-grpc") or "true").lower() in ("false", "off", "0"):
        return None, "tritonserver runs with --allow-grpc=false"
    if (_flag(argv, "grpc-use-ssl") or "false").lower() in ("true", "on", "1"):
        return None, "tritonserver's gRPC endpoint uses TLS"
    port = _flag(argv, "grpc-port") or "8001"
    host = _flag(argv, "grpc-address") or "0.0.0.0"
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1"}.get(host, host)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}", f"tritonserver's --grpc-address/--grpc-port ({host}:{port})"


class _LoopThread:
    """One asyncio loop on one thread for every gRPC stream of this process: a stream costs a
    coroutine, not a thread (tritonclient's streaming client starts a thread per stream)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="rngd-pd-grpc", daemon=True).start()
                self._loop = loop
            return self._loop

    def submit(self, coro: Any) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop())


LOOP = _LoopThread()


class GrpcClient:
    """Models of a tritonserver at `url` (host:port of its gRPC endpoint): another one, or this
    same server (pd reaches its local decode this way, see `rngd_pd.stubs.pd_model`)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._grpc = grpcclient
        self._client = grpcclient.InferenceServerClient(url)  # unary calls share one channel
        self._channel: Any = None  # grpc.aio, made on LOOP's thread: one channel for every stream
        self._stub: Any = None

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
        return self._error(message or str(exc))

    def _error(self, message: str) -> errors.RngdPdError:
        err = errors.from_wire(message)
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

    def _stream_stub(self) -> Any:
        if self._stub is None:  # on LOOP's thread: a grpc.aio channel belongs to its loop

            self._channel = grpc.aio.insecure_channel(self.url, options=grpc_codec.CHANNEL_OPTIONS)
            self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        return self._stub

    async def _read(self, request: Any, items: queue.SimpleQueue) -> None:
        """One stream's responses into `items`: ("out", arrays, final) ..., or ("err", message)."""
        try:
            call = self._stream_stub().ModelStreamInfer(grpc_codec.once(request))
        except Exception as exc:  # e.g. a malformed address: the reader must hear of it at once
            items.put(("err", f"cannot open a gRPC stream: {type(exc).__name__}: {exc}"))
            return
        done = False
        try:
            async for response in call:
                if response.error_message:
                    done = True
                    items.put(("err", response.error_message))
                    return
                final = grpc_codec.is_final(response.infer_response)
                done = done or final
                items.put(("out", grpc_codec.output_arrays(response.infer_response), final))
                if final:
                    return
            done = True
            items.put(("err", "the server closed the stream before the final response"))
        except grpc.aio.AioRpcError as exc:
            done = True
            items.put(("err", f"gRPC {exc.code().name}: {exc.details()}"))
        except Exception as exc:  # a response this client cannot read
            done = True
            items.put(("err", f"{type(exc).__name__}: {exc}"))
        finally:
            await grpc_codec.finish(call, done)

    def stream(self, model: str, inputs: Mapping[str, np.ndarray],
               outputs: tuple[str, ...]) -> Iterator[dict[str, np.ndarray]]:
        items: queue.SimpleQueue = queue.SimpleQueue()
        reader = LOOP.submit(self._read(grpc_codec.stream_request(model, inputs, outputs), items))
        try:
            while True:
                try:
                    item = items.get(timeout=STREAM_TIMEOUT_S)
                except queue.Empty:
                    raise errors.RngdPdError(f"{self.url}: {model} sent nothing for "
                                             f"{STREAM_TIMEOUT_S:.0f} s") from None
                if item[0] == "err":
                    raise self._error(item[1])
                _, values, final = item
                if values:
                    yield values
                if final:
                    return
        finally:
            reader.cancel()  # a stream left early is cancelled there; a finished one ends by itself

    def close(self) -> None:
        self._client.close()
        if self._channel is not None:
            channel, self._channel, self._stub = self._channel, None, None
            try:
                LOOP.submit(channel.close()).result(timeout=5)
            except Exception:  # closing at shutdown; the process is going
                pass
