"""Prefill attention on this CPU: torch's SDPA (what `Llama.prefill` runs) against the query-block
matmuls of `_attend_causal` (what the RNGD graphs lower), per layer of SmolLM2's shape.

    python bench/prefill_attention.py                      # bf16, 1 and 2 threads
    python bench/prefill_attention.py --dtype fp32 --threads 2 --json out.json

Shapes: a whole prompt of 512 / 1,536 tokens, and a 512-token chunk after 512 / 1,024 cached ones
(`PrefillEngine`'s chunks of a long prompt). Each candidate runs interleaved with the other, its best
of --repeat kept; the table gives both, their ratio, and the largest difference of their outputs.
A speed run runs alone: record the load average beside it (printed).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from rngd_pd.model.llama import _attend_causal, _attend_causal_sdpa, _causal_blocks  # noqa: E402

SHAPES = ((0, 512), (0, 1536), (512, 512), (1024, 512))  # (past, new tokens)


def best_ms(fns: list[Callable[[], object]], repeat: int) -> list[float]:
    """Each function's fastest of `repeat` runs, the functions taking turns."""
    times = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            times[i] = min(times[i], time.perf_counter() - t)
    return [t * 1000 for t in times]


def measure(dtype: torch.dtype, threads: int, repeat: int, heads: int = 9, kv_heads: int = 3,
            head_dim: int = 64) -> list[dict]:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    rows = []
    scale = head_dim**-0.5
    for past, new in SHAPES:
        q = torch.randn(heads, new, head_dim, dtype=dtype)
        k = torch.randn(kv_heads, past + new, head_dim, dtype=dtype)
        v = torch.randn(kv_heads, past + new, head_dim, dtype=dtype)
        blocks = _causal_blocks(past, new)
        sdpa_fn = functools.partial(_attend_causal_sdpa, q, k, v, scale)
        blocks_fn = functools.partial(_attend_causal, q, k, v, blocks, scale)
        with torch.inference_mode():
            sdpa, blocked = best_ms([sdpa_fn, blocks_fn], repeat)
            diff = float((sdpa_fn().float() - blocks_fn().float()).abs().max())
        rows.append({"dtype": "bf16" if dtype == torch.bfloat16 else "fp32", "threads": threads,
                     "past": past, "new": new, "sdpa_ms": round(sdpa, 2), "blocks_ms": round(blocked, 2),
                     "blocks_over_sdpa": round(blocked / sdpa, 2), "max_abs_diff": diff})
    return rows


Measure = Callable[[torch.dtype, int, int], list[dict]]


def cli(argv: list[str] | None, doc: str, measure: Measure, title: str, columns: dict[str, str],
        repeat: int) -> int:
    """The attention benches' command line: `measure(dtype, threads, repeat)` per thread count, a table
    of `columns` (header -> row key), JSON with the load average."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    ap.add_argument("--repeat", type=int, default=repeat)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    load = os.getloadavg()[0]
    rows = [r for n in a.threads.split(",") for r in measure(dtype, int(n), a.repeat)]
    print(f"{title}, torch {torch.__version__}, load average {load:.2f}")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for r in rows:
        cells = (f"{r[k]:.4g}" if k == "max_abs_diff" else str(r[k]) for k in columns.values())
        print("| " + " | ".join(cells) + " |")
    if a.json:
        report = {"loadavg_1m": load, "torch": torch.__version__, "rows": rows}
        a.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    columns = {"dtype": "dtype", "threads": "threads", "past": "past", "new": "new", "SDPA ms": "sdpa_ms",
               "query blocks ms": "blocks_ms", "blocks / SDPA": "blocks_over_sdpa",
               "max abs diff": "max_abs_diff"}
    return cli(argv, __doc__ or "", measure, "prefill attention per layer (9 heads, 3 KV heads, head_dim 64)",
               columns, repeat=7)


if __name__ == "__main__":
    sys.exit(main())
