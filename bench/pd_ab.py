"""A/B of two serving features on the same host in one run: prefix reuse and conditional disaggregation.

    .venv/bin/python bench/pd_ab.py prefix [--prefix-tokens 1024 --unique-tokens 64 --requests 12]
    .venv/bin/python bench/pd_ab.py local  [--trace bench/traces/mixed.csv --passes 2]
    add --json FILE to write the rows, --png FILE for a plot

Two tritonservers (prefill, decode, pd; cpu config; shm) run side by side, identical but for the
feature: A has it off, B on. Both get the same requests (unique random token ids, greedy, EOS ignored,
streaming, by tritonclient gRPC to `pd`), and the tokens each returns must be equal.

* prefix: a shared prefix (a system prompt) + a unique tail per request, sent one at a time to A then
  B (alternating, so a drifting host load hits both alike); A has `prefix_cache_mb=0`. Judged: TTFT p50
  with reuse at least 3x lower (issue 13). B's first request fills the cache and is left out of both.
* local: the mixed-length trace (bench/traces, Azure format) replayed by its arrival times, to A then
  B, `passes` times; A hands every prompt off (`local_prefill_tokens=0`), B uses the threshold its decode
  measured at load; the prefix cache is off on both. Judged: TTFT p50 of the short requests (those B
  prefilled locally) lower, TPOT p99 of the rest not higher.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import random
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.traces.azure import MIXED_CSV, read_trace  # noqa: E402


@dataclass
class Result:
    """One request's client-side timings (seconds) and tokens."""

    server: str
    index: int
    prompt_tokens: int
    ttft_s: float
    tpot_s: float
    tokens: list[int]


