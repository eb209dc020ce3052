"""What disaggregation costs: TTFT and TPOT of `pd` vs `colocated` on the same tritonserver vs the bare
engine (in this process, no Triton), per KV transport, and how much of the KV transfer the overlap hides.

    .venv/bin/python bench/pd_overhead.py [--transports shm,tcp,nixl-ucx] [--prompt-len 256]
                                          [--max-tokens 32] [--requests 5] [--json]

For each transport it starts a relay when the transport needs one, then a tritonserver with prefill,
decode, pd and colocated (cpu config), and streams prompts sequentially through both models: unique
random ids of --prompt-len tokens each, so no request reuses another's prefix (prefix cache). The bare
engine is the in-process ColocatedEngine set up as served (a share of 1 thread, idle cores lent).
tpot_vs_bare is issue 13's single-stream figure (goal: at most 1.15). `--pd-bls` adds `pd_bls`, pd
reaching decode by BLS instead of this server's gRPC endpoint (decode_via), in the same run.

Requests to the two layouts alternate, so a load that drifts during the run hits both alike.

* ttft: client-side time to the first token; gap2: first -> second token; tpot: mean time per token
  after the second (decode steady state).
* pd puts the first token on the wire as soon as prefill returns it, so the hand-off shows up in gap2:
  handoff = gap2(pd) - gap2(colocated) (the KV wait decode could not hide + decode's admission).
* xfer: the same KV (2 x layers blobs of the prompt) pushed then pulled through the transport from this
  process with no overlap; hidden = 1 - handoff / xfer (clamped to [0, 1]).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RELAY_TRANSPORTS = ("tcp", "nixl-ucx")


def stream_times(url: str, model: str, ids: list[int], max_tokens: int) -> list[float]:
    """Arrival times (seconds after sending) of each streamed token of one request."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    responses: queue.SimpleQueue = queue.SimpleQueue()
    client.start_stream(callback=lambda result, error: responses.put((time.perf_counter(), result, error)))
    inputs = []
    values = {"input_ids": np.array(ids, np.int32), "max_tokens": np.array([max_tokens], np.int32),
              "stream": np.array([True])}
    for name, array in values.items():
        t = grpcclient.InferInput(name, list(array.shape), grpcclient.np_to_triton_dtype(array.dtype))
        t.set_data_from_numpy(array)
        inputs.append(t)
    times: list[float] = []
    try:
        t0 = time.perf_counter()
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        while True:
            at, result, error = responses.get(timeout=300)
            if error is not None:
                raise RuntimeError(f"{model}: {error}")
            out = result.as_numpy("output_ids")
            times += [at - t0] * (0 if out is None else out.size)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return times
    finally:
        client.stop_stream()
        client.close()


def summarize(runs: list[list[float]]) -> dict[str, float]:
    """Median ttft, first->second gap and steady-state tpot (ms) over runs of token arrival times."""
    ttft = [r[0] for r in runs]
    gap2 = [r[1] - r[0] for r in runs if len(r) > 1]
    tpot = [(r[-1] - r[1]) / (len(r) - 2) for r in runs if len(r) > 2]
    med = lambda xs: statistics.median(xs) * 1e3 if xs else float("nan")  # noqa: E731
    return {"ttft_ms": med(ttft), "gap2_ms": med(gap2), "tpot_ms": med(tpot)}


def bare_engine(loaded: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """The same measurement on the in-process ColocatedEngine (no Triton, no transfer), set up as
    the served models are: a share of 1 torch thread, idle cores lent when `share_cores` is on for the
    served models too, no prefix cache."""
    from rngd_pd.devices.torch_runtime import as_runtime
    from rngd_pd.engine.colocated import ColocatedEngine
    from rngd_pd.model.sampling import SamplingParams

    runtime = as_runtime(loaded)
    if served_share_cores():
        print(f"bare engine cores: {runtime.share_cores('both')}", file=sys.stderr)
    runs = []
    try:
        with ColocatedEngine(runtime, num_slots=1, max_len=2048) as engine:
            for ids in prompts:
                t0, times = time.perf_counter(), []
                for ev in engine.stream(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True)):
                    if ev.token_id is not None:
                        times.append(time.perf_counter() - t0)
                runs.append(times)
    finally:
        if runtime.cores is not None:
            runtime.cores.close()
    return summarize(runs[1:])


