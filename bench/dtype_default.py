"""Is the served default compute dtype right on this host? pd with `dtype` unset (`auto`) against pd
with each dtype forced, in one tritonserver, requests alternating.

    .venv/bin/python bench/dtype_default.py [--prompt-len 256] [--max-tokens 32] [--requests 5] [--json]

Issue 11's bar: with no `--dtype`, TTFT within 1.2x of `--dtype fp32` on an AVX2-only CPU and of
`--dtype bf16` on one with native bf16, i.e. within 1.2x of the faster forced dtype on any host, which
is what this checks (and reports for TPOT too) without assuming which kind of CPU it runs on.

The server holds one prefill, decode and pd per dtype (`prefill_bf16`, `decode_bf16`, `pd_bf16`, ...:
copies of the repository's models with the `dtype` parameter set, cpu config); $RNGD_PD_DTYPE is
dropped from the server's environment so that the parameter decides. Each round sends one unique
prompt (no prefix cache hit) to every pd in turn, so a load that drifts hits every dtype alike. Every
instance logs what `auto` chose and why (`compute dtype ...`); the table repeats it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(ROOT))

from bench.pd_overhead import model_copy, stream_times, summarize, unique_prompts  # noqa: E402
from rngd_pd.config.dtypes import COMPUTE_CHOICES as DTYPES  # noqa: E402

LIMIT = 1.2


def build_repo(repo: Path, dtypes: tuple[str, ...]) -> None:
    """prefill_<d>, decode_<d> and pd_<d> (wired to that pair) for each dtype d."""
    for d in dtypes:
        model_copy(repo, "prefill", f"prefill_{d}", dtype=d)
        model_copy(repo, "decode", f"decode_{d}", dtype=d)
        model_copy(repo, "pd", f"pd_{d}", prefill_model=f"prefill_{d}", decode_model=f"decode_{d}")


def chosen(log: str, model: str) -> str:
    """What the instance of `model` logged as its compute dtype (the first such line)."""
    m = re.search(rf'{model}_0_0: compute dtype (\S+) \((.*)\)"?\s*$', log, re.M)
    return f"{m.group(1)} ({m.group(2)})" if m else "?"


def measure(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A row per dtype, and auto's row (with its ratios to the faster forced dtype and `ok`)."""
    from rngd_pd.config.env import RNGD_PD_DTYPE
    from rngd_pd.config.settings import param_env
    from rngd_pd.model.checkpoint import open_checkpoint
    from rngd_pd.serve.server import ServerConfig, TritonServer

    for name in (RNGD_PD_DTYPE.name, param_env("dtype")):
        os.environ.pop(name, None)
    vocab = open_checkpoint(None).config().vocab_size  # the prompts' id range; no weights needed
    with contextlib.ExitStack() as stack:
        shm = stack.enter_context(tempfile.TemporaryDirectory(dir="/dev/shm"))
        repo = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rngd-pd-dtype-")))
        build_repo(repo, DTYPES)
        log = repo / "tritonserver.log"
        cfg = ServerConfig(repo, "cpu", http_port=0, grpc_port=0, metrics_port=0,
                           env={"AIRM_KV_TRANSPORT": "shm", "PD_SHM_ROOT": shm})
        server = stack.enter_context(TritonServer(cfg, log=log))
        server.wait_ready(900)
        runs: dict[str, list[list[float]]] = {d: [] for d in DTYPES}
        prompts = iter(unique_prompts(len(DTYPES) * (args.requests + 1), args.prompt_len, vocab, 3))
        for i in range(args.requests + 1):
            for d, times in runs.items():
                times.append(stream_times(server.grpc_url, f"pd_{d}", next(prompts), args.max_tokens))
            print(f"  .. round {i + 1}/{args.requests + 1}", file=sys.stderr)
        text = log.read_text(errors="replace")
    rows = [{"dtype": d, **summarize(r[1:]),
             "prefill": chosen(text, f"prefill_{d}"), "decode": chosen(text, f"decode_{d}")}
            for d, r in runs.items()]
    forced = [r for r in rows if r["dtype"] != "auto"]
    auto = next(r for r in rows if r["dtype"] == "auto")
    for key in ("ttft_ms", "tpot_ms"):
        best = min(r[key] for r in forced)
        auto[f"{key[:4]}_vs_best_forced"] = auto[key] / best
    auto["ok"] = auto["ttft_vs_best_forced"] <= LIMIT
    return rows, auto


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--requests", type=int, default=5, help="measured requests per dtype (+1 warm-up)")
    parser.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    args = parser.parse_args(argv)
    from rngd_pd.devices.cpu_features import read_cpu_features

    rows, auto = measure(args)
    cpu = read_cpu_features()
    host = f"{cpu.model or cpu.arch}, {cpu.native_bf16 or cpu.simd}, {os.cpu_count()} cores"
    if args.json:
        for row in rows:
            print(json.dumps({"prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                              "cpu": host, **row}))
        return 0 if auto["ok"] else 1
    print(f"CPU: {host}; prompt {args.prompt_len} tokens, {args.max_tokens} output tokens, "
          f"median of {args.requests}")
    print(f"{'dtype':>6} | {'ttft ms':>9} | {'tpot ms':>9} | prefill chose / decode chose")
    for r in rows:
        print(f"{r['dtype']:>6} | {r['ttft_ms']:>9.1f} | {r['tpot_ms']:>9.2f} | {r['prefill']}")
        print(f"{'':>6} | {'':>9} | {'':>9} | {r['decode']}")
    verdict = "OK" if auto["ok"] else f"FAIL (over {LIMIT}x)"
    print(f"auto / best forced: TTFT {auto['ttft_vs_best_forced']:.2f}x, "
          f"TPOT {auto['tpot_vs_best_forced']:.2f}x (limit {LIMIT}x on TTFT): {verdict}")
    return 0 if auto["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
