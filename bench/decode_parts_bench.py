"""What one decode step over several buckets and ragged lengths costs, against the way it ran before.

Two comparisons, each alternating in the same loop so that both sides see the same machine:

* buckets: rows in two caches (the engine's sequence buckets) stepped as one `decode_step_parts`
  (the weights read once) against one `decode_step` per cache (one weight pass per bucket);
* lengths: rows of one cache at ragged positions, attending in groups by length (`_length_groups`)
  against one group over the longest row (every row reads and masks the longest row's keys).

    python bench/decode_parts_bench.py                       # bf16, a table
    python bench/decode_parts_bench.py --dtype fp32 --json out.json --reps 30
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(ROOT))

from rngd_pd.config.dtypes import torch_dtype  # noqa: E402
from rngd_pd.model import KVCache, load_model  # noqa: E402
from rngd_pd.model import llama as llama_mod  # noqa: E402

# (rows at short positions, their position, rows at long positions, theirs)
BUCKET_CASES = ((4, 200, 4, 600), (4, 200, 4, 1600), (6, 150, 2, 1600))
LENGTH_CASES = ((200,) * 6 + (1600,) * 2, (150, 300, 450, 600, 800, 1000, 1300, 1600))


def _rows(n: int, pos: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.ones(n, dtype=torch.long), torch.full((n,), pos, dtype=torch.long), torch.arange(n)


def _median_ms(times: list[float]) -> float:
    return round(1000 * statistics.median(times), 2)


def _pair(a: Callable[[], Any], b: Callable[[], Any], reps: int) -> tuple[float, float]:
    """Median ms of a and of b, alternating a, b (3 warm-up rounds)."""
    ta, tb = [], []
    for i in range(reps + 3):
        t0 = time.perf_counter()
        a()
        t1 = time.perf_counter()
        b()
        t2 = time.perf_counter()
        if i >= 3:
            ta.append(t1 - t0)
            tb.append(t2 - t1)
    return _median_ms(ta), _median_ms(tb)


def bench_buckets(model: Any, dtype: torch.dtype, reps: int) -> list[dict[str, Any]]:
    short, long = KVCache(model.config, 8, 512, dtype), KVCache(model.config, 8, 2048, dtype)
    out = []
    for na, pa, nb, pb in BUCKET_CASES:
        (ta, qa, sa), (tb, qb, sb) = _rows(na, pa), _rows(nb, pb)
        fused = functools.partial(model.decode_step_parts, torch.cat([ta, tb]), torch.cat([qa, qb]),
                                  [(short, sa), (long, sb)])
        apart = functools.partial(_in_turn, model, [(ta, qa, short, sa), (tb, qb, long, sb)])
        now, before = _pair(fused, apart, reps)
        out.append({"case": "buckets", "rows": f"{na}@{pa} in 512 + {nb}@{pb} in 2048",
                    "now_ms": now, "before_ms": before, "speedup": round(before / now, 2)})
    return out


def _in_turn(model: Any, steps: list[tuple[Any, ...]]) -> None:
    for args in steps:
        model.decode_step(*args)


def _with_split(model: Any, split_keys: int, *args: Any) -> None:
    llama_mod._SPLIT_KEYS = split_keys
    model.decode_step(*args)


def bench_lengths(model: Any, dtype: torch.dtype, reps: int) -> list[dict[str, Any]]:
    cache = KVCache(model.config, 8, 2048, dtype)
    split = llama_mod._SPLIT_KEYS
    out = []
    for pos in LENGTH_CASES:
        args = (torch.ones(len(pos), dtype=torch.long), torch.tensor(pos), cache, torch.arange(len(pos)))
        try:
            now, before = _pair(functools.partial(_with_split, model, split, *args),
                                functools.partial(_with_split, model, 1 << 30, *args), reps)
        finally:
            llama_mod._SPLIT_KEYS = split
        out.append({"case": "lengths", "rows": "positions " + ",".join(map(str, pos)),
                    "now_ms": now, "before_ms": before, "speedup": round(before / now, 2)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (one per process when served)")
    ap.add_argument("--json", type=Path, default=None, help="write the rows and the conditions here")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    dtype = torch_dtype(a.dtype)
    model = load_model(None, dtype=dtype, progress=False).model
    load_before = os.getloadavg()[0]
    with torch.inference_mode():
        model.prepare_decode()
        rows = bench_buckets(model, dtype, a.reps) + bench_lengths(model, dtype, a.reps)
    cond = {"dtype": a.dtype, "threads": a.threads, "reps": a.reps,
            "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)]}
    print(f"decode step, SmolLM2-135M, {a.dtype}, {a.threads} thread(s), median of {a.reps}; "
          f"load average {cond['loadavg_1m'][0]} -> {cond['loadavg_1m'][1]}")
    print("| case | rows | now ms | before ms | before / now |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['rows']} | {r['now_ms']} | {r['before_ms']} | {r['speedup']} |")
    if a.json:
        a.json.write_text(json.dumps({"conditions": cond, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
