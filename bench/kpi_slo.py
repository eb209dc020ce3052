"""SLO KPI: the share of requests whose TPOT is within the SLO (p99 TPOT 150 ms by default, as ai-rm
measures it), from bench/load_gen.py's JSON lines or by running the load generator.

    python bench/load_gen.py --url ... --json > run.jsonl && python bench/kpi_slo.py --in run.jsonl
    python bench/kpi_slo.py --slo-tpot-ms 150 -- --url http://127.0.0.1:9000 --concurrency 8 --requests 32

A run passes when its p99 TPOT is within the SLO (so at least 99% of requests are). Rows carry the
names the original gateway exported (`airm_ttft_p90_ms`, `airm_tpot_p90_ms`, `airm_tok_s`). A file
holding several runs (request lines, each run closed by its summary line) gives one row per run.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from collections.abc import Iterable, Iterator
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(ROOT))

from bench import load_gen  # noqa: E402


def runs(lines: Iterable[str]) -> Iterator[tuple[list[dict], dict | None]]:
    """(request rows, summary row or None) per run in load_gen's JSON lines; other lines are skipped."""
    requests: list[dict] = []
    for line in lines:
        line = line.strip()
        if not line.startswith("{"):
            continue
        row = json.loads(line)
        if row.get("type") == "request":
            requests.append(row)
        elif row.get("type") == "summary":
            yield requests, row
            requests = []
    if requests:
        yield requests, None


def slo_row(requests: list[dict], summary: dict | None, slo_tpot_ms: float) -> dict[str, Any]:
    """The SLO figures of one run."""
    ok = [r for r in requests if r.get("error") is None]
    tpots = [float(r["tpot_ms"]) for r in ok if r.get("tpot_ms") is not None]
    ttfts = [float(r["ttft_ms"]) for r in ok if r.get("ttft_ms") is not None]
    row: dict[str, Any] = {"type": "slo", "requests": len(ok), "errors": len(requests) - len(ok)}
    row.update(load_gen.slo_figures(tpots, slo_tpot_ms))
    row["tpot_p99_ms"] = load_gen.pct(tpots, 99)
    row["airm_ttft_p90_ms"] = load_gen.pct(ttfts, 90)
    row["airm_tpot_p90_ms"] = load_gen.pct(tpots, 90)
    row["airm_tok_s"] = (summary or {}).get("output_tok_s")
    verdict = "PASS" if row["slo_pass"] and not row["errors"] else "FAIL"
    row["result"] = f"SLO {verdict}, {row['slo_within']}/{len(requests)}"
    if summary:
        row.update(
            {
                k: summary.get(k)
                for k in ("mode", "concurrency", "rate", "prompt_tokens", "max_tokens", "trace")
            }
        )
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{'run':>4} {'requests':>9} {'TPOT p99 ms':>12} {'within SLO':>11} {'TTFT p90':>9} "
        f"{'tok/s':>8}  result"
    ]
    for i, r in enumerate(rows):
        share = "-" if r["slo_share"] is None else f"{100 * r['slo_share']:.1f}%"
        lines.append(
            f"{i:>4} {r['requests']:>9} {r['tpot_p99_ms'] or '-':>12} {share:>11} "
            f"{r['airm_ttft_p90_ms'] or '-':>9} {r['airm_tok_s'] or '-':>8}  {r['result']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    gen_args = argv[argv.index("--") + 1 :] if "--" in argv else None
    own = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--in", dest="inp", type=Path, default=None, help="load_gen JSON lines (default: stdin)")
    ap.add_argument("--slo-tpot-ms", type=float, default=load_gen.DEFAULT_SLO_TPOT_MS)
    ap.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    args = ap.parse_args(own)
    if gen_args is not None:
        out = io.StringIO()
        with redirect_stdout(out):
            load_gen.main([*gen_args, "--json"])
        lines: Iterable[str] = out.getvalue().splitlines()
    elif args.inp is not None:
        lines = args.inp.read_text().splitlines()
    else:
        lines = sys.stdin
    rows = [slo_row(reqs, summary, args.slo_tpot_ms) for reqs, summary in runs(lines)]
    if not rows:
        print("kpi_slo: no load_gen request lines found (run load_gen with --json)", file=sys.stderr)
        return 2
    print("\n".join(json.dumps(r) for r in rows) if args.json else table(rows))
    return 0 if all(r["result"].startswith("SLO PASS") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
