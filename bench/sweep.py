"""The sweep: PD vs colocated serving vs the peers, all driven by the same OpenAI load generator.

For each system it starts the server, runs bench/load_gen.py at each point (concurrency 1, 4, 16, 32
with 512-token prompts and 128 output tokens, then the mixed-length Azure-format trace), stops the
server, and writes JSON lines, a PNG (throughput against TPOT p99) and a table with the ratios.

    python bench/sweep.py                       # everything (long: tens of minutes on 2 cores)
    python bench/sweep.py --quick               # a couple of minutes: small prompts, 2 points
    python bench/sweep.py --systems pd,colocated --concurrency 1,16 --json

Systems: pd and colocated share one `rngd-pd serve` (the same Triton server; the front end calls model
`pd`, a second front end calls `colocated`), hf = transformers generate one request at a time,
hf-cb = transformers continuous batching, llamacpp = llama-cpp-python's server (built on first use).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(ROOT))

from bench import kpi, sweep_report  # noqa: E402
from bench.peers import llamacpp  # noqa: E402
from bench.peers.hf_server import embedded_gguf  # noqa: E402
from bench.peers.process import ServerProcess, free_port  # noqa: E402
from bench.power import open_meter  # noqa: E402
from bench.traces.azure import MIXED_CSV, mixed_trace, write_trace  # noqa: E402

ALL_SYSTEMS = ("pd", "colocated", "hf", "hf-cb", "llamacpp")
DEFAULT_SYSTEMS = ("pd", "colocated", "hf", "llamacpp")


@dataclass(frozen=True)
class Workload:
    """One point: a fixed shape at a concurrency, or a trace replayed by its timestamps."""

    name: str
    concurrency: int | None = None
    prompt_tokens: int = 512
    max_tokens: int = 128
    requests: int = 0
    trace: Path | None = None


@dataclass
class Target:
    """A running system: where to send requests and which cards it occupies."""

    system: str
    url: str
    cards: list[kpi.Card] = field(default_factory=lambda: [kpi.Card("cpu", 0)])
    model: str = ""


def grid(a: argparse.Namespace) -> list[Workload]:
    """The points to run, from the command line."""
    points = [
        Workload("fixed", c, a.prompt_tokens, a.max_tokens, max(c * a.waves, a.min_requests))
        for c in a.concurrency
    ]
    if a.trace is not None:
        points.append(Workload("mixed", None, requests=a.trace_requests, trace=a.trace))
    return points


def load_gen_argv(t: Target, w: Workload, a: argparse.Namespace) -> list[str]:
    """bench/load_gen.py's command line for one point (the only place that knows its flags)."""
    argv = [
        sys.executable,
        str(ROOT / "bench" / "load_gen.py"),
        "--url",
        t.url,
        "--json",
        "--quiet",
    ]
    if a.ignore_eos:
        argv.append("--ignore-eos")
    argv += ["--timeout", str(a.point_timeout)]
    if t.model:
        argv += ["--model", t.model]
    if w.trace is not None:
        argv += ["--trace", str(w.trace), "--requests", str(w.requests), "--trace-speed", str(a.trace_speed)]
    else:
        argv += [
            "--concurrency",
            str(w.concurrency),
            "--requests",
            str(w.requests),
            "--prompt-tokens",
            str(w.prompt_tokens),
            "--max-tokens",
            str(w.max_tokens),
        ]
    return argv


def summary_of(stdout: str) -> dict[str, Any] | None:
    """The load generator's summary: the last JSON object that carries a throughput."""
    rows = [r for r in kpi.read_rows(stdout.splitlines()) if kpi.field(r, "output_tok_s") is not None]
    return rows[-1] if rows else None


def run_point(t: Target, w: Workload, a: argparse.Namespace, cfg: Any, peak: float) -> dict[str, Any]:
    """Run load_gen for one point under the power meter; one normalised row with KPIs."""
    base = {
        "system": t.system,
        "workload": w.name,
        "concurrency": w.concurrency,
        "prompt_tokens": w.prompt_tokens if w.trace is None else None,
        "cards": ",".join(map(str, t.cards)),
    }
    meter = open_meter(t.cards)
    meter.start()
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            load_gen_argv(t, w, a), capture_output=True, text=True, timeout=a.point_timeout, check=False
        )
    except subprocess.TimeoutExpired:
        meter.stop()
        return {**base, "note": f"timed out after {a.point_timeout:.0f} s"}
    power = meter.stop()
    raw = summary_of(proc.stdout)
    if proc.returncode or raw is None:
        tail = (proc.stderr or proc.stdout)[-400:].strip().replace("\n", " | ")
        return {**base, "note": f"load_gen exited {proc.returncode}: {tail}"}
    row = sweep_report.normalise(raw, **base)
    row.update(kpi.kpis(raw, cfg, peak, power))
    row["wall_s"] = round(time.monotonic() - t0, 1)
    row["loadavg_1m"] = round(os.getloadavg()[0], 2)  # other work on the machine during the point
    row["raw"] = raw
    return row