def stream(url: str, ids: Sequence[int], max_tokens: int) -> tuple[list[float], list[int]]:
    """Arrival times (s after sending) and ids of one greedy streaming `pd` request, EOS ignored."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    responses: queue.SimpleQueue = queue.SimpleQueue()
    client.start_stream(callback=lambda result, error: responses.put((time.perf_counter(), result, error)))
    values = {"input_ids": np.array(ids, np.int32), "max_tokens": np.array([max_tokens], np.int32),
              "stream": np.array([True]), "ignore_eos": np.array([True])}
    inputs = []
    for name, array in values.items():
        t = grpcclient.InferInput(name, list(array.shape), grpcclient.np_to_triton_dtype(array.dtype))
        t.set_data_from_numpy(array)
        inputs.append(t)
    times: list[float] = []
    tokens: list[int] = []
    try:
        t0 = time.perf_counter()
        client.async_stream_infer("pd", inputs, enable_empty_final_response=True,
                                  outputs=[grpcclient.InferRequestedOutput("output_ids")])
        while True:
            at, result, error = responses.get(timeout=600)
            if error is not None:
                raise RuntimeError(f"pd: {error}")
            out = result.as_numpy("output_ids")
            if out is not None and out.size:
                times += [at - t0] * out.size
                tokens += [int(i) for i in out.reshape(-1)]
            if result.get_response().parameters["triton_final_response"].bool_param:
                return times, tokens
    finally:
        client.stop_stream()
        client.close()


def result(server: str, index: int, ids: Sequence[int], max_tokens: int, url: str) -> Result:
    times, tokens = stream(url, ids, max_tokens)
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    return Result(server, index, len(ids), times[0], tpot, tokens)


@contextlib.contextmanager
def servers(configs: dict[str, dict[str, str]]) -> Iterator[dict[str, Any]]:
    """{name: ready TritonServer} (prefill, decode, pd; cpu config; shm), one per config (its extra
    environment), all stopped on exit. bench/profile_stubs.py uses it too."""
    from rngd_pd.serve.server import ServerConfig, TritonServer

    with contextlib.ExitStack() as stack:
        repo = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rngd-pd-ab-")))
        for model in ("prefill", "decode", "pd"):
            (repo / model).symlink_to(ROOT / "model_repository" / model, target_is_directory=True)
        started = {}
        for name, extra in configs.items():
            shm = stack.enter_context(tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm")
                                                                  else None))
            env = {"AIRM_KV_TRANSPORT": "shm", "PD_SHM_ROOT": shm, **extra}
            cfg = ServerConfig(repo, "cpu", http_port=0, grpc_port=0, metrics_port=0, env=env)
            started[name] = stack.enter_context(TritonServer(cfg, log=repo.parent / f"rngd-pd-ab-{name}.log"))
        for name, server in started.items():
            print(f"waiting for server {name} ...", file=sys.stderr, flush=True)
            server.wait_ready(900)
        yield started


def local_threshold(url: str) -> int:
    """What decode of that server answers to `describe` (its local prefill length)."""
    from rngd_pd.testing.e2e import stream_infer

    got = stream_infer(url, "decode", {"request_key": np.array([b"ab"], dtype=np.object_),
                                       "describe": np.array([True])}, ("local_prefill_tokens",))
    return int(got[-1]["local_prefill_tokens"][0])


def p(values: Sequence[float], q: float) -> float:
    from rngd_pd.wire.airm_metrics import percentile

    return percentile(values, q)


def run_prefix(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    prefix = [rng.randrange(1000, 40000) for _ in range(args.prefix_tokens)]
    prompts = [prefix + [rng.randrange(1000, 40000) for _ in range(args.unique_tokens)]
               for _ in range(args.requests + 1)]
    configs = {"A": {"RNGD_PD_PARAM_PREFIX_CACHE_MB": "0"}, "B": {}}
    results: list[Result] = []
    with servers(configs) as started:
        for i, ids in enumerate(prompts):
            for name, server in started.items():
                results.append(result(name, i, ids, args.max_tokens, server.grpc_url))
                print(f"  request {i} {name}: ttft {results[-1].ttft_s * 1e3:.0f} ms", file=sys.stderr)
    measured = [r for r in results if r.index > 0]
    ttft = {n: p([r.ttft_s for r in measured if r.server == n], 50) for n in configs}
    same = all(a.tokens == b.tokens for a, b in zip(results[::2], results[1::2], strict=True))
    return {"experiment": "prefix", "prefix_tokens": args.prefix_tokens, "unique_tokens": args.unique_tokens,
            "requests": args.requests, "ttft_p50_ms_without": ttft["A"] * 1e3,
            "ttft_p50_ms_with": ttft["B"] * 1e3,
            "speedup": ttft["A"] / ttft["B"], "target": 3.0, "tokens_identical": same,
            "ok": same and ttft["A"] / ttft["B"] >= 3.0, "rows": [asdict(r) for r in results]}


def replay(url: str, name: str, rows: Sequence, prompts: Sequence[list[int]], out: list[Result]) -> None:
    """Each trace row's request at its arrival offset, each on its own thread."""
    lock = threading.Lock()
    threads = []
    t0 = time.monotonic()

    def one(i: int) -> None:
        r = result(name, i, prompts[i], rows[i].generated_tokens, url)
        with lock:
            out.append(r)

    for i, row in enumerate(rows):
        time.sleep(max(0.0, t0 + row.t - time.monotonic()))
        threads.append(threading.Thread(target=one, args=(i,)))
        threads[-1].start()
    for t in threads:
        t.join(timeout=900)


def run_local(args: argparse.Namespace) -> dict:
    rows = read_trace(args.trace, args.requests or None)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(1000, 40000) for _ in range(r.context_tokens)] for r in rows]
    knob = "RNGD_PD_PARAM_LOCAL_PREFILL_TOKENS"
    # The prefix cache off on both: the passes repeat the same prompts, and a prompt served partly from
    # the cache is computed in other chunks (other bf16 rounding) than the first time, which would blur
    # both the TTFTs and the token comparison; only the feature differs between A and B.
    no_cache = {"RNGD_PD_PARAM_PREFIX_CACHE_MB": "0"}
    configs = {"A": {knob: "0", **no_cache}, "B": {knob: "-1", **no_cache}}
    results: list[Result] = []
    with servers(configs) as started:
        threshold = local_threshold(started["B"].grpc_url)
        print(f"server B prefills prompts up to {threshold} tokens on decode", file=sys.stderr)
        for k in range(args.passes):
            for name, server in started.items():
                print(f"pass {k + 1}/{args.passes}: replaying {len(rows)} requests to {name}",
                      file=sys.stderr)
                replay(server.grpc_url, name, rows, prompts, results)
    short = lambda r: r.prompt_tokens <= threshold  # noqa: E731
    out: dict = {"experiment": "local", "threshold_tokens": threshold, "requests": len(rows),
                 "passes": args.passes, "short_requests": sum(1 for pr in prompts if len(pr) <= threshold)}
    for name in configs:
        mine = [r for r in results if r.server == name]
        out[f"{name}_short_ttft_p50_ms"] = p([r.ttft_s for r in mine if short(r)], 50) * 1e3
        out[f"{name}_rest_tpot_p99_ms"] = p([r.tpot_s for r in mine if not short(r)], 99) * 1e3
        out[f"{name}_all_ttft_p50_ms"] = p([r.ttft_s for r in mine], 50) * 1e3
    by = {(r.server, r.index): r.tokens for r in results}
    out["tokens_identical"] = all(by[("A", i)] == by[("B", i)] for i in range(len(rows)))
    out["ok"] = (out["tokens_identical"] and out["B_short_ttft_p50_ms"] < out["A_short_ttft_p50_ms"]
                 and out["B_rest_tpot_p99_ms"] <= out["A_rest_tpot_p99_ms"] * 1.05)
    out["rows"] = [asdict(r) for r in results]
    return out


