"""What the OpenAI front end adds over calling Triton's gRPC stream directly (goal: under 1 ms per token).

    .venv/bin/python bench/frontend_overhead.py [--triton-url HOST:PORT] [--triton-model colocated]
                                                [--max-tokens 64] [--reps 5] [--json]

The same greedy request (same token ids) is streamed alternately (a) straight to Triton with the
front end's own gRPC client (`rngd_pd.frontend.backend.TritonBackend`) and (b) through a front end
process (`rngd-pd frontend`) over HTTP/SSE. Per path: TTFT, mean time per token after the first, end
to end. The overhead per token is the difference of the medians. Because the engine's step time and the
scheduling of a second process are noisy on a shared CPU, two steadier figures are reported too:
the front end's own latency histograms (request arrival -> Triton request sent; a token's arrival
from Triton -> its SSE chunk written), and its CPU time per streamed token (from /proc, all threads).
Without --triton-url a tritonserver with the repository's models is started (cpu config, shm).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Write a long story about a robot who learns to paint. Once upon a time,"
DEPENDENCIES = {"pd": ["pd", "prefill", "decode"], "colocated": ["colocated"]}


@contextlib.contextmanager
def triton(model: str) -> Iterator[str]:
    """A tritonserver serving `model` (and what it calls); yields its gRPC url."""
    from rngd_pd.serve.server import ServerConfig, TritonServer

    repo = Path(tempfile.mkdtemp(prefix="rngd-pd-fe-bench-"))
    shm = tempfile.mkdtemp(
        prefix="rngd-pd-fe-bench-shm-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
    )
    for name in DEPENDENCIES[model]:
        (repo / name).symlink_to(ROOT / "model_repository" / name, target_is_directory=True)
    cfg = ServerConfig(
        repo,
        "cpu",
        http_port=0,
        grpc_port=0,
        metrics_port=0,
        env={"AIRM_KV_TRANSPORT": "shm", "PD_SHM_ROOT": shm},
    )
    server = TritonServer(cfg, log=repo / "tritonserver.log")
    try:
        server.start()
        server.wait_ready(300)
        yield server.grpc_url
    finally:
        server.stop()
        shutil.rmtree(repo, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


@contextlib.contextmanager
def frontend(triton_url: str, model: str) -> Iterator[tuple[str, int]]:
    """A `rngd-pd frontend` process; yields (base url, pid) once /health answers 200."""
    import httpx

    from rngd_pd.serve.server import free_port

    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "rngd_pd.cli",
        "frontend",
        "--triton-url",
        triton_url,
        "--port",
        str(port),
        "--triton-model",
        model,
    ]
    proc = subprocess.Popen(cmd, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the front end exited with code {proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("the front end did not become healthy within 120 s")
            time.sleep(0.5)
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def histogram_totals(url: str) -> dict[str, float]:
    """{name_sum / name_count: value} of the front end's own latency histograms (from /metrics)."""
    import httpx

    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith(
            ("rngd_pd_frontend_preprocess_seconds_", "rngd_pd_frontend_token_latency_seconds_")
        ):
            out[name] = float(value)
    return out