def served_share_cores() -> bool:
    """The served models' `share_cores`, parsed as they parse it ($RNGD_PD_PARAM_SHARE_CORES, else
    the parameter's default)."""
    from rngd_pd.config.params import ServingParams
    from rngd_pd.config.settings import parse_params

    return parse_params(ServingParams, {}).share_cores


def unique_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """n prompts of `length` random token ids: no two share a prefix block, so no prefix cache hits."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def transfer_ms(transport_name: str, loaded: Any, prompt_len: int, repeats: int = 3) -> float:
    """Push then pull one request's KV (bf16) through the transport, no overlap; median ms."""
    import torch

    from rngd_pd.kv import load_transport

    c = loaded.config
    blob = torch.randn(c.num_kv_heads, prompt_len, c.head_dim).to(torch.bfloat16)
    out = torch.empty_like(blob)
    transport = load_transport(transport_name)
    samples = []
    try:
        for r in range(repeats + 1):
            key = f"bench-xfer-{os.getpid()}-{r}"
            t0 = time.perf_counter()
            for i in range(2 * c.num_layers):
                transport.push(key, i, blob)
            for i in range(2 * c.num_layers):
                transport.pull(key, i, out, timeout=30)
            samples.append(time.perf_counter() - t0)
            transport.release(key)
    finally:
        transport.close()
    return statistics.median(samples[1:]) * 1e3


def model_copy(repo: Path, model: str, name: str, **params: str) -> None:
    """A copy of `model` named `name` in `repo` (same model.py; config.pbtxt and every configs/*.pbtxt)
    with some parameters set: an existing one changed, a missing one added."""
    import re

    src = ROOT / "model_repository" / model
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").symlink_to(src / "1" / "model.py")
    for config in [src / "config.pbtxt", *sorted((src / "configs").glob("*.pbtxt"))]:
        text = config.read_text().replace(f'name: "{model}"', f'name: "{name}"')
        for key, value in params.items():
            line = f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}'
            pattern = rf'parameters {{ key: "{key}" value: {{ string_value: "[^"]*" }} }}'
            text, n = re.subn(pattern, line, text)
            text += "" if n else line + "\n"
        out = repo / name / config.relative_to(src)
        out.parent.mkdir(exist_ok=True)
        out.write_text(text)


