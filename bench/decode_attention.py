"""Decode attention on this CPU: torch's SDPA over the cache's views, one call per run of consecutive
slots (`_attend_runs`, what `Llama.decode_step` runs) against two batched matmuls over a copy of K
and, for scattered slots, a gather of K and V (`_attend`, what the step ran before and the RNGD graphs
lower), per layer of SmolLM2's shape.

    python bench/decode_attention.py                       # bf16, 1 and 2 threads
    python bench/decode_attention.py --dtype fp32 --threads 2 --json out.json

Shapes: 1 / 8 / 16 rows of one step in consecutive slots of a 16-slot cache of 2,048 positions, and
8 rows in two runs of 4 (slots 0-3, 8-11: what requests ending at random leave), all attending over
320 / 1,056 / 1,600 keys. Each candidate runs interleaved with the other, its best
of --repeat kept; the table gives both, their ratio, and the largest difference of their outputs.
A speed run runs alone: record the load average beside it (printed).
"""

from __future__ import annotations

import functools
import sys
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.prefill_attention import best_ms, cli  # noqa: E402
from rngd_pd.model.llama import _attend, _attend_runs, _AttnGroup  # noqa: E402

LAYOUTS = {"1 row": [0], "8 rows": list(range(8)), "16 rows": list(range(16)),
           "8 rows, 2 runs": [0, 1, 2, 3, 8, 9, 10, 11]}
KEYS = (320, 1056, 1600)
SLOTS, MAX_LEN = 16, 2048


def matmuls(ck: torch.Tensor, cv: torch.Tensor, qg: torch.Tensor, bias: torch.Tensor, slots: list[int],
            keys: int, scale: float) -> torch.Tensor:
    """The step before SDPA: K's visible rows copied (a transposed strided K made bmm slower still),
    scattered slots gathered."""
    sel = slice(slots[0], slots[-1] + 1) if slots == list(range(slots[0], slots[-1] + 1)) else slots
    return _attend(qg, ck[sel, :, :keys].contiguous(), cv[sel, :, :keys], bias, scale)


def measure(dtype: torch.dtype, threads: int, repeat: int, heads: int = 9, kv_heads: int = 3,
            head_dim: int = 64) -> list[dict]:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    ck = torch.randn(SLOTS, kv_heads, MAX_LEN, head_dim).to(dtype)
    cv = torch.randn(SLOTS, kv_heads, MAX_LEN, head_dim).to(dtype)
    scale, rows = head_dim**-0.5, []
    cache = types.SimpleNamespace(num_slots=SLOTS, max_len=MAX_LEN)  # what _AttnGroup checks the rows against
    for layout, slots in LAYOUTS.items():
        n = len(slots)
        for keys in KEYS:
            qg = torch.randn(n, kv_heads, heads // kv_heads, head_dim).to(dtype)
            pos = list(range(keys - n, keys))  # ragged rows, the longest `keys`
            group = _AttnGroup(cache, None, slots, pos, torch.tensor(pos), torch.device("cpu"))
            bias = torch.zeros(n, 1, 1, keys).masked_fill_(~group.mask, float("-inf"))
            new = functools.partial(_attend_runs, ck, cv, group, qg, dtype, scale)
            old = functools.partial(matmuls, ck, cv, qg, bias, slots, keys, scale)
            with torch.inference_mode():
                t_new, t_old = best_ms([new, old], repeat)
                diff = float((new().float() - old().float()).abs().max())
            rows.append({"dtype": "bf16" if dtype == torch.bfloat16 else "fp32", "threads": threads,
                         "rows": layout, "keys": keys, "sdpa_ms": round(t_new, 3),
                         "matmuls_ms": round(t_old, 3), "matmuls_over_sdpa": round(t_old / t_new, 2),
                         "max_abs_diff": diff})
    return rows


def main(argv: list[str] | None = None) -> int:
    columns = {"dtype": "dtype", "threads": "threads", "rows": "rows", "keys": "keys", "SDPA ms": "sdpa_ms",
               "matmuls ms": "matmuls_ms", "matmuls / SDPA": "matmuls_over_sdpa",
               "max abs diff": "max_abs_diff"}
    title = f"decode attention per layer (9 heads, 3 KV heads, head_dim 64, cache of {SLOTS} x {MAX_LEN})"
    return cli(argv, __doc__ or "", measure, title, columns, repeat=30)


if __name__ == "__main__":
    sys.exit(main())