def _mean_ms(after: dict[str, float], before: dict[str, float], name: str) -> float | None:
    n = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
    total = after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)
    return round(1000 * total / n, 4) if n else None


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all threads (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timing(start: float, stamps: list[float], tokens: int) -> dict[str, float]:
    return {
        "ttft_ms": 1000 * (stamps[0] - start),
        "e2e_ms": 1000 * (stamps[-1] - start),
        "tpot_ms": 1000 * (stamps[-1] - stamps[0]) / max(tokens - 1, 1),
        "tokens": tokens,
    }


async def direct(triton_url: str, model: str, ids: list[int], max_tokens: int) -> dict[str, float]:
    """One request straight to Triton with the front end's gRPC client."""
    from rngd_pd.frontend.backend import GenerateRequest, TritonBackend
    from rngd_pd.model.sampling import SamplingParams

    backend = TritonBackend(triton_url, model)
    try:
        req = GenerateRequest("bench-direct", ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        start, stamps, tokens = time.perf_counter(), [], 0
        async for chunk in backend.generate(req):
            if chunk.token_ids:
                stamps.append(time.perf_counter())
                tokens += len(chunk.token_ids)
        return timing(start, stamps, tokens)
    finally:
        await backend.close()


async def via_http(url: str, ids: list[int], max_tokens: int) -> dict[str, float]:
    """The same request through the front end (SSE), timing each text chunk."""
    import httpx

    body = {
        "model": await _model(url),
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start, stamps, tokens = time.perf_counter(), [], 0
        async with client.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if obj["choices"] and obj["choices"][0]["text"]:
                    stamps.append(time.perf_counter())
                if obj.get("usage"):
                    tokens = obj["usage"]["completion_tokens"]
    return timing(start, stamps, tokens)


async def _model(url: str) -> str:
    import httpx

    async with httpx.AsyncClient(base_url=url) as client:
        return (await client.get("/v1/models")).json()["data"][0]["id"]


def measure(args: argparse.Namespace, triton_url: str) -> dict[str, Any]:
    from rngd_pd.frontend.config import FrontendConfig
    from rngd_pd.frontend.served_model import load_served_model

    ids = load_served_model(FrontendConfig()).tokenizer.encode(PROMPT)
    runs: dict[str, list[dict[str, float]]] = {"direct": [], "frontend": []}
    with frontend(triton_url, args.triton_model) as (url, pid):
        asyncio.run(via_http(url, ids, 4))  # warm both paths
        asyncio.run(direct(triton_url, args.triton_model, ids, 4))
        inside_before = histogram_totals(url)
        cpu = direct_cpu = 0.0
        for _ in range(args.reps):
            before = time.process_time()
            runs["direct"].append(asyncio.run(direct(triton_url, args.triton_model, ids, args.max_tokens)))
            direct_cpu += time.process_time() - before
            before = cpu_seconds(pid)
            runs["frontend"].append(asyncio.run(via_http(url, ids, args.max_tokens)))
            cpu += cpu_seconds(pid) - before
        inside = histogram_totals(url)
    tokens = sum(r["tokens"] for r in runs["frontend"])
    direct_tokens = sum(r["tokens"] for r in runs["direct"])
    med = {
        path: {k: statistics.median(r[k] for r in rs) for k in ("ttft_ms", "tpot_ms", "e2e_ms", "tokens")}
        for path, rs in runs.items()
    }
    return {
        "type": "frontend_overhead",
        "triton_model": args.triton_model,
        "max_tokens": args.max_tokens,
        "reps": args.reps,
        "direct": med["direct"],
        "frontend": med["frontend"],
        "overhead_ttft_ms": round(med["frontend"]["ttft_ms"] - med["direct"]["ttft_ms"], 3),
        "overhead_per_token_ms": round(med["frontend"]["tpot_ms"] - med["direct"]["tpot_ms"], 3),
        "frontend_cpu_ms_per_token": round(1000 * cpu / max(tokens, 1), 3),
        "direct_client_cpu_ms_per_token": round(1000 * direct_cpu / max(direct_tokens, 1), 3),
        "inside_preprocess_ms": _mean_ms(inside, inside_before, "rngd_pd_frontend_preprocess_seconds"),
        "inside_token_latency_ms": _mean_ms(inside, inside_before, "rngd_pd_frontend_token_latency_seconds"),
    }


def table(row: dict[str, Any]) -> str:
    lines = [f"{'path':<10} {'TTFT ms':>9} {'per token ms':>13} {'e2e ms':>9} {'tokens':>7}"]
    for path in ("direct", "frontend"):
        r = row[path]
        lines.append(
            f"{path:<10} {r['ttft_ms']:>9.2f} {r['tpot_ms']:>13.3f} {r['e2e_ms']:>9.1f} {r['tokens']:>7.0f}"
        )
    lines.append(
        f"overhead: TTFT {row['overhead_ttft_ms']:+.2f} ms, per token {row['overhead_per_token_ms']:+.3f} ms"
    )
    lines.append(
        f"measured inside the front end (mean): request arrival -> Triton request sent "
        f"{row['inside_preprocess_ms']} ms; token from Triton -> SSE chunk written "
        f"{row['inside_token_latency_ms']} ms"
    )
    lines.append(
        f"CPU per token: front end process {row['frontend_cpu_ms_per_token']:.3f} ms (goal < 1 ms), "
        f"direct gRPC client {row['direct_client_cpu_ms_per_token']:.3f} ms"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--triton-url", default=None, help="a running Triton's gRPC HOST:PORT (default: start one)"
    )
    ap.add_argument("--triton-model", choices=sorted(DEPENDENCIES), default="colocated")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    with contextlib.ExitStack() as stack:
        url = args.triton_url or stack.enter_context(triton(args.triton_model))
        row = measure(args, url)
    print(json.dumps(row) if args.json else table(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
