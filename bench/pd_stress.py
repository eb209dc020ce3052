"""Stability under sustained concurrency: rounds of many simultaneous streams on one tritonserver.

    .venv/bin/python bench/pd_stress.py [--rounds 15] [--concurrency 24] [--max-tokens 32]
                                        [--timeout 60] [--transport shm] [--json]

Each round starts `concurrency` gRPC streams at once, half to `pd` (token ids) and half to `llm`
(text), and waits for all of them. A stream fails when it errors or sends nothing for `timeout`
seconds. After the last round (or the first failed one) the server log is searched for the signs of
a crashed Python stub. Rows: per round, wall time, streams that failed and the slowest stream; then a
summary with the failure rate and what the log shows.

Why a benchmark and not a test: the crash this guards against (Triton 2.51's Python backend freeing
finished BLS streams without the GIL, see rngd_pd/triton/clients.py) was rare and load-dependent;
a probabilistic check belongs where rates are measured. Measured figures are in the README.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CRASH_SIGNS = ("double free", "free(): invalid", "Reference count error", "not healthy",
               "lock_exception", "Signal (11)", "Signal (6)", "Segmentation fault")


def one_round(url: str, prompts: list[str], ids: list[list[int]], concurrency: int, max_tokens: int,
              timeout: float) -> dict:
    from tests import e2e_support as E

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
    failed = [r for r in results if not isinstance(r, int)]
    return {"wall_s": round(time.perf_counter() - t0, 2), "streams": concurrency, "failed": len(failed),
            "slowest_s": round(max(latency), 2), "first_error": failed[0] if failed else ""}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--concurrency", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds without a response = failed")
    p.add_argument("--transport", default="shm", help="shm (tcp and nixl-ucx need a relay: use pd_overhead)")
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    p.add_argument("--log", type=Path, help="keep the tritonserver log here")
    p.add_argument("--extra", action="append", default=[], help="extra tritonserver argument (repeatable)")
    p.add_argument("--decode-by", choices=("bls", "grpc"), default="bls",
                   help="how pd reaches decode: BLS (default) or gRPC to this same server (decode_url)")
    p.add_argument("--prefill-by", choices=("bls", "grpc"), default="bls",
                   help="how pd reaches prefill: BLS (default) or gRPC to this same server (prefill_url)")
    args = p.parse_args(argv)

    from rngd_pd.triton.server import ServerConfig, TritonServer
    from tests import e2e_support as E

    prompts = list(E.PROMPTS)
    ids = [E.prompt_ids(t) for t in prompts]  # tokenize once, not in the timed rounds
    rows = []
    with contextlib.ExitStack() as stack:
        shm = stack.enter_context(tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir()
                                                              else None))
        log = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rngd-pd-stress-"))) / "triton.log"
        from rngd_pd.triton.params import ENV_DECODE_URL, ENV_PREFILL_URL
        from rngd_pd.triton.server import free_port

        env = {"AIRM_KV_TRANSPORT": args.transport, "PD_SHM_ROOT": shm}
        grpc_port = free_port("127.0.0.1")
        if args.decode_by == "grpc":
            env[ENV_DECODE_URL] = f"127.0.0.1:{grpc_port}"
        if args.prefill_by == "grpc":
            env[ENV_PREFILL_URL] = f"127.0.0.1:{grpc_port}"
        cfg = ServerConfig(ROOT / "model_repository", "cpu", http_port=0, grpc_port=grpc_port, metrics_port=0,
                           env=env, extra_args=tuple(args.extra))
        server = stack.enter_context(TritonServer(cfg, log=log))
        print(f"  .. starting tritonserver (cpu config, {args.transport})", file=sys.stderr, flush=True)
        server.wait_ready(600)
        if not args.json:
            print(f"{'round':>5} {'wall s':>7} {'streams':>7} {'failed':>6} {'slowest s':>9}  first error")
        for r in range(args.rounds):
            row = {"round": r, **one_round(server.grpc_url, prompts, ids, args.concurrency, args.max_tokens,
                                           args.timeout)}
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(f"{r:>5} {row['wall_s']:>7.2f} {row['streams']:>7} {row['failed']:>6} "
                      f"{row['slowest_s']:>9.2f}  {row['first_error']}", flush=True)
            if row["failed"]:
                break
        text = log.read_text(errors="replace") if log.exists() else ""
        if args.log:
            args.log.write_text(text)
    signs = sorted({s for s in CRASH_SIGNS if s in text})
    total = sum(r["streams"] for r in rows)
    failed = sum(r["failed"] for r in rows)
    summary = {"summary": True, "rounds": len(rows), "streams": total, "failed": failed,
               "failure_rate": round(failed / total, 4) if total else 0.0, "crash_signs": signs}
    print(json.dumps(summary) if args.json else
          f"\n{len(rows)} rounds, {total} streams, {failed} failed; server log: "
          f"{', '.join(signs) if signs else 'no crash signs'}")
    return 1 if failed or signs else 0


if __name__ == "__main__":
    sys.exit(main())
