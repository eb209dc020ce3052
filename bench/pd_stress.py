"""Stability under sustained concurrency: rounds of many simultaneous streams on one tritonserver.

    .venv/bin/python bench/pd_stress.py [--rounds 15] [--concurrency 24] [--max-tokens 32]
                                        [--timeout 60] [--transport shm|tcp|nixl-ucx] [--runs 1] [--json]

Each round starts `concurrency` gRPC streams at once, half to `pd` (token ids) and half to `llm`
(text), and waits for all of them. A stream fails when it errors or sends nothing for `timeout`
seconds. After the last round (or the first failed one) the server log is searched for the signs of
a crashed Python stub. Rows: per round, wall time, streams that failed and the slowest stream; then a
summary with the failure rate and what the log shows.

`--transport tcp` and `--transport nixl-ucx` start a KV relay for each run (`rngd-pd kv-relay` on a
free loopback port, through rngd_pd.kv.relay.proc) and pass its address as AIRM_KV_TCP_ADDR; the relay
is stopped with the run. `--runs N` repeats the whole thing N times, each with a fresh server (and
relay), prints one summary line per run and a total, so "20 runs of 15 rounds" is one command. The
log of a failed run is kept (`--log`, else a file in the temp directory, whose path is printed).

Both prefill paths run: `--local-prefill 6` (the default) makes decode prefill the pd streams' prompts
of up to 6 tokens itself, while the longer ones and every `llm` prompt are handed off through the
transport.

Why a benchmark and not a test: the crash this guards against (Triton 2.51's Python backend freeing
finished BLS streams without the GIL, see rngd_pd/stubs/clients.py) was rare and load-dependent;
a probabilistic check belongs where rates are measured. Measured figures are in the README.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CRASH_SIGNS = ("double free", "free(): invalid", "Reference count error", "not healthy",
               "lock_exception", "Signal (11)", "Signal (6)", "Segmentation fault")
TRANSPORTS = ("shm", "tcp", "nixl-ucx")
RELAY_TRANSPORTS = ("tcp", "nixl-ucx")
# settings the transports need on these hosts (pd_overhead uses the same); the caller's environment wins
TRANSPORT_DEFAULTS = {"AIRM_KV_UCX_POOL_MB": "256", "UCX_MODULES": "^ib"}


def one_round(url: str, prompts: list[str], ids: list[list[int]], concurrency: int, max_tokens: int,
              timeout: float) -> dict:
    from rngd_pd.testing import e2e as E

    results: list[object] = [None] * concurrency
    latency = [0.0] * concurrency

    def stream(i: int) -> None:
        t0 = time.perf_counter()
        try:
            if i % 2:
                values = E.llm_inputs(prompts[i % len(prompts)], max_tokens=max_tokens)
                model = "llm"
            else:
                values = E.pd_inputs(ids[i % len(ids)], max_tokens=max_tokens)
                model = "pd"
            results[i] = len(E.stream_infer(url, model, values, ("output_ids", "finish_reason"),
                                            timeout=timeout))
        except BaseException as exc:  # a failed stream is a measurement, not a crash of the bench
            results[i] = f"{type(exc).__name__}: {exc}"[:160]
        latency[i] = time.perf_counter() - t0

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * timeout + 30)
    failed = [r if r is not None else "no answer (stream thread still running)" for r in results
              if not isinstance(r, int)]
    return {"wall_s": round(time.perf_counter() - t0, 2), "streams": concurrency, "failed": len(failed),
            "slowest_s": round(max(latency), 2), "first_error": failed[0] if failed else ""}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--concurrency", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds without a response = failed")
    p.add_argument("--transport", choices=TRANSPORTS, default="shm",
                   help="KV transport; tcp and nixl-ucx get a relay started for each run")
    p.add_argument("--runs", type=int, default=1, help="repeat everything N times, a fresh server each run")
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    p.add_argument("--log", type=Path,
                   help="keep the tritonserver log here (with --runs > 1: NAME.runK.SUFFIX per run)")
    p.add_argument("--extra", action="append", default=[], help="extra tritonserver argument (repeatable)")
    p.add_argument("--decode-by", choices=("grpc", "bls", "url"), default="grpc",
                   help="how pd reaches decode: this server's gRPC endpoint found by pd (default, "
                        "decode_via=grpc), decoupled BLS (decode_via=bls), or the endpoint as decode_url")
    p.add_argument("--prefill-by", choices=("bls", "grpc"), default="bls",
                   help="how pd reaches prefill: BLS (default) or gRPC to this same server (prefill_url)")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the server")
    p.add_argument("--local-prefill", type=int, default=6,
                   help="prompts up to this many tokens are prefilled by decode (conditional "
                        "disaggregation); the default 6 sends 2 of the 5 pd prompts that way and hands off "
                        "the rest and every llm one, so both paths are under load; 0 = hand everything off")
    args = p.parse_args(argv)
    for name in ("rounds", "concurrency", "max_tokens", "runs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.timeout <= 0:
        p.error("--timeout must be positive")
    return args


def transport_env(transport: str, shm_root: str, relay_addr: str | None,
                  base: dict[str, str] | None = None) -> dict[str, str]:
    """The server environment for a transport; a relay transport without a relay address is an error."""
    base = os.environ if base is None else base
    env = {"AIRM_KV_TRANSPORT": transport, "PD_SHM_ROOT": shm_root}
    if transport in RELAY_TRANSPORTS:
        if not relay_addr:
            raise ValueError(f"the {transport} transport needs a relay address")
        env["AIRM_KV_TCP_ADDR"] = relay_addr
        env.update({k: base.get(k, v) for k, v in TRANSPORT_DEFAULTS.items()})
    return env


def crash_signs(text: str) -> list[str]:
    return sorted({s for s in CRASH_SIGNS if s in text})


def run_summary(run: int, rows: list[dict], text: str, error: str = "") -> dict:
    """One run's summary: rounds done, streams, failed streams, crash signs; failed when any is bad."""
    signs = crash_signs(text)
    total = sum(r["streams"] for r in rows)
    failed = sum(r["failed"] for r in rows)
    return {"summary": True, "run": run, "rounds": len(rows), "streams": total, "failed": failed,
            "failure_rate": round(failed / total, 4) if total else 0.0, "crash_signs": signs,
            "error": error, "ok": not (failed or signs or error)}