def _model_id(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
        data = json.load(r).get("data") or [{}]
    return str(data[0].get("id", ""))


@contextmanager
def rngd_stack(systems: Sequence[str], a: argparse.Namespace, out: Path) -> Iterator[list[Target]]:
    """One `rngd-pd serve` (front end -> pd) plus, for colocated, a second front end on the same Triton."""
    http, grpc, metrics, openai = (free_port() for _ in range(4))
    serve = [
        str(ROOT / ".venv" / "bin" / "rngd-pd"),
        "serve",
        "--http-port",
        str(http),
        "--grpc-port",
        str(grpc),
        "--metrics-port",
        str(metrics),
        "--openai-port",
        str(openai),
        "--param",
        f"num_slots={a.num_slots}",
        "--ready-timeout",
        str(int(a.server_timeout)),
        *a.serve_arg,
    ]
    if a.attach:  # servers someone else started: nothing to start or stop
        urls = dict(kv.split("=", 1) for kv in a.attach.split(","))
        yield [Target(s, urls[s], kpi.parse_cards(getattr(a, f"{s}_cards"))) for s in systems if s in urls]
        return
    with ExitStack() as stack:
        stack.enter_context(
            ServerProcess(
                serve, f"http://127.0.0.1:{openai}/health", out / "serve.log", timeout=a.server_timeout + 60
            )
        )
        targets = []
        if "pd" in systems:
            targets.append(Target("pd", f"http://127.0.0.1:{openai}", kpi.parse_cards(a.pd_cards)))
        if "colocated" in systems:
            port = free_port()
            fe = [
                str(ROOT / ".venv" / "bin" / "rngd-pd"),
                "frontend",
                "--triton-url",
                f"127.0.0.1:{grpc}",
                "--port",
                str(port),
                "--triton-model",
                "colocated",
            ]
            stack.enter_context(
                ServerProcess(fe, f"http://127.0.0.1:{port}/health", out / "frontend-colocated.log")
            )
            targets.append(
                Target("colocated", f"http://127.0.0.1:{port}", kpi.parse_cards(a.colocated_cards))
            )
        yield targets


@contextmanager
def peer(system: str, a: argparse.Namespace, out: Path) -> Iterator[list[Target]]:
    """A peer server on a free port, stopped on exit."""
    port = free_port()
    gguf = embedded_gguf()
    if system in ("hf", "hf-cb"):
        argv = [
            sys.executable,
            str(ROOT / "bench" / "peers" / "hf_server.py"),
            "--port",
            str(port),
            "--dtype",
            a.hf_dtype,
            "--batching",
            "cb" if system == "hf-cb" else "serial",
        ]
        health = f"http://127.0.0.1:{port}/health"
    else:
        llamacpp.install(log=out / "llamacpp-install.log")
        argv = llamacpp.server_argv(gguf, port, alias=gguf.stem, threads=a.llamacpp_threads)
        health = f"http://127.0.0.1:{port}/v1/models"
    with ServerProcess(argv, health, out / f"{system}.log", timeout=a.server_timeout):
        yield [Target(system, f"http://127.0.0.1:{port}", kpi.parse_cards("cpu:0"))]


def run(a: argparse.Namespace) -> list[dict[str, Any]]:
    """Every system, every point; rows are appended to sweep.jsonl as they come."""
    out: Path = a.out
    out.mkdir(parents=True, exist_ok=True)
    if a.trace is not None and not a.trace.exists():
        write_trace(a.trace, mixed_trace(a.trace_requests, a.trace_rate, seed=0))
    cfg = kpi.load_model_config(None)
    peak, _ = kpi.total_peak([kpi.Card("cpu", 0)], a.peak_tflops)
    rows: list[dict[str, Any]] = []
    ours = [s for s in a.systems if s in ("pd", "colocated")]
    groups: list[tuple[str, ...]] = ([tuple(ours)] if ours else []) + [
        (s,) for s in a.systems if s not in ours
    ]
    with (out / "sweep.jsonl").open("a") as sink:
        for group in groups:
            ctx = rngd_stack(group, a, out) if group[0] in ("pd", "colocated") else peer(group[0], a, out)
            log(f"starting {'+'.join(group)}")
            try:
                with ctx as targets:
                    for t in targets:
                        t.model = _model_id(t.url)
                        for w in grid(a):
                            row = run_point(t, w, a, cfg, peak)
                            log(
                                f"{t.system:>10} {w.name:>6} c={w.concurrency}: "
                                f"{row.get('output_tok_s')} tok/s {row.get('note', '')}"
                            )
                            rows.append(row)
                            sink.write(json.dumps(row) + "\n")
                            sink.flush()
            except Exception as e:  # a system that cannot start is a row, not the end of the sweep
                log(f"{'+'.join(group)} failed: {e}")
                for s in group:
                    rows.append({"system": s, "workload": "-", "note": f"failed: {str(e)[:300]}"})
                    sink.write(json.dumps(rows[-1]) + "\n")
    return rows


def log(msg: str) -> None:
    print(f"[sweep {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help=f"any of {','.join(ALL_SYSTEMS)}")
    ap.add_argument("--concurrency", type=ints, default=[1, 4, 16, 32])
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--waves", type=int, default=2, help="requests per point = concurrency x waves")
    ap.add_argument("--min-requests", type=int, default=4)
    ap.add_argument("--trace", type=Path, default=MIXED_CSV, help="mixed-length Azure trace ('' = skip)")
    ap.add_argument("--trace-requests", type=int, default=48)
    ap.add_argument("--trace-rate", type=float, default=1.0, help="arrivals/s when the trace is written")
    ap.add_argument("--trace-speed", type=float, default=1.0, help="replay the trace this many times faster")
    ap.add_argument(
        "--quick", action="store_true", help="concurrency 1,4, prompt 128, output 32, 8 trace rows"
    )
    ap.add_argument("--num-slots", type=int, default=32, help="decode slots of pd/colocated")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `rngd-pd serve` argument")
    ap.add_argument("--pd-cards", default="cpu:0", help="cards PD uses (production: rngd:0,atom:0)")
    ap.add_argument("--colocated-cards", default="cpu:0")
    ap.add_argument("--hf-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--peak-tflops", type=float, help="peak per card (default: measure the CPU)")
    ap.add_argument("--point-timeout", type=float, default=900.0)
    ap.add_argument("--server-timeout", type=float, default=1800.0, help="seconds a server may take to start")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / time.strftime("sweep-%Y%m%d-%H%M%S"))
    ap.add_argument(
        "--llamacpp-threads", type=int, default=1, help="llama.cpp threads (see docs/benchmarks.md)"
    )
    ap.add_argument("--ignore-eos", action="store_true", help="ask every system for exactly max_tokens")
    ap.add_argument("--attach", default="", help="pd=URL,colocated=URL: use running front ends instead")
    ap.add_argument("--report-only", action="store_true", help="rewrite the report from --out/sweep.jsonl")
    ap.add_argument("--json", action="store_true", help="also print the rows as JSON lines")
    a = ap.parse_args(argv)
    a.systems = [s for s in a.systems.split(",") if s]
    unknown = sorted(set(a.systems) - set(ALL_SYSTEMS))
    if unknown:
        ap.error(f"unknown system(s) {unknown}; choose from {','.join(ALL_SYSTEMS)}")
    if str(a.trace) in ("", "."):
        a.trace = None
    if a.quick:
        a.concurrency, a.prompt_tokens, a.max_tokens, a.waves, a.trace_requests = [1, 4], 128, 32, 1, 8
    return a


def latest_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a sweep.jsonl; a later row of the same (system, workload, concurrency) replaces one before."""
    rows: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in kpi.read_rows(path.read_text().splitlines()) if path.exists() else []:
        rows[(r.get("system"), r.get("workload"), r.get("concurrency"))] = r
    return list(rows.values())


def _exit_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so every server this sweep started is stopped."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def main(argv: list[str] | None = None) -> int:
    """Run the sweep, then write the report (text), the plot (PNG) and the rows (JSON lines).

    The report covers every row in the output folder's sweep.jsonl, so runs of different systems
    into the same --out add up; --report-only rewrites the report without running anything.
    """
    a = parse_args(argv)
    _exit_on_sigterm()
    if not a.report_only:
        run(a)
    rows = latest_rows(a.out / "sweep.jsonl")
    if a.report_only and a.peak_tflops:  # one peak for every row (each run measured its own)
        for r in rows:
            if r.get("model_tflops") is not None:
                r["peak_tflops"], r["mfu"] = a.peak_tflops, r["model_tflops"] / a.peak_tflops
    measured = [r for r in rows if r.get("output_tok_s") is not None]
    text = sweep_report.report(rows) if rows else "no rows"
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "report.txt").write_text(text + "\n")
    if measured:
        sweep_report.plot(measured, a.out / "sweep.png")
    print(text)
    if a.json:
        for r in rows:
            print(json.dumps({k: v for k, v in r.items() if k != "raw"}))
    log(f"wrote {a.out}/sweep.jsonl, report.txt" + (", sweep.png" if measured else ""))
    return 0 if measured else 1


if __name__ == "__main__":
    sys.exit(main())
