"""Model speed against this machine's limits: prefill tokens/s and decode ms/step.

Each row carries a limit measured in the same run: for decode the memory-bandwidth limit (bytes of
weights + KV one step reads / measured copy bandwidth of a large pre-faulted buffer), for prefill the
compute limit (model FLOPs / measured matmul FLOP/s). ratio = median / limit (1.0 is the roofline);
best_ratio uses the fastest run, which on a shared machine is the one least disturbed by others.
Each decode row also says whether its row 0 got the same logits bits as that row stepped alone
(`invariant`: batching must not change a greedy answer); `min_rows` names the projections a decode
step zero-pads to more rows when it has fewer (rngd_pd.model.llama's docstring).

    python bench/engine_bench.py                         # table, bf16 compute, bf16 KV
    python bench/engine_bench.py --dtype fp32 --json     # one JSON object per row
    python bench/engine_bench.py --dtype fp32,bf16 --prefill "" --batch 1,4,8,16   # decode, both dtypes
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rngd_pd.config.dtypes import KV_DTYPES, torch_dtype

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(ROOT))

from bench.kpi import flops_per_token, format_table, measure_cpu_tflops  # noqa: E402
from rngd_pd.model import KVCache, LoadedModel, load_model  # noqa: E402

COLS = ["dtype", "phase", "batch", "tokens", "ms", "tok_s", "limit_ms", "ratio", "best_ms", "best_ratio",
        "limit", "invariant"]


def copy_bandwidth(nbytes: int = 512 << 20, reps: int = 5) -> float:
    """Best bytes/s of copy_ between two pre-faulted buffers (the memory-bandwidth yardstick)."""
    src = torch.ones(nbytes // 4)
    dst = torch.zeros_like(src)
    dst.copy_(src)
    return nbytes / _best(lambda: dst.copy_(src), reps)


def matmul_flops(dtype: torch.dtype) -> float:
    """Sustained matmul FLOP/s in the compute dtype (bench.kpi's 1024^3 measurement)."""
    return measure_cpu_tflops(seconds=0.5, dtype=str(dtype).removeprefix("torch.")) * 1e12


def _times(fn: Callable[[], Any], reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _best(fn: Callable[[], Any], reps: int) -> float:
    return min(_times(fn, reps))


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads from weights: every block, the final norm, the LM head (the
    embedding table is only gathered, one row per token, unless it is the tied LM head)."""
    seen: set[int] = set()
    total = 0
    for name, p in model.named_parameters(remove_duplicate=False):
        if name == "embed" or id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    return total


def bench_decode(
    m: LoadedModel, batch: int, context: int, steps: int, kv_dtype: torch.dtype, bw: float
) -> dict:
    """Median ms of one decode step, B rows at position `context` in a cache holding that many tokens;
    `invariant`: row 0's logits in the batch have the bits of row 0 stepped alone."""
    cache = KVCache(m.config, batch, context + steps + 2, kv_dtype)
    for t in cache.k + cache.v:
        t.normal_()
    tokens = torch.randint(0, m.config.vocab_size, (batch,))
    slots = torch.arange(batch)
    positions = torch.full((batch,), context, dtype=torch.long)
    positions[1:] = torch.randint(1, context + 1, (batch - 1,))  # ragged: the others no longer than row 0
    alone = m.model.decode_step(tokens[:1], positions[:1], cache, slots[:1])[0]
    same = torch.equal(m.model.decode_step(tokens, positions, cache, slots)[0], alone)
    times = _times(lambda: m.model.decode_step(tokens, positions, cache, slots), steps + 2)[2:]
    kv_read = (positions + 1).sum().item() * m.config.kv_bytes_per_token * cache.k[0].element_size()
    limit_ms = (weight_bytes(m.model) + kv_read) / bw * 1e3
    return _row("decode", batch, batch, times, limit_ms, "memory") | {"invariant": same}


def bench_prefill(m: LoadedModel, tokens: int, reps: int, kv_dtype: torch.dtype, flops: float) -> dict:
    """Best ms of prefilling `tokens` random tokens."""
    ids = torch.randint(0, m.config.vocab_size, (tokens,))
    times = _times(lambda: m.model.prefill(ids, kv_dtype=kv_dtype), reps)
    c = m.config
    head = 2.0 * c.hidden_size * c.vocab_size  # the LM head runs for the last token only
    work = tokens * (flops_per_token(c, tokens / 2) - head) + head
    return _row("prefill", 1, tokens, times, work / flops * 1e3, "compute")


def _row(phase: str, batch: int, tokens: int, times: list[float], limit_ms: float, limit: str) -> dict:
    """ms is the median; best_ms the fastest run (on a shared machine, the one least disturbed)."""
    ms, best = statistics.median(times) * 1e3, min(times) * 1e3
    return {
        "phase": phase, "batch": batch, "tokens": tokens, "ms": ms, "tok_s": tokens / ms * 1e3,
        "limit_ms": limit_ms, "ratio": ms / limit_ms, "limit": limit,
        "best_ms": best, "best_ratio": best / limit_ms,
    }  # fmt: skip


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _rows(rows: dict[str, int] | None) -> str | None:
    """The model's decode_rows as text ('w2:2'; '1' when every projection runs any row count)."""
    if rows is None:  # a model from before batch invariance
        return None
    return ",".join(f"{k}:{v}" for k, v in rows.items()) or "1"


def _dtypes(text: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    bad = [x for x in names if x not in ("fp32", "bf16")]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"compute dtypes are fp32 and bf16, got {text!r}")
    return names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file or HF checkpoint dir (default: embedded SmolLM2)")
    p.add_argument("--dtype", type=_dtypes, default=["bf16"],
                   help="compute dtype(s) of the weights: fp32, bf16 or both comma separated (a table each)")
    p.add_argument("--kv-dtype", choices=list(KV_DTYPES), default="bf16")
    p.add_argument("--prefill", type=_ints, default=[128, 512, 2048], help="prompt lengths, comma separated")
    p.add_argument("--batch", type=_ints, default=[1, 4, 16], help="decode batch sizes, comma separated")
    p.add_argument("--context", type=int, default=256, help="tokens already cached at each decode step")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per batch size")
    p.add_argument("--reps", type=int, default=3, help="timed prefills per length")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--json", action="store_true", help="print one JSON object per row instead of a table")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    kv_dtype = torch_dtype(args.kv_dtype)
    _log("measuring copy bandwidth ...")
    bw = copy_bandwidth()
    for dtype in args.dtype:
        m = load_model(args.model, dtype=torch_dtype(dtype), progress=True)
        m.model.prepare_decode()
        meta = {"dtype": dtype, "kv_dtype": args.kv_dtype, "threads": torch.get_num_threads(),
                "min_rows": _rows(getattr(m.model, "decode_rows", None))}  # fmt: skip
        _log(f"measuring {dtype} matmul FLOP/s ...")
        flops = matmul_flops(torch_dtype(dtype))
        meta.update(copy_gb_s=bw / 1e9, matmul_gflop_s=flops / 1e9)
        rows = measure(m, args, kv_dtype, bw, flops, meta)
        if args.json:
            for r in rows:
                print(json.dumps(r))
        else:
            print(f"{Path(m.source).name}: compute {dtype}, KV {args.kv_dtype}, {meta['threads']} threads, "
                  f"copy {bw / 1e9:.1f} GB/s, matmul {flops / 1e9:.0f} GFLOP/s, decode min_rows "
                  f"{meta['min_rows']}")  # fmt: skip
            print(format_table(rows, COLS))
    return 0


def measure(m: LoadedModel, args: argparse.Namespace, kv_dtype: torch.dtype, bw: float, flops: float,
            meta: dict) -> list[dict]:
    """The prefill rows, then the decode rows, of one model."""
    m.model.prefill(torch.arange(8), kv_dtype=kv_dtype)  # warm up
    rows = []
    for n in args.prefill:
        _log(f"{meta['dtype']} prefill {n} tokens ...")
        rows.append(bench_prefill(m, n, args.reps, kv_dtype, flops) | meta)
    for b in args.batch:
        _log(f"{meta['dtype']} decode batch {b} at context {args.context} ...")
        rows.append(
            bench_decode(m, b, args.context, args.steps, kv_dtype, bw) | meta | {"context": args.context}
        )
    return rows


def _log(msg: str) -> None:
    print(f"[engine_bench] {msg}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
