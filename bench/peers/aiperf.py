"""NVIDIA's aiperf (PyPI `aiperf` 0.13.0) as a second, standard client for one sweep point.

aiperf's dependencies would downgrade packages of the project's .venv (huggingface_hub, rich, pillow,
psutil), so it lives in its own virtual environment, .cache/peers/aiperf-venv (git-ignored), made on
first use at the lowest CPU priority:

    python bench/peers/aiperf.py install        # idempotent; prints the aiperf executable

`profile_argv` is the command line bench/sweep.py runs (synthetic prompts of a fixed length, fixed
output length with EOS ignored, streaming completions, a closed loop of N streams) and bench/goodput.py
runs (request-rate mode: Poisson arrivals, a mix of prompt lengths); `read_results` maps aiperf's JSON
export onto the sweep's row fields, `read_records` gives each request's figures. aiperf's inter-token
latency is per request (latency - TTFT) / (output tokens - 1), the same definition as load_gen's TPOT.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(ROOT))

from bench.peers import process  # noqa: E402

VENV = ROOT / ".cache" / "peers" / "aiperf-venv"
PACKAGE = "aiperf==0.13.0"
# aiperf's offline mode (HF_HUB_OFFLINE) looks a local tokenizer folder up in the hub cache and fails;
# without it a local folder is loaded directly, with no network access.
UNSET = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
EXPORT = "profile_export_aiperf.json"
RECORDS = "profile_export.jsonl"  # one line per request (--export-level records)

# aiperf metric tag -> (row field, statistic); the first statistic present wins.
METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    "output_tok_s": ("output_token_throughput", ("avg", "value")),
    "ttft_p50_ms": ("time_to_first_token", ("p50", "median")),
    "ttft_p99_ms": ("time_to_first_token", ("p99",)),
    "tpot_p50_ms": ("inter_token_latency", ("p50", "median")),
    "tpot_p99_ms": ("inter_token_latency", ("p99",)),
    "e2e_p50_ms": ("request_latency", ("p50", "median")),
    "requests": ("request_count", ("avg", "value")),
    "mean_output_tokens": ("output_sequence_length", ("avg",)),
    "mean_prompt_tokens": ("input_sequence_length", ("avg",)),
    "errors": ("error_request_count", ("avg", "value")),
}


def environment(base: dict[str, str]) -> dict[str, str]:
    """aiperf's environment: `base` without the offline switches (see UNSET), colours off."""
    return {**{k: v for k, v in base.items() if k not in UNSET}, "NO_COLOR": "1"}


def executable(venv: Path = VENV) -> Path:
    return venv / "bin" / "aiperf"


def installed(venv: Path = VENV) -> bool:
    return process.venv_imports(venv, "import aiperf") and executable(venv).exists()


def install(venv: Path = VENV, log: Path | None = None) -> Path:
    """Create the venv and install aiperf into it (nice 19; idempotent); returns the executable."""
    if installed(venv):
        return executable(venv)
    if not (venv / "bin" / "python").exists():
        venv.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    print(f"installing {PACKAGE} into {venv} (a few minutes; nice 19)", file=sys.stderr, flush=True)
    cmd = ["nice", "-n", "19", str(venv / "bin" / "python"), "-m", "pip", "install", PACKAGE]
    out = log.open("ab") if log else None
    try:
        subprocess.run(cmd, check=True, stdout=out, stderr=subprocess.STDOUT if out else None)
    finally:
        if out:
            out.close()
    return executable(venv)


