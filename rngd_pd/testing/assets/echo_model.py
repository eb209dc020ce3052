"""A minimal decoupled python-backend model for the plumbing tests: streams its input ids back.

It exercises what the real models use: params (parser + env overrides), pbutils (inputs, responses,
errors), metrics (airm_* families). Not a stand-in for the real models.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass

from rngd_pd.config import params
from rngd_pd.config.env import RNGD_PD_SERVER_RESTARTS
from rngd_pd.errors import ConfigError
from rngd_pd.stubs import metrics, pbutils
from rngd_pd.wire.tensors import TOKEN_OUTPUTS, ModelSpec, TensorSpec

SPEC = ModelSpec("echo", (TensorSpec("input_ids", "INT32", (-1,)),), TOKEN_OUTPUTS, decoupled=True)


@dataclass(frozen=True)
class EchoParams(params.ServingParams):
    delay_ms: float = params.param(0.0, help="sleep before each token")
    init_delay_s: float = params.param(0.0, help="sleep in initialize (a slow model load)")
    threads: bool = params.param(False, help="stream each request from a thread of its own (Python "
                                 "threads running while another sends: what the race needs)")
    send_all_outputs: bool = params.param(False, help="put every output in each response, requested "
                                          "or not: Triton 2.51 then prunes them in C++ (the crash)")
    abort_first_start: bool = params.param(False, help="SIGABRT tritonserver while loading, at its first "
                                           "start only (what Triton's lock_exception abort looks like)")
    stall_first_start: bool = params.param(False, help="never return from execute, at the first start only: "
                                           "the stub alive and healthy, running nothing (a deadlocked stub)")


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        self.params = params.parse_params(EchoParams, args["model_config"])
        self.metrics = metrics.triton_metrics(args["model_name"])
        time.sleep(self.params.init_delay_s)
        if self.params.abort_first_start and RNGD_PD_SERVER_RESTARTS.get() == 0:
            os.kill(os.getppid(), signal.SIGABRT)
            time.sleep(30)
        pbutils.log(f"echo: {params.describe(self.params)}")

    def execute(self, requests: list) -> None:
        while self.params.stall_first_start and RNGD_PD_SERVER_RESTARTS.get() == 0:
            time.sleep(1.0)
        for request in requests:
            if self.params.threads:
                threading.Thread(target=self._one, args=(request,), daemon=True).start()
            else:
                self._one(request)

    def _one(self, request) -> None:
        sender = request.get_response_sender()
        try:
            self._stream(request, sender)
        except Exception as exc:
            pbutils.send_error(sender, exc)

    def _stream(self, request, sender) -> None:
        ids = pbutils.input_ids(request, "input_ids")
        if not ids or min(ids) < 0:
            raise ConfigError("input_ids must be a non-empty list of token ids >= 0")
        wanted = SPEC.output_names if self.params.send_all_outputs else pbutils.requested_outputs(request)
        t0 = time.monotonic()
        ttft = 0.0
        for n, token in enumerate(ids):
            time.sleep(self.params.delay_ms / 1e3)
            outputs = {"output_ids": [token], "finish_reason": ""}
            pbutils.send(sender, pbutils.make_response(SPEC, outputs, wanted))
            if n == 0:
                ttft = time.monotonic() - t0
        self.metrics.record_request(ttft, len(ids), time.monotonic() - t0)
        self.metrics.record_kv_transfer(0.002, self.params.kv_transport)
        final = {"output_ids": [], "finish_reason": "length"}
        pbutils.send(sender, pbutils.make_response(SPEC, final, wanted), final=True)

    def finalize(self) -> None:
        self.metrics.sink.close()
