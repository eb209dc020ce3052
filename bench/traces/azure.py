"""Azure LLM inference trace CSVs (TIMESTAMP, ContextTokens, GeneratedTokens): write, read, synthesise.

The public Azure traces are too long and too large-context for a 2-core CPU, so the sweep and the tests
use small seeded traces in the same format: the load generator replays any of them the same way.

    python bench/traces/azure.py mixed --requests 48 --rate 1.0 --seed 0 --out bench/traces/mixed.csv
"""

from __future__ import annotations

import argparse
import csv
import math
import random
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from rngd_pd.errors import ConfigError

HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
START = datetime(2023, 11, 16, 18, 0, 0)  # the public traces start on this day
MIXED_CSV = Path(__file__).with_name("mixed.csv")


class TraceError(ConfigError):
    """A trace file that is missing, has the wrong header, or a bad row."""


@dataclass(frozen=True)
class TraceRow:
    """One request: arrival offset in seconds from the first row, prompt and output lengths in tokens."""

    t: float
    context_tokens: int
    generated_tokens: int


def _stamp(t: float) -> str:
    # The Azure files write 7 fractional digits ("2023-11-16 18:15:46.6805900").
    return (START + timedelta(seconds=t)).strftime("%Y-%m-%d %H:%M:%S.%f") + "0"


def write_trace(path: str | Path, rows: Iterable[TraceRow]) -> Path:
    """Write rows as an Azure-format CSV; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(HEADER)
        for r in rows:
            w.writerow([_stamp(r.t), r.context_tokens, r.generated_tokens])
    return path


def _parse_time(text: str, where: str) -> datetime:
    try:
        return datetime.fromisoformat(text.strip())
    except ValueError:
        pass
    try:  # plain seconds are accepted too (some converted traces use them)
        return START + timedelta(seconds=float(text))
    except ValueError as e:
        raise TraceError(f"{where}: TIMESTAMP {text!r} is neither a date-time nor seconds") from e


def _positive_int(text: str, column: str, where: str) -> int:
    try:
        value = int(float(text))
    except ValueError as e:
        raise TraceError(f"{where}: {column} {text!r} is not a number") from e
    if value < 1:
        raise TraceError(f"{where}: {column} must be >= 1, got {value}")
    return value


def read_trace(path: str | Path, limit: int | None = None) -> list[TraceRow]:
    """Rows of an Azure-format CSV, times made relative to the earliest row and sorted by arrival."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace file {path} does not exist; write one with bench/traces/azure.py")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [h for h in HEADER if h not in (reader.fieldnames or [])]
        if missing:
            raise TraceError(f"{path}: missing column(s) {missing}; an Azure trace has {list(HEADER)}")
        raw = []
        for n, rec in enumerate(reader, start=2):
            where = f"{path}:{n}"
            raw.append((
                _parse_time(rec["TIMESTAMP"], where),
                _positive_int(rec["ContextTokens"], "ContextTokens", where),
                _positive_int(rec["GeneratedTokens"], "GeneratedTokens", where),
            ))
            if limit is not None and len(raw) >= limit:
                break
    if not raw:
        raise TraceError(f"{path}: no rows after the header")
    t0 = min(r[0] for r in raw)
    rows = [TraceRow((ts - t0).total_seconds(), c, g) for ts, c, g in raw]
    return sorted(rows, key=lambda r: r.t)


def poisson_times(n: int, rate: float, rng: random.Random) -> list[float]:
    """n arrival offsets of a Poisson process with `rate` requests per second (first at 0)."""
    if rate <= 0:
        raise TraceError(f"rate must be > 0 requests/s, got {rate}")
    t, out = 0.0, []
    for _ in range(n):
        out.append(round(t, 6))
        t += rng.expovariate(rate)
    return out


def fixed_trace(n: int, context: int, generated: int, rate: float, seed: int = 0) -> list[TraceRow]:
    """n requests of one shape arriving as a Poisson process."""
    times = poisson_times(n, rate, random.Random(seed))
    return [TraceRow(t, context, generated) for t in times]


# (share, context range, generated range): chat turns, documents, and a few long prompts whose prefill
# would stall a colocated decoder. Bounded so one request fits the small model on 2 CPU cores.
MIX: Sequence[tuple[float, tuple[int, int], tuple[int, int]]] = (
    (0.6, (32, 384), (32, 192)),
    (0.3, (384, 1024), (16, 128)),
    (0.1, (1024, 1792), (8, 64)),
)


def _log_uniform(lo: int, hi: int, rng: random.Random) -> int:
    return round(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def mixed_trace(n: int, rate: float, seed: int = 0) -> list[TraceRow]:
    """n requests with mixed prompt/output lengths (MIX), Poisson arrivals; same seed, same trace."""
    rng = random.Random(seed)
    times = poisson_times(n, rate, rng)
    shares = [m[0] for m in MIX]
    rows = []
    for t in times:
        _, ctx, gen = rng.choices(MIX, weights=shares)[0]
        rows.append(TraceRow(t, _log_uniform(*ctx, rng), _log_uniform(*gen, rng)))
    return rows


def main(argv: list[str] | None = None) -> int:
    """CLI: write a fixed or mixed trace."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=["mixed", "fixed"])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals per second")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--context", type=int, default=512, help="fixed: prompt tokens")
    ap.add_argument("--generated", type=int, default=128, help="fixed: output tokens")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    if a.kind == "mixed":
        rows = mixed_trace(a.requests, a.rate, a.seed)
    else:
        rows = fixed_trace(a.requests, a.context, a.generated, a.rate, a.seed)
    write_trace(a.out, rows)
    print(f"wrote {len(rows)} requests to {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