def profile_argv(
    url: str,
    model: str,
    *,
    tokenizer: Path,
    concurrency: int,
    requests: int,
    prompt_tokens: int,
    max_tokens: int,
    artifacts: Path,
    ignore_eos: bool = True,
    seed: int = 0,
    venv: Path = VENV,
    request_rate: float | None = None,
    seq_dist: str | None = None,
) -> list[str]:
    """`aiperf profile` against an OpenAI /v1/completions endpoint: a closed loop of `concurrency`
    streams, or open-loop Poisson arrivals at `request_rate` (aiperf's request-rate mode); prompts of
    `prompt_tokens` with `max_tokens` out, or aiperf's own mix of (ISL, OSL) pairs `seq_dist`
    (`ISL,OSL:PERCENT;...`). Per-request records are exported too (read_records)."""
    load = (["--request-rate", f"{request_rate:g}", "--arrival-pattern", "poisson"] if request_rate
            else ["--concurrency", str(concurrency)])
    shapes = (["--seq-dist", seq_dist] if seq_dist else
              ["--synthetic-input-tokens-mean", str(prompt_tokens), "--synthetic-input-tokens-stddev", "0",
               "--output-tokens-mean", str(max_tokens), "--output-tokens-stddev", "0"])
    argv = [
        str(executable(venv)),
        "profile",
        "--model",
        model,
        "--url",
        url,
        "--endpoint-type",
        "completions",
        "--streaming",
        "--tokenizer",
        str(tokenizer),
        *load,
        "--request-count",
        str(requests),
        *shapes,
        "--random-seed",
        str(seed),
        "--use-server-token-count",
        "--artifact-dir",
        str(artifacts),
        "--export-level",
        "records",
        "--ui-type",
        "none",
        "--no-server-metrics",
        "--no-gpu-telemetry",
        "--workers-max",  # a 2-core host: the fewest client processes, so the server keeps the CPU
        "1",
        "--record-processors",
        "1",
    ]
    if ignore_eos:  # the extension every server here takes (rngd-pd's front end refuses unknown fields)
        argv += ["--extra-inputs", "ignore_eos:true"]
    return argv


def _stat(metric: Any, stats: tuple[str, ...]) -> float | None:
    if isinstance(metric, (int, float)):
        return float(metric)
    if not isinstance(metric, dict):
        return None
    for s in stats:
        if isinstance(metric.get(s), (int, float)):
            return float(metric[s])
    return None


def _metrics_of(doc: dict[str, Any]) -> dict[str, Any]:
    """aiperf's metric table: top level, or under `records` / `metrics` (a dict by tag or a list)."""
    for key in ("records", "metrics"):
        inner = doc.get(key)
        if isinstance(inner, dict):
            return inner
        if isinstance(inner, list):
            return {m.get("tag"): m for m in inner if isinstance(m, dict) and m.get("tag")}
    return doc


def parse_export(doc: dict[str, Any]) -> dict[str, Any]:
    """Row fields from aiperf's JSON export (only those it reported)."""
    table = _metrics_of(doc)
    row: dict[str, Any] = {}
    for field, (tag, stats) in METRICS.items():
        v = _stat(table.get(tag), stats)
        if v is not None:
            row[field] = round(v, 3)
    for field in ("requests", "errors"):
        if field in row:
            row[field] = int(row[field])
    return row


def find_export(artifacts: Path) -> Path | None:
    hits = sorted(artifacts.rglob(EXPORT), key=lambda p: p.stat().st_mtime) if artifacts.exists() else []
    return hits[-1] if hits else None


def read_results(artifacts: Path) -> dict[str, Any] | None:
    """The row fields of the newest export under `artifacts`, or None when aiperf wrote none."""
    path = find_export(artifacts)
    if path is None:
        return None
    row = parse_export(json.loads(path.read_text()))
    return row if row.get("output_tok_s") is not None else None


def _value(metrics: dict[str, Any], tag: str) -> float | None:
    v = metrics.get(tag)
    v = v.get("value") if isinstance(v, dict) else v
    return float(v) if isinstance(v, (int, float)) else None


def read_records(artifacts: Path) -> list[dict[str, Any]]:
    """Each request of the newest run under `artifacts`, in the order aiperf sent them: prompt and
    output tokens, TTFT, ITL (= TPOT: (latency - TTFT) / (output tokens - 1)) and latency in ms, the
    start (ns) and the error aiperf recorded (None when it succeeded)."""
    hits = sorted(artifacts.rglob(RECORDS), key=lambda p: p.stat().st_mtime) if artifacts.exists() else []
    if not hits:
        return []
    out = []
    for line in hits[-1].read_text().splitlines():
        if not line.strip():
            continue
        doc = json.loads(line)
        m, meta = doc.get("metrics") or {}, doc.get("metadata") or {}
        error = doc.get("error")
        out.append({
            "prompt_tokens": int(_value(m, "input_sequence_length") or _value(m, "usage_prompt_tokens") or 0),
            "output_tokens": int(_value(m, "output_sequence_length") or 0),
            "ttft_ms": _value(m, "time_to_first_token"),
            "tpot_ms": _value(m, "inter_token_latency"),
            "e2e_ms": _value(m, "request_latency"),
            "start_ns": meta.get("request_start_ns") or 0,
            "error": (error.get("message") or str(error)) if isinstance(error, dict) else error,
        })
    return sorted(out, key=lambda r: r["start_ns"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["install"])
    ap.parse_args(argv)
    print(install())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
