"""A decoupled model that fans one request out into many concurrent streams to `echo`, the load under
which Triton 2.51's stub deadlocks on decoupled BLS (rngd_pd.stubs.pd_model's docstring).

Inputs `threads`, `loops`, `tokens`, `spin`: `threads` threads each open `loops` streams of `tokens`
tokens one after another, through `via` (parameter: bls, or grpc to this server's own endpoint, as pd
reaches decode), while `spin` threads keep the GIL busy (which widens the race's window). Answers
`count`, the streams that ended with every token.
"""

from __future__ import annotations

import json
import threading

import numpy as np

from rngd_pd.stubs import pbutils
from rngd_pd.stubs.clients import BlsClient, GrpcClient, local_grpc_url
from rngd_pd.wire.tensors import ModelSpec, TensorSpec

SPEC = ModelSpec("fan", (TensorSpec("threads", "INT32", (1,)), TensorSpec("loops", "INT32", (1,)),
                         TensorSpec("tokens", "INT32", (1,)), TensorSpec("spin", "INT32", (1,))),
                 (TensorSpec("count", "INT32", (1,)),),
                 decoupled=True)


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        via = json.loads(args["model_config"])["parameters"]["via"]["string_value"]
        url, why = local_grpc_url()
        if via == "grpc" and url is None:
            raise RuntimeError(f"fan: no gRPC endpoint of this server: {why}")
        self.client = GrpcClient(url) if via == "grpc" else BlsClient()

    def execute(self, requests: list) -> None:
        for request in requests:
            threading.Thread(target=self._run, args=(request,), daemon=True).start()

    def _streams(self, loops: int, tokens: int, done: list) -> None:
        ids = np.arange(1, tokens + 1, dtype=np.int32)
        for _ in range(loops):
            got = sum(len(r["output_ids"]) for r in self.client.stream("echo", {"input_ids": ids},
                                                                        ("output_ids",)))
            done.append(got == tokens)

    def _run(self, request) -> None:
        sender = request.get_response_sender()
        try:
            names = ("threads", "loops", "tokens", "spin")
            n = {name: pbutils.input_scalar(request, name, 0) for name in names}
            done: list = []
            stop: list = []

            def busy() -> None:
                while not stop:
                    sum(range(1000))

            workers = [threading.Thread(target=self._streams, args=(n["loops"], n["tokens"], done))
                       for _ in range(n["threads"])]
            spinners = [threading.Thread(target=busy) for _ in range(n["spin"])]
            for t in spinners + workers:
                t.start()
            for t in workers:
                t.join()
            stop.append(True)
            for t in spinners:
                t.join()
            outputs = {"count": np.array([sum(done)], dtype=np.int32)}
            pbutils.send(sender, pbutils.make_response(SPEC, outputs, ("count",)), final=True)
        except Exception as exc:
            pbutils.send_error(sender, exc)
