"""A stand-in for `pd` that fails mid-stream, for testing what the llm ensemble does with that.

Streaming, it sends its first TOKENS input ids back as pd would (context ids, stop, error ""), then fails the
request with a TransportError the way pd does: in band when the caller asked (errors_in_band, as the
llm ensemble's preprocess does), else as an error response. The failure itself is the point: a real
pd fails mid-stream only when a transfer or a stub breaks, which no test can time deterministically.
"""

from __future__ import annotations

import threading

from rngd_pd import errors
from rngd_pd.model.params import FinishReason
from rngd_pd.stubs import pbutils
from rngd_pd.wire import tensors as T

TOKENS = 2


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        pass

    def execute(self, requests: list) -> None:
        for request in requests:
            threading.Thread(target=self._one, args=(request,), daemon=True).start()

    def _one(self, request) -> None:
        sender = request.get_response_sender()
        wanted = pbutils.requested_outputs(request)
        streaming = pbutils.input_scalar(request, T.STREAM, False)
        ids = pbutils.input_ids(request, T.INPUT_IDS)[:TOKENS] if streaming else []
        for i, token in enumerate(ids):
            outputs = {T.OUTPUT_IDS: [token], T.FINISH_REASON: "", T.CONTEXT_IDS: ids[:i], T.STOP: [],
                       T.ERROR: ""}
            pbutils.send(sender, pbutils.make_response(T.PD, outputs, wanted))
        exc = errors.TransportError("KV transport 'tcp' failed to pull blob 3: connection reset", key="k1")
        if pbutils.input_scalar(request, T.ERRORS_IN_BAND, False):
            outputs = {T.OUTPUT_IDS: [], T.FINISH_REASON: FinishReason.ERROR, T.CONTEXT_IDS: [], T.STOP: [],
                       T.ERROR: errors.to_wire(exc)}
            pbutils.send(sender, pbutils.make_response(T.PD, outputs, wanted), final=True)
        else:
            pbutils.send_error(sender, exc)
