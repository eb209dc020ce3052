"""Shared pieces of the e2e tests and the benches of the model repository (real tritonserver, real
transports): gRPC and HTTP clients, request inputs, reference generations, repository subsets.

Reference tokens come from the in-process ColocatedEngine on the same embedded model (itself checked
against the Hugging Face oracle by the model/engine tests), loaded once per test session.
"""

from __future__ import annotations

import atexit
import functools
import json
import queue
import shutil
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient

from rngd_pd.engine.colocated import ColocatedEngine
from rngd_pd.model.sampling import SamplingParams
from rngd_pd.model.weights import LoadedModel, load_model

ROOT = Path(__file__).resolve().parents[2]
REPOSITORY = ROOT / "model_repository"
PROMPTS = (
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three colors of the rainbow:",
    "Bonjour, comment ça va? Réponds en français, avec des accents: é, è, à.",
)
MAX_TOKENS = 12


def subset_repository(names: Iterable[str]) -> Path:
    """A repository holding only `names` (symlinks to model_repository/<name>); faster to load."""
    root = Path(tempfile.mkdtemp(prefix="rngd-pd-repo-"))
    atexit.register(shutil.rmtree, root, True)  # symlinks only; removed when the test session ends
    for name in names:
        (root / name).symlink_to(REPOSITORY / name, target_is_directory=True)
    return root


@functools.cache
def loaded_model() -> LoadedModel:
    return load_model(None, progress=False)


def prompt_ids(text: str) -> list[int]:
    return loaded_model().tokenizer.encode(text)


@functools.cache
def reference(text: str, max_tokens: int = MAX_TOKENS) -> tuple[tuple[int, ...], str, str]:
    """(token ids, text, finish reason) of greedy generation by the in-process ColocatedEngine."""
    with ColocatedEngine(loaded_model(), num_slots=1, max_len=512) as engine:
        result = engine.generate(prompt_ids(text), SamplingParams(max_tokens=max_tokens))
    ids = tuple(result.token_ids)
    return ids, loaded_model().tokenizer.decode(ids), result.finish_reason


def grpc_inputs(values: Mapping[str, Any]) -> list[Any]:
    """tritonclient.grpc InferInputs from {name: numpy array}."""
    out = []
    for name, array in values.items():
        dtype = "BYTES" if array.dtype == np.object_ else grpcclient.np_to_triton_dtype(array.dtype)
        tensor = grpcclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        out.append(tensor)
    return out


def llm_inputs(text: str, max_tokens: int = MAX_TOKENS, stream: bool = True, **extra: Any) -> dict:
    return {"text_input": np.array([text.encode()], dtype=np.object_),
            "max_tokens": np.array([max_tokens], np.int32), "stream": np.array([stream]), **extra}


def pd_inputs(ids: list[int], max_tokens: int = MAX_TOKENS, stream: bool = True, **extra: Any) -> dict:
    return {"input_ids": np.array(ids, np.int32), "max_tokens": np.array([max_tokens], np.int32),
            "stream": np.array([stream]), **extra}


def stream_infer(url: str, model: str, values: Mapping[str, Any], outputs: tuple[str, ...],
                 cancel_after: int | None = None, timeout: float = 120.0,
                 parameters: Mapping[str, Any] | None = None) -> list[dict]:
    """Responses of one gRPC streaming request as dicts; an error response raises RuntimeError.

    cancel_after=n stops the stream (cancelling the request) after n responses; `parameters` are the
    request's parameters. A finished stream is closed, not cancelled: Triton 2.51 keeps the request
    of a stream cancelled after its final response, and the model can then never unload
    (rngd_pd.frontend.backend).
    """
    client = grpcclient.InferenceServerClient(url)
    responses: queue.SimpleQueue = queue.SimpleQueue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    got: list[dict] = []
    final = False
    try:
        client.async_stream_infer(model, grpc_inputs(values), enable_empty_final_response=True,
                                  outputs=[grpcclient.InferRequestedOutput(n) for n in outputs],
                                  parameters=dict(parameters) if parameters else None)
        while cancel_after is None or len(got) < cancel_after:
            result, error = responses.get(timeout=timeout)
            if error is not None:
                raise RuntimeError(str(error))
            values_ = {n: result.as_numpy(n) for n in outputs if result.as_numpy(n) is not None}
            if values_:
                got.append(values_)
            if result.get_response().parameters["triton_final_response"].bool_param:
                final = True
                break
    finally:
        client.stop_stream(cancel_requests=not final)
        client.close()
    return got


def ids_of(responses: list[dict]) -> list[int]:
    return [int(i) for r in responses for i in r["output_ids"].reshape(-1)]


def text_of(responses: list[dict]) -> str:
    return "".join(r["text_output"].reshape(-1)[0].decode("utf-8") for r in responses)


def reason_of(responses: list[dict]) -> str:
    return responses[-1]["finish_reason"].reshape(-1)[0].decode()


def http_post(url: str, path: str, body: dict, timeout: float = 120.0) -> tuple[int, str]:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def sse_events(body: str) -> list[dict]:
    """The JSON objects of a generate_stream body (`data: {...}` lines)."""
    return [json.loads(line[5:]) for line in body.splitlines() if line.startswith("data:")]


def assert_kv_bytes_match(log: Path) -> int:
    """Every request that decode fully received has, blob by blob, the bytes prefill produced.

    Reads the RNGD_PD_KV_DEBUG_LOG lines both sides wrote; returns how many requests were compared.
    """
    num_blobs = 2 * loaded_model().config.num_layers
    by_key: dict[str, dict[str, dict[int, tuple[int, int]]]] = {}
    for line in log.read_text().splitlines():
        r = json.loads(line)
        if r["index"] < num_blobs:
            by_key.setdefault(r["key"], {}).setdefault(r["side"], {})[r["index"]] = (r["nbytes"], r["crc32c"])
    complete = [k for k, sides in by_key.items() if len(sides.get("decode", {})) == num_blobs]
    assert complete, "no request logged all its blobs on the decode side"
    for key in complete:
        assert by_key[key]["prefill"] == by_key[key]["decode"], key
    return len(complete)


def stub_pid(server_pid: int, model: str) -> int:
    """The pid of `model`'s Python stub among the children of the tritonserver `server_pid`."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(ln.split(":\t", 1) for ln in status.read_text().splitlines() if ":\t" in ln)
            cmdline = (status.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if (int(fields.get("PPid", "0").strip()) == server_pid and b"triton_python_backend_stub" in cmdline
                and f"/{model}/1/model.py".encode() in cmdline):
            found.append(int(status.parent.name))
    assert len(found) == 1, f"expected one {model} stub under tritonserver {server_pid}, found {found}"
    return found[0]


def thread_count(pid: int) -> int:
    """Threads of process `pid` (from /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(ln for ln in status.splitlines() if ln.startswith("Threads:")).split()[1])
