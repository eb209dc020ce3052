"""Aggregate decode throughput through the DecodeEngine's scheduler (continuous batching).

B requests (prompt-len tokens each, already prefilled) are submitted at once to an engine with B
slots; the clock runs from the first submit to the last final event, so the figure includes the
scheduler, KV loading into slots, sampling, detokenizing and the per-token callbacks, not only the
model's decode_step. "model ms" is the time inside decode_step, "host ms" the time the scheduler spent
sampling, detokenizing and emitting (its share of the wall time is the engine's own cost).

    .venv/bin/python bench/decode_engine_bench.py --batches 1,4,16 [--json]
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import torch

from rngd_pd.config.dtypes import KV_DTYPES, torch_dtype
from rngd_pd.engine.decode import DecodeEngine
from rngd_pd.engine.prefill import PrefillEngine
from rngd_pd.engine.request import DecodeRequest, TokenEvent
from rngd_pd.model import load_model
from rngd_pd.model.sampling import SamplingParams


def run_batch(loaded, pre, batch: int, max_tokens: int, kv_dtype: torch.dtype) -> dict:
    """Decode `batch` copies of one prefilled prompt concurrently; return one result row."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    max_len = pre.num_tokens + max_tokens
    done = threading.Semaphore(0)
    first_at: list[float] = []
    counts = [0] * batch

    def emitter(i: int):
        def emit(ev: TokenEvent) -> None:
            counts[i] += ev.token_id is not None
            if ev.finished:
                done.release()
        return emit

    with DecodeEngine(loaded, num_slots=batch, max_len=max_len, kv_dtype=kv_dtype, buckets=[max_len]) as eng:
        for warm in (True, False):
            before = eng.stats()
            counts[:] = [0] * batch
            t0 = time.perf_counter()
            for i in range(batch):
                eng.submit(DecodeRequest(f"{warm}-{i}", pre.num_tokens, pre.first_token, params,
                                         lambda cache, slot: cache.load_all(slot, pre.kv), emitter(i)))
            first_at.append(time.perf_counter())
            for _ in range(batch):
                done.acquire()
            wall = time.perf_counter() - t0
        after = eng.stats()
    tokens = sum(counts)
    model_ms, host_ms = ((after[k] - before[k]) * 1e3 for k in ("model_s", "host_s"))
    return {"phase": "decode_engine", "batch": batch, "prompt_tokens": pre.num_tokens,
            "tokens": tokens, "ms": round(wall * 1e3, 1), "tok_s": round(tokens / wall, 1),
            "ms_per_step": round(wall * 1e3 / max(1, max_tokens - 1), 2),
            "steps": after["steps"] - before["steps"], "model_ms": round(model_ms, 1),
            "host_ms": round(host_ms, 1), "host_share": round(host_ms / (wall * 1e3), 4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="compute dtype")
    ap.add_argument("--kv-dtype", choices=list(KV_DTYPES), default="bf16")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--share-cores", action="store_true",
                    help="lend the scheduler the idle cores, as served (rngd_pd.devices.cores)")
    ap.add_argument("--json", action="store_true", help="one JSON object per row")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype=torch_dtype(args.dtype), progress=False)
    ids = (loaded.tokenizer.encode("the cat sat on the mat. " * args.prompt_len))[: args.prompt_len]
    if args.share_cores:
        from rngd_pd.devices.torch_runtime import as_runtime

        runtime = as_runtime(loaded)
        print(f"cores: {runtime.share_cores('decode')}")
        loaded = runtime
    kv_dtype = torch_dtype(args.kv_dtype)
    pre = PrefillEngine(loaded, kv_dtype).prefill("bench", ids, SamplingParams(max_tokens=args.max_tokens))
    rows = [run_batch(loaded, pre, int(b), args.max_tokens, kv_dtype) for b in args.batches.split(",")]
    base = rows[0]["tok_s"]
    for r in rows:
        r["speedup_vs_first"] = round(r["tok_s"] / base, 2)
        r.update(dtype=args.dtype, kv_dtype=args.kv_dtype, threads=torch.get_num_threads())
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    print(f"{'batch':>5} {'tokens':>7} {'wall ms':>9} {'tok/s':>8} {'ms/step':>8} {'model ms':>9} "
          f"{'host ms':>8} {'host %':>7} {'x first':>8}")
    for r in rows:
        print(f"{r['batch']:>5} {r['tokens']:>7} {r['ms']:>9} {r['tok_s']:>8} {r['ms_per_step']:>8} "
              f"{r['model_ms']:>9} {r['host_ms']:>8} {r['host_share']:>7.1%} {r['speedup_vs_first']:>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