def total_summary(runs: list[dict]) -> dict:
    return {"total": True, "runs": len(runs), "runs_failed": sum(not r["ok"] for r in runs),
            "rounds": sum(r["rounds"] for r in runs), "streams": sum(r["streams"] for r in runs),
            "failed": sum(r["failed"] for r in runs),
            "crash_signs": sorted({s for r in runs for s in r["crash_signs"]}),
            "runs_with_crash_signs": sum(bool(r["crash_signs"]) for r in runs)}


def log_path(log: Path | None, run: int, runs: int) -> Path | None:
    """Where run `run`'s log is kept when the user asked for one (one file per run when runs > 1)."""
    if log is None or runs == 1:
        return log
    return log.with_name(f"{log.stem}.run{run}{log.suffix}")


def format_run(s: dict, runs: int) -> str:
    what = ", ".join(s["crash_signs"]) if s["crash_signs"] else "no crash signs"
    line = (f"run {s['run'] + 1}/{runs}: {s['rounds']} rounds, {s['streams']} streams, {s['failed']} failed; "
            f"server log: {what}")
    return line + (f"; {s['error']}" if s["error"] else "")


def format_total(t: dict, transport: str) -> str:
    return (f"total ({transport}): {t['runs']} runs, {t['runs_failed']} failed; {t['streams']} streams, "
            f"{t['failed']} failed; crash signs in {t['runs_with_crash_signs']} runs"
            + (f" ({', '.join(t['crash_signs'])})" if t["crash_signs"] else ""))


def _rounds(args: argparse.Namespace, run: int, grpc_url: str, prompts: list[str],
            ids: list[list[int]]) -> list[dict]:
    """The rounds of one run, printed as they finish; stops after the first round with a failed stream."""
    rows: list[dict] = []
    if not args.json:
        print(f"{'round':>5} {'wall s':>7} {'streams':>7} {'failed':>6} {'slowest s':>9}  first error")
    for r in range(args.rounds):
        row = {"round": r,
               **one_round(grpc_url, prompts, ids, args.concurrency, args.max_tokens, args.timeout)}
        if args.runs > 1:
            row["run"] = run
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            print(f"{r:>5} {row['wall_s']:>7.2f} {row['streams']:>7} {row['failed']:>6} "
                  f"{row['slowest_s']:>9.2f}  {row['first_error']}", flush=True)
        if row["failed"]:
            break
    return rows


