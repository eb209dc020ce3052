"""The Triton 2.51 crash behind issue 11, reproduced, next to the project's response builder.

    .venv/bin/python bench/prune_crash.py [--rounds 10] [--streams 32] [--tokens 64] [--json]

Two tritonservers, one after the other, serve two copies of the test echo model (decoupled,
rngd_pd/testing/assets/echo_model.py):
`echo_raw` puts every output (`output_ids`, `finish_reason`) in each response, as the models did before;
`echo` builds each response from the request's requested outputs (`rngd_pd.stubs.pbutils`). Every
client requests only `output_ids`, so for `echo_raw` Triton prunes `finish_reason` in C++ after releasing
the GIL, freeing a numpy object array there (python_backend #390, fixed in r24.12). Each round runs
`streams` concurrent streams against each model, each streamed from a Python thread of its own (the
race needs Python threads running while another sends); a model fails a round when a stream errors,
stalls or comes back short, and its stub is then usually dead (Triton 2.51 does not restart it). The
table says, per model, how many rounds passed before the first failure and what the log shows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CRASH_SIGNS = ("double free", "free(): invalid", "Reference count error", "not healthy",
               "Signal (11)", "Signal (6)", "Segmentation fault", "corrupted")


def repository(root: Path) -> Path:
    from rngd_pd.testing.assets import ECHO
    from rngd_pd.testing.assets.echo_model import SPEC
    from rngd_pd.testing.repository import config_pbtxt, write_model

    for name, send_all in (("echo", "false"), ("echo_raw", "true")):
        params = {"delay_ms": "0", "threads": "true", "send_all_outputs": send_all}
        config = config_pbtxt(dataclasses.replace(SPEC, name=name), params)
        write_model(root, name, ECHO, config)
    return root


def one_round(url: str, model: str, streams: int, tokens: int, timeout: float) -> tuple[int, str]:
    """(streams that failed, the first error)."""
    from rngd_pd.testing import e2e as E

    ids = np.arange(1, tokens + 1, dtype=np.int32)
    failures: list[str] = []

    def stream() -> None:
        try:
            got = E.stream_infer(url, model, {"input_ids": ids}, ("output_ids",), timeout=timeout)
            if len(E.ids_of(got)) != tokens:
                failures.append(f"short stream: {len(E.ids_of(got))} of {tokens} ids")
        except BaseException as exc:  # a failed stream is the measurement
            failures.append(f"{type(exc).__name__}: {exc}"[:160])

    threads = [threading.Thread(target=stream, daemon=True) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    return len(failures) + sum(t.is_alive() for t in threads), (failures or [""])[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64, help="responses per stream")
    p.add_argument("--timeout", type=float, default=20.0, help="seconds without a response = failed")
    p.add_argument("--models", default="echo_raw,echo", help="comma-separated: echo_raw, echo")
    p.add_argument("--json", action="store_true", help="one JSON object per model")
    args = p.parse_args(argv)

    from rngd_pd.serve.server import ServerConfig, TritonServer

    rows = []
    for model in args.models.split(","):  # a server each: the crash can take the whole server down
        with tempfile.TemporaryDirectory(prefix="rngd-pd-prune-") as tmp:
            repo = repository(Path(tmp) / "repo")
            log = Path(tmp) / "triton.log"
            cfg = ServerConfig(repo, http_port=0, grpc_port=0, metrics_port=0,
                               extra_args=("--model-control-mode=explicit", f"--load-model={model}"))
            with TritonServer(cfg, log=log) as server:
                print(f"  .. starting tritonserver for {model}", file=sys.stderr, flush=True)
                server.wait_ready(120)
                passed, failed, first = 0, 0, ""
                t0 = time.perf_counter()
                for _ in range(args.rounds):
                    failed, first = one_round(server.grpc_url, model, args.streams, args.tokens, args.timeout)
                    if failed:
                        break
                    passed += 1
                rows.append({"model": model, "rounds_passed": passed, "rounds": args.rounds,
                             "failed_streams": failed, "first_error": first,
                             "ready_after": server.is_ready(model),
                             "wall_s": round(time.perf_counter() - t0, 1)})
                text = log.read_text(errors="replace")
            rows[-1]["crash_signs"] = sorted({s for s in CRASH_SIGNS if s in text})
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print(f"{'model':<10} {'rounds ok':>9} {'failed':>6} {'ready':>5} {'wall s':>6}  "
              f"{'log':<16} first error")
        for r in rows:
            signs = ", ".join(r["crash_signs"]) or "no crash signs"
            print(f"{r['model']:<10} {r['rounds_passed']:>4}/{r['rounds']:<4} {r['failed_streams']:>6} "
                  f"{r['ready_after']!s:>5} {r['wall_s']:>6}  {signs:<16} {r['first_error']}")
    builder = next((r for r in rows if r["model"] == "echo"), None)
    clean = builder is None or (builder["rounds_passed"] == args.rounds and not builder["crash_signs"])
    return 0 if clean else 1

if __name__ == "__main__":
    sys.exit(main())
