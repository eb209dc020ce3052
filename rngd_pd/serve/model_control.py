"""Variant swap: reload one model of a running tritonserver with changed parameters (Triton's
model-control `load` with a config override), and the time to the first token after it.

Not Triton's side-by-side reload: in Triton 2.51 the new instances of a reloaded Python model share
its custom metrics (the airm_* families) with the old ones, and when the old ones unload they destroy
them under the new ones (server issue #8663; here tritonserver died with SIGSEGV / SIGABRT right after
every reloaded decode came up, with and without requests in flight; reloading under requests is a
second known crash, #7723). So the swap holds pd's gate (`hold`, rngd_pd.engine.switch: requests in
flight finish on the old variant, new ones wait), unloads the model, loads it with the override and
releases the gate: no request fails, and new requests wait for the unload and the load. Requests sent
to the model without pd are not held. The
new instance maps the weights from the host's weight store (rngd_pd.model.store: the generation
serving now, after a partial update too) instead of reading the checkpoint, so it is ready in the time
its own state takes (packed decode weights, KV slots). The server must run with
`--model-control-mode=explicit` (`rngd-pd serve` does).

Torch-free (HTTP to Triton's endpoints).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Any

from rngd_pd.errors import RngdPdError
from rngd_pd.wire import weights
from rngd_pd.wire.weights import DRAIN_S

PROBE_IDS = [1, 504, 3458, 282, 4649, 314]  # a short prompt (any ids below the vocabulary size)


@dataclass
class SwapReport:
    model: str
    params: dict[str, str]
    load_s: float = 0.0  # the load call: until Triton reports the new variant ready
    first_token_s: float | None = None  # from the command to the first decoded token on the new variant
    config: dict[str, Any] = field(default_factory=dict, repr=False)

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if k != "config"}, sort_keys=True)


def _base(url: str) -> str:
    return url if url.startswith("http") else f"http://{url}"


def _http(url: str, path: str, body: dict | None = None, timeout_s: float = 900.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    method = "GET" if body is None else "POST"
    request = urllib.request.Request(f"{_base(url)}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            text = resp.read()
            return json.loads(text) if text else {}
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        raise RngdPdError(f"{_base(url)}{path}: HTTP {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise RngdPdError(f"{_base(url)}{path}: {exc}") from None


def model_config(url: str, model: str) -> dict[str, Any]:
    """The configuration Triton serves `model` with (JSON)."""
    return _http(url, f"/v2/models/{model}/config")


def with_params(config: dict[str, Any], params: dict[str, str]) -> dict[str, Any]:
    """`config` with model parameters set (string values, as config.pbtxt's parameters)."""
    out = json.loads(json.dumps(config))
    out.setdefault("parameters", {})
    for name, value in params.items():
        out["parameters"][name] = {"string_value": str(value)}
    return out


def load(url: str, model: str, config: dict[str, Any] | None = None, timeout_s: float = 900.0) -> None:
    """Triton's model-control load (a reload when the model is loaded), with a config override."""
    body = {"parameters": {"config": json.dumps(config)}} if config is not None else {}
    _http(url, f"/v2/repository/models/{model}/load", body, timeout_s)


def unload(url: str, model: str, timeout_s: float = 600.0, poll_s: float = 0.2) -> None:
    """Triton's model-control unload, and wait until the repository index no longer lists the
    model READY (the unload call returns before its instances are gone)."""
    _http(url, f"/v2/repository/models/{model}/unload", {})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        index = _http(url, "/v2/repository/index", {})
        if not any(m.get("name") == model and m.get("state") in ("READY", "UNLOADING") for m in index):
            return
        time.sleep(poll_s)
    raise RngdPdError(f"{_base(url)}: {model} was still loaded {timeout_s:.0f} s after its unload")


def first_token(url: str, model: str = "pd", ids: list[int] | None = None, timeout_s: float = 300.0) -> float:
    """Seconds until a request through `model` has its first token from decode (2 tokens: the first
    is prefill's, the second decode's)."""
    t0 = time.monotonic()
    _http(url, f"/v2/models/{model}/generate",
          {"input_ids": ids or PROBE_IDS, "max_tokens": 2, "ignore_eos": True}, timeout_s)
    return time.monotonic() - t0


def swap(url: str, model: str, params: dict[str, str], probe: str | None = "pd", hold: str | None = "pd",
         drain_s: float = DRAIN_S) -> SwapReport:
    """Reload `model` with `params` changed; with `probe`, also the time from the start to the first
    token of a request through that model on the new variant. With `hold` (pd), pd's gate is held
    around the reload (module docstring)."""
    t0 = time.monotonic()
    config = with_params(model_config(url, model), params)
    if hold:
        weights.call(url, {"op": "hold", "drain_s": drain_s, "max_hold_s": 900.0}, model=hold)
    try:
        unload(url, model)  # not a side-by-side reload: module docstring
        load(url, model, config)
    finally:
        if hold:
            weights.call(url, {"op": "release"}, model=hold)
    report = SwapReport(model, dict(params), load_s=time.monotonic() - t0, config=config)
    if probe:
        first_token(url, probe)
        report.first_token_s = time.monotonic() - t0
    return report
