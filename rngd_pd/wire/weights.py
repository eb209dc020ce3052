"""Weight operations on the wire: the request that carries one (to pd, prefill or decode) and the
clients of `rngd-pd apply-delta` and the front end's `/update_weights_from_disk`.

An operation is a JSON object in the `weights_op` input; the answer is a JSON object in
`weights_state` (tensors.WEIGHTS_OP / WEIGHTS_STATE). The other required inputs of the model are
sent with placeholder values and ignored. Over HTTP it goes through Triton's generate extension
(`POST /v2/models/pd/generate`): a weight operation has exactly one response, which that endpoint
accepts from a decoupled model. Torch-free: the front end imports it.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import numpy as np

from rngd_pd import errors
from rngd_pd.wire import tensors as T

DRAIN_S = 120.0  # how long running requests may take to finish before an update gives up (pd)

# the required inputs of each model that takes weight operations, with placeholder values
_PLACEHOLDERS: dict[str, dict[str, Any]] = {
    "pd": {T.INPUT_IDS: [0], T.MAX_TOKENS: [1]},
    "prefill": {T.REQUEST_KEY: ["weights"], T.INPUT_IDS: [0]},
    "decode": {T.REQUEST_KEY: ["weights"]},
}


def op_inputs(model: str, op: dict[str, Any]) -> dict[str, np.ndarray]:
    """The inputs of a request to `model` (pd, prefill, decode) that carries weight operation `op`."""
    out = {T.WEIGHTS_OP: np.array([json.dumps(op).encode()], dtype=np.object_)}
    for name, value in _PLACEHOLDERS[model].items():
        dtype = T.model_spec(model).input(name).numpy_dtype
        out[name] = np.array([v.encode() if isinstance(v, str) else v for v in value], dtype=dtype)
    return out


def state_of(outputs: dict[str, Any]) -> dict[str, Any]:
    """The JSON answer in a response's weights_state output (a numpy array, or the generate
    extension's decoded JSON value)."""
    raw = outputs[T.WEIGHTS_STATE]
    if isinstance(raw, np.ndarray):
        raw = raw.reshape(-1)[0]
    if isinstance(raw, list):
        raw = raw[0]
    return json.loads(raw.decode() if isinstance(raw, bytes) else raw)


def generate_body(model: str, op: dict[str, Any]) -> dict[str, Any]:
    """The JSON body of Triton's generate extension for a weight operation."""
    body: dict[str, Any] = {T.WEIGHTS_OP: json.dumps(op)}
    for name, value in _PLACEHOLDERS[model].items():
        body[name] = value
    return body


def call(url: str, op: dict[str, Any], model: str = "pd", timeout_s: float = 600.0) -> dict[str, Any]:
    """Run weight operation `op` on `model` of the tritonserver at `url` (HTTP host:port)."""
    base = url if url.startswith("http") else f"http://{url}"
    request = urllib.request.Request(f"{base}/v2/models/{model}/generate",
                                     data=json.dumps(generate_body(model, op)).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return state_of(json.loads(resp.read()))
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        try:
            detail = json.loads(detail).get("error", detail)
        except ValueError:
            pass
        raise errors.from_wire(detail) from None
    except (urllib.error.URLError, OSError) as exc:
        raise errors.RngdPdError(f"{base}: {exc}") from None


def apply_delta(url: str, checkpoint: str, drain_s: float = DRAIN_S,
                timeout_s: float = 600.0) -> dict[str, Any]:
    """Update the weights the server at `url` serves to checkpoint directory `checkpoint` (readable
    on the server's host); only the tensors whose content changed are read. Returns pd's report."""
    return call(url, {"op": "apply_delta", "checkpoint": checkpoint, "drain_s": drain_s}, timeout_s=timeout_s)