def machine() -> str:
    """The host the figures come from: CPU model, native bf16 or not, cores, load at the end."""
    from rngd_pd.devices.cpu_features import read_cpu_features

    cpu = read_cpu_features()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{cpu.model or cpu.arch} ({cpu.native_bf16 or cpu.simd}), {os.cpu_count()} cores, "
            f"load {load:.1f}")


def table(out: dict) -> str:
    if out["experiment"] == "prefix":
        return "\n".join([
            f"prefix reuse: {out['prefix_tokens']}-token shared prefix + {out['unique_tokens']} unique "
            f"tokens, {out['requests']} requests one at a time",
            f"  TTFT p50 without reuse  {out['ttft_p50_ms_without']:8.1f} ms",
            f"  TTFT p50 with reuse     {out['ttft_p50_ms_with']:8.1f} ms",
            f"  speedup                 {out['speedup']:8.2f}x (target >= {out['target']:.0f}x)",
            f"  tokens identical        {out['tokens_identical']}",
            f"  {'OK' if out['ok'] else 'MISSED'}"])
    return "\n".join([
        f"conditional disaggregation: {out['requests']} trace requests x {out['passes']} passes, "
        f"local prefill up to {out['threshold_tokens']} tokens ({out['short_requests']} short requests)",
        f"  {'':24} {'always hand off':>16} {'conditional':>12}",
        f"  {'short TTFT p50 (ms)':24} {out['A_short_ttft_p50_ms']:16.1f} {out['B_short_ttft_p50_ms']:12.1f}",
        f"  {'rest TPOT p99 (ms)':24} {out['A_rest_tpot_p99_ms']:16.1f} {out['B_rest_tpot_p99_ms']:12.1f}",
        f"  {'all TTFT p50 (ms)':24} {out['A_all_ttft_p50_ms']:16.1f} {out['B_all_ttft_p50_ms']:12.1f}",
        f"  tokens identical: {out['tokens_identical']}   {'OK' if out['ok'] else 'MISSED'}"])


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    rows = out["rows"]
    x = "index" if out["experiment"] == "prefix" else "prompt_tokens"  # prefix: all prompts one length
    for name, label in (("A", "off"), ("B", "on")):
        mine = [r for r in rows if r["server"] == name]
        style = "o" if x == "prompt_tokens" else "o-"
        ax.plot([r[x] for r in mine], [r["ttft_s"] * 1e3 for r in mine], style, label=label, ms=4)
    ax.set_xlabel("request (0 fills the cache)" if x == "index" else "prompt tokens")
    ax.set_ylabel("TTFT (ms)")
    ax.set_yscale("log")
    ax.set_title(f"{out['experiment']}: TTFT per request, feature off vs on")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment", choices=["prefix", "local"])
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--unique-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16, help="prefix: output tokens per request")
    parser.add_argument("--requests", type=int, default=0, help="prefix: requests (default 12); local: "
                                                                   "first N trace rows (default all)")
    parser.add_argument("--trace", type=Path, default=MIXED_CSV)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--png", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.experiment == "prefix":
        args.requests = args.requests or 12
        out = run_prefix(args)
    else:
        out = run_local(args)
    out["machine"] = machine()
    print(f"machine: {out['machine']}")
    print(table(out))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    if args.png:
        plot(out, args.png)
    return 0 if out["ok"] else 1


def replot(json_path: Path, png: Path) -> None:
    """The plot of a run written with --json (python -c 'from bench.pd_ab import replot; ...')."""
    plot(json.loads(json_path.read_text()), png)


if __name__ == "__main__":
    raise SystemExit(main())