def measure_transport(name: str, loaded: Any, ids: list[int], args: argparse.Namespace,
                      bare: dict[str, float]) -> list[dict[str, Any]]:
    from rngd_pd.kv.relay.proc import start_relay
    from rngd_pd.serve.server import ServerConfig, TritonServer

    with contextlib.ExitStack() as stack:
        env = {"AIRM_KV_TRANSPORT": name, "AIRM_KV_UCX_POOL_MB": "256", "UCX_MODULES": "^ib"}
        if name == "shm":
            env["PD_SHM_ROOT"] = stack.enter_context(tempfile.TemporaryDirectory(dir="/dev/shm"))
        if name in RELAY_TRANSPORTS:
            env["AIRM_KV_TCP_ADDR"] = stack.enter_context(start_relay()).addr
        os.environ.update(env)  # this process measures the bare transfer with the same settings
        repo = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rngd-pd-bench-")))
        for model in ("prefill", "decode", "pd", "colocated"):
            (repo / model).symlink_to(ROOT / "model_repository" / model, target_is_directory=True)
        if args.pd_bls:
            model_copy(repo, "pd", "pd_bls", decode_via="bls")
        cfg = ServerConfig(repo, "cpu", http_port=0, grpc_port=0, metrics_port=0, env=env)
        server = stack.enter_context(TritonServer(cfg, log=repo / "tritonserver.log"))
        server.wait_ready(600)
        layouts = ("colocated", "pd", "pd_bls") if args.pd_bls else ("colocated", "pd")
        runs: dict[str, list[list[float]]] = {m: [] for m in layouts}
        prompts = iter(unique_prompts(len(runs) * (args.requests + 1), len(ids), loaded.config.vocab_size, 1))
        for _ in range(args.requests + 1):  # alternate, so drifting load hits both layouts alike
            for model, times in runs.items():
                times.append(stream_times(server.grpc_url, model, next(prompts), args.max_tokens))
        rows = [{"transport": name, "layout": m, **summarize(r[1:])} for m, r in runs.items()]
        xfer = transfer_ms(name, loaded, len(ids))
    handoff = rows[1]["gap2_ms"] - rows[0]["gap2_ms"]
    rows[1].update(handoff_ms=handoff, xfer_ms=xfer, hidden=min(1.0, max(0.0, 1 - max(handoff, 0) / xfer)))
    for row in rows:
        row.update(ttft_vs_bare_ms=row["ttft_ms"] - bare["ttft_ms"],
                   tpot_vs_bare=row["tpot_ms"] / bare["tpot_ms"])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transports", default="shm,tcp,nixl-ucx")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--requests", type=int, default=5, help="measured requests per layout (+1 warm-up)")
    parser.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    parser.add_argument("--pd-bls", action="store_true",
                        help="also `pd_bls`: pd reaching decode by BLS (decode_via=bls), its former path")
    args = parser.parse_args(argv)

    from rngd_pd.config.env import RNGD_PD_DTYPE
    from rngd_pd.devices.cpu_features import choose_compute_dtype
    from rngd_pd.model import load_model

    # the bare engine computes in the dtype the served models use: $RNGD_PD_DTYPE, else auto resolved
    # the way the models resolve it (bf16 where this CPU has native bf16, else fp32)
    choice = choose_compute_dtype(RNGD_PD_DTYPE.raw(), source=f"${RNGD_PD_DTYPE.name}")
    print(f"compute dtype {choice.dtype} ({choice.reason})", file=sys.stderr)
    import torch

    torch.set_num_threads(1)  # the served models' share (the cpu config's torch_threads)
    loaded = load_model(None, dtype=choice.torch_dtype, progress=False)
    ids = unique_prompts(1, args.prompt_len, loaded.config.vocab_size, 0)[0]  # the transfer's size
    prompts = unique_prompts(args.requests + 1, args.prompt_len, loaded.config.vocab_size, 2)
    bare = {"transport": "-", "layout": "bare engine", **bare_engine(loaded, prompts, args.max_tokens)}
    rows = [bare]
    for name in [t for t in args.transports.split(",") if t]:
        try:
            rows += measure_transport(name, loaded, ids, args, bare)
        except Exception as exc:  # one transport failing (e.g. no NIXL) must not hide the others
            rows.append({"transport": name, "layout": "error", "error": str(exc)[:200]})
    if args.json:
        for row in rows:
            print(json.dumps({"prompt_len": args.prompt_len, "max_tokens": args.max_tokens, **row}))
        return 0
    cols = ("transport", "layout", "ttft_ms", "gap2_ms", "tpot_ms", "ttft_vs_bare_ms", "tpot_vs_bare",
            "handoff_ms", "xfer_ms", "hidden")
    print(f"prompt {args.prompt_len} tokens, {args.max_tokens} output tokens, median of {args.requests}")
    print(" | ".join(f"{c:>15}" for c in cols))
    for row in rows:
        cells = [row.get(c, row.get("error", "") if c == "ttft_ms" else "") for c in cols]
        print(" | ".join(f"{v:>15.2f}" if isinstance(v, float) else f"{v!s:>15}" for v in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