def dump_stubs(server_pid: int, timeout_s: float = 60.0) -> str:
    """Every Python stub's thread stacks (py-spy dump), for a round whose streams went silent: where
    pd, prefill and decode wait. Empty when py-spy is not installed (`pip install py-spy`)."""
    import shutil
    import subprocess

    from rngd_pd.host.stubs import stub_processes

    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if spy is None:
        return ""
    out = []
    for stub in stub_processes(server_pid):
        try:
            done = subprocess.run([spy, "dump", "--pid", str(stub.pid)], capture_output=True, text=True,
                                  timeout=timeout_s)
            text = done.stdout + done.stderr
        except (OSError, subprocess.TimeoutExpired) as exc:
            text = f"py-spy failed: {exc}"
        out.append(f"===== py-spy dump of {stub.instance} (pid {stub.pid}) =====\n{text}")
    return "\n".join(out)


def _run(args: argparse.Namespace, run: int, prompts: list[str],
         ids: list[list[int]]) -> tuple[list[dict], str, str]:
    """(rows, server log text, error) of one run with a fresh relay and server, both stopped at its end."""
    from rngd_pd.config.env import RNGD_PD_DECODE_URL, RNGD_PD_DECODE_VIA, RNGD_PD_PREFILL_URL
    from rngd_pd.errors import RngdPdError
    from rngd_pd.kv.relay.proc import start_relay
    from rngd_pd.serve.server import ServerConfig, TritonServer, free_port

    rows: list[dict] = []
    error = dumps = ""
    with contextlib.ExitStack() as stack:
        shm = stack.enter_context(tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir()
                                                              else None))
        log = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rngd-pd-stress-"))) / "triton.log"
        try:
            with contextlib.ExitStack() as serving:  # closed before the log is read: server, then relay
                relay = None
                if args.transport in RELAY_TRANSPORTS:
                    relay = serving.enter_context(start_relay()).addr
                env = transport_env(args.transport, shm, relay)
                grpc_port = free_port("127.0.0.1")
                if args.decode_by == "url":
                    env[RNGD_PD_DECODE_URL.name] = f"127.0.0.1:{grpc_port}"
                env[RNGD_PD_DECODE_VIA.name] = "bls" if args.decode_by == "bls" else "grpc"
                if args.prefill_by == "grpc":
                    env[RNGD_PD_PREFILL_URL.name] = f"127.0.0.1:{grpc_port}"
                env["RNGD_PD_PARAM_LOCAL_PREFILL_TOKENS"] = str(args.local_prefill)
                env["RNGD_PD_PARAM_LOCAL_PREFILL_WHEN"] = "always"  # by length: both paths every round
                cfg = ServerConfig(ROOT / "model_repository", "cpu", http_port=0, grpc_port=grpc_port,
                                   metrics_port=0, env=env, extra_args=tuple(args.extra))
                server = serving.enter_context(TritonServer(cfg, log=log))
                print(f"  .. run {run + 1}/{args.runs}: starting tritonserver (cpu config, {args.transport}"
                      + (f", relay {relay}" if relay else "") + ")", file=sys.stderr, flush=True)
                server.wait_ready(args.ready_timeout)
                rows = _rounds(args, run, server.grpc_url, prompts, ids)
                if rows and rows[-1]["failed"] and server.proc is not None:
                    dumps = dump_stubs(server.proc.pid)  # while whatever holds the streams still does
        except (RngdPdError, OSError, ValueError) as exc:  # a run that could not start is a failed run
            first = str(exc).splitlines()[0] if str(exc) else ""
            error = f"{type(exc).__name__}: {first}"[:200]
        text = log.read_text(errors="replace") if log.exists() else ""
        if dumps:
            text += "\n" + dumps
    return rows, text, error


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from rngd_pd.testing import e2e as E

    prompts = list(E.PROMPTS)
    ids = [E.prompt_ids(t) for t in prompts]  # tokenize once, not in the timed rounds
    summaries = []
    for run in range(args.runs):
        rows, text, error = _run(args, run, prompts, ids)
        s = run_summary(run, rows, text, error)
        summaries.append(s)
        kept = log_path(args.log, run, args.runs)
        if kept is None and not s["ok"] and text:
            kept = Path(tempfile.gettempdir()) / f"rngd-pd-stress-{os.getpid()}-run{run}.log"
        if kept is not None:
            kept.write_text(text)
            s["log"] = str(kept)
        print(json.dumps(s) if args.json else "\n" + format_run(s, args.runs)
              + (f" (log: {kept})" if kept is not None and not s["ok"] else ""), flush=True)
    if args.runs > 1:
        t = total_summary(summaries)
        print(json.dumps(t) if args.json else "\n" + format_total(t, args.transport), flush=True)
    return 0 if all(s["ok"] for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
